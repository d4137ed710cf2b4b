"""A rank's own backward through func, guarded: an exception there reaches every rank, as forward's does.

Rounds keep the group in step only where cmap's own code runs. A node of func's graph (a custom ``autograd.Function``
whose backward raises on one rank, a hook, an out-of-memory error) raises inside torch's engine, between cmap's
nodes: without a guard, that rank's ``.backward()`` raises the bare exception while its peers wait in the next
backward round, and the rank's next collective (the user's own ``dist.all_reduce``) pairs with that round.

:func:`guard` puts one node, ``_Guard``, at the boundary of func's graph on this rank, as checkpointing puts its node
around a recomputed graph. Its inputs are what the call's tagged Splits took (the caller's tensors, through its
entry, the closure interceptor's routes, shard_map's blocks), and with shard_map's varying-axis types what func
used as it is (:func:`as_is`: a replicated block, a closure, a parameter; its transpose moves nothing); its outputs stand for func's outputs. Its backward runs
this rank's backward through func's graph (``torch.autograd.backward`` from func's outputs, the tag's entries handing
their gradients over and stopping there: :meth:`~.exchange.CallTag.catch`) inside a ``try``, then the Splits'
transposes itself, each a ``Join`` as their own backward would be, so the node that catches an
exception is the node that owns the next round. If func's graph raised, it posts the failure in a ``SYNC`` round
instead: a peer is then in one of those Joins or in a backward round inside func's graph, meets the failure there,
and every rank raises the same ``CmapError`` (:func:`~.rounds.raise_failures`), the failing rank with its
exception as ``__cause__``. Each rank has made the same rounds when ``.backward()`` raises, or returns. The Joins
are the rounds the Splits' backward made before, so the guard costs no round; only where none of them
communicates (``src="local"`` with ``dst="local"`` and no closure) does it add one, so that a failure has a round to
travel in.

``backward`` rather than ``torch.autograd.grad`` down to the Splits' outputs: a reentrant ``torch.utils.checkpoint``
inside func runs a backward of its own in its node, which torch refuses under ``.grad()``. Its recomputation runs
in ``replay``, the context func ran in (the caller's: its modules' aliases, its closure interceptor), so that the
recomputed graph reaches the call's entry too.

It guards only where nothing else owns the graph's boundary: ordinary autograd (no ``torch.func`` transform or
forward-mode level around the call), a graph whose only ways out are the tagged nodes (the closure walk found no
other edge), at least one of them a Split (its Join ends the backward), all on the call's own group (for shard_map,
the whole mesh's or one of its axes'); or, for shard_map, tagged nodes that all take their input as it is (with
types, a replicated input: jax's data-parallel weights, whose gradient's sum is the transpose of a ``pcast`` inside
f's graph, which may run before the failing node), where the closing round below ends the backward. Elsewhere the
call's backward runs unguarded, as before. On a mesh of several
axes a peer may wait in a round on one axis's group (or, on a mesh of three or more, on a group of several axes that
func took a round on, or that a Split in func takes one on in backward), so a failure is posted on each of them too
(:func:`~.rounds.fan_out`); where the Splits' Joins take no round on the whole mesh's group and none on some axis, a
round on the whole mesh's (``CLOSING``) ends the backward, so that a rank whose Joins met no failure meets it. It
is taken with the last Join's round, in flight together (:func:`~.rounds.checked_round`'s ``along``)."""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..torch_internals import after_backward, current_level, in_forward_ad, is_wrapped
from . import rounds
from .exchange import CallTag, Entry, JoinSpec, join
from .link import Link
from .roles import split_transpose
from .rounds import Header, Kind

WHAT = "the gradients of func's inputs"
CLOSING = Header(kind=Kind.SYNC, digest=0x6A2D0003)  # the round on the whole mesh that ends a guarded backward there
Replay = Callable[[], ContextManager[Any]]  # the context a recomputation of func (reentrant checkpointing) runs in


def guard(
    flat: List[Any], tag: CallTag, link: Link, replay: Optional[Replay] = None, axes: Sequence[Link] = ()
) -> List[Any]:
    """func's outputs ``flat``, with those that carry a gradient replaced by ``_Guard``'s stand-ins, where the
    backward through func's graph on this rank can be guarded (see the module's docstring); else ``flat``.
    ``replay`` is the context func ran in (its modules' aliases): a recomputation in that backward runs in it.
    ``axes``: a mesh's axes' links, where ``link`` is its whole group's (a failure is posted on each of them too)."""
    entries = tag.take_entries()
    splits = [e for e in entries or () if e.spec is not None]
    # the round a failure rides: a Split's Join, or on a mesh where every input enters as it is (typed replicated
    # inputs, whose transposes inside f's graph may run before the failing node), the closing round
    if link.group.pg is None or not (splits or (axes and entries)) or not _plain_autograd():
        return flat
    groups = [g.round_group.pg for g in (link, *axes)]  # the Splits' Joins must take one of them
    if any(all(e.spec.link.round_group.pg is not pg for pg in groups) for e in splits):
        return flat
    picked = [i for i, v in enumerate(flat) if _guardable(v)]
    inputs = _inputs(entries)
    if not picked or not inputs:
        return flat
    graph = _Graph(
        link=link,
        axes=tuple(axes),
        parts=_parts(link, axes),
        tag=tag,
        outs=tuple(flat[i] for i in picked),
        entries=entries,
        inputs=inputs,
        replay=replay or contextlib.nullcontext,
    )
    outs = _Guard.apply(graph, *inputs)
    guarded = list(flat)
    for i, v in zip(picked, outs):
        guarded[i] = v
    return guarded


@dataclass(eq=False)
class _Graph:
    """What the guard's backward needs: func's outputs, the Splits at its boundary, and the guard's inputs; where it
    runs (the call's link, a mesh's axes' links, and :func:`_parts`) and what a recomputation runs in. ``outs`` is let
    go (None) at the end of an outer backward that did not retain its graph."""

    link: Link
    axes: Tuple[Link, ...]
    parts: Tuple[Link, ...]  # the mesh's other groups its backward may take a round on: a failure is posted there too
    tag: CallTag
    outs: Optional[tuple]
    entries: List[Entry]
    inputs: List[torch.Tensor]
    replay: Replay
    boundary: bool = field(init=False)  # a Split's output carries a gradient: func's graph has one to run
    closing: bool = field(init=False)  # a round on the whole mesh ends the backward (:func:`_needs_closing`)

    def __post_init__(self) -> None:
        self.boundary = any(o.requires_grad for e in self.entries for o in e.outputs)
        self.closing = _needs_closing(self.link, self.axes, self.entries)


def _parts(link: Link, axes: Sequence[Link]) -> Tuple[Link, ...]:
    """The groups of a mesh, other than its whole group and its axes', that func's backward may take a round on:
    those its rounds took (:func:`~.rounds.parts_in_func`) and those only its Splits' transposes take (a ``pcast`` to
    varying over several axes, :func:`~.rounds.split_parts`), once each."""
    if not axes:
        return ()
    on_axes = {a.round_group.pg for a in axes}  # the guard posts there anyway
    found: Dict[Any, Link] = {}
    for part in (*rounds.parts_in_func(link, axes), *rounds.split_parts(link, axes)):
        if part.round_group.pg not in on_axes:
            found.setdefault(part.round_group.pg, part)
    return tuple(found.values())


def _needs_closing(link: Link, axes: Sequence[Link], entries: List[Entry]) -> bool:
    """Whether a round on the whole mesh must end the guarded backward: on a mesh of several axes, where the Splits'
    Joins (every rank makes each, in one order) take no round on the whole mesh's group and none on some axis's longer
    than one. Rounds on every axis reach every rank from a failing one (a rank that meets the failure posts it on
    its other groups, where its peers' Joins still wait); rounds on some axes only leave ranks that never share a
    group with a failing or told rank, which would finish while their peers' posts wait for them."""
    if not axes:
        return False
    met = [e.spec.link.round_group.pg for e in entries if e.spec is not None]
    if any(pg is link.round_group.pg for pg in met):
        return False
    return any(a.round_group.size > 1 and all(pg is not a.round_group.pg for pg in met) for a in axes)


def _inputs(entries: List[Entry]) -> List[torch.Tensor]:
    """The tensors the tagged Splits took from outside func (not another Split's output), once each."""
    made = {id(o) for e in entries for o in e.outputs}
    seen: Dict[int, torch.Tensor] = {}
    for e in entries:
        for x in e.inputs:
            if isinstance(x, torch.Tensor) and x.requires_grad and id(x) not in made:
                seen.setdefault(id(x), x)
    return list(seen.values())


def as_is(tag: CallTag, t: torch.Tensor) -> torch.Tensor:
    """``t``, a tensor from outside func, as func's graph meets it: an alias noted with the call's tag, so that the
    guard's backward stops there and hands ``t`` its gradient (no communication: the value enters as it is)."""
    return _AsIs.apply(tag, t)


class _AsIs(torch.autograd.Function):
    """Identity, as a node of the call's boundary (tagged as its Splits are: the graph walk stops at it)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(tag: CallTag, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        tag = inputs[0]
        ctx._cmap_tag = tag
        if tag.running:
            ctx._cmap_entry = tag.note_entry(None, inputs[1:], (output,))
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, grad: Optional[torch.Tensor]) -> Tuple[None, Optional[torch.Tensor]]:
        if ctx._cmap_tag.catches(ctx):
            return ctx._cmap_tag.catch(ctx, (grad,))
        return None, grad


def _plain_autograd() -> bool:
    return (
        torch.is_grad_enabled()
        and current_level() is None
        and not in_forward_ad()
        and not torch.is_inference_mode_enabled()
    )


def _guardable(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.requires_grad and v.grad_fn is not None and not is_wrapped(v)


class _Guard(torch.autograd.Function):
    """Forward: func's outputs, detached (the outer graph meets func's only through this node). Backward: func's
    graph on this rank inside a ``try``, then the boundary Splits' Joins. Never under a function transform
    (:func:`guard` checks), hence the plain ``ctx`` style."""

    @staticmethod
    def forward(ctx: Any, graph: _Graph, *inputs: torch.Tensor) -> Any:
        ctx.graph = graph
        ctx.save_for_backward(inputs[0])  # freed by the engine after backward unless the graph is retained
        ctx.set_materialize_grads(False)
        return tuple(o.detach() for o in graph.outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        graph: Optional[_Graph] = ctx.graph
        link = graph.link
        at: Dict[int, torch.Tensor] = {}
        failure = cause = None
        with rounds.guarding(link, graph.axes + graph.parts):  # a failure met in a round here fans out over them
            try:
                if graph.outs is None:
                    raise RuntimeError(
                        "Trying to backward through the graph a second time; specify retain_graph=True the first time."
                    )
                pairs = [(o, g) for o, g in zip(graph.outs, grads) if g is not None]
                if pairs and graph.boundary:
                    with _catching(graph.tag) as caught, graph.replay():
                        torch.autograd.backward(
                            [o for o, _ in pairs],
                            [g for _, g in pairs],
                            retain_graph=True,  # the outer backward decides: let go at its end unless it retains
                            create_graph=torch.is_grad_enabled(),
                        )
                    at = {id(graph.entries[i].outputs[k]): g for (i, k), g in caught.items()}
            except Exception as exc:
                if rounds.was_told(exc, link):  # raised from a round: every rank raises it already
                    raise
                failure, cause = link.group.failure(exc), exc
            _let_go_unless_retained(ctx, graph)
            if failure is not None:
                rounds.raise_failures(rounds.failure_round(link, WHAT), failure, cause, link, posted=True)
            # the closing round goes with the last Join, in flight together (inside another call's f, where a
            # round may be announced first, after it)
            along = graph.closing and not rounds.in_func_on_mesh()
            _transposes(graph, at, ((link, CLOSING),) if along else ())
            if graph.closing:
                rnd = rounds.taken_along(link)
                if rnd is None:  # not taken with a Join (none took a round: alone, or meta tensors)
                    rnd = rounds.checked_round(link, CLOSING, WHAT)
                rounds.raise_failures(rounds.check_round(link, CLOSING, WHAT, rnd), None, None, link)
        return (None, *[at.get(id(x)) for x in graph.inputs])


@contextlib.contextmanager
def _catching(tag: CallTag) -> Iterator[Dict[Tuple[int, int], torch.Tensor]]:
    """While func's graph runs backward: the call's entries hand their gradients over instead of running their
    transposes (:meth:`CallTag.catch`)."""
    tag.caught = caught = {}
    try:
        yield caught
    finally:
        tag.caught = None


def _transposes(graph: _Graph, at: Dict[int, torch.Tensor], along: Tuple[Tuple[Link, Header], ...] = ()) -> None:
    """Each boundary Split's backward, last first (a chain's outer Split gets its inner one's gradients): one
    ``Join`` of the transposed roles, always a round (a peer's failure may wait in it). ``along``: rounds the last
    Join's round takes in flight with it (the closing round)."""
    last = min((i for i, e in enumerate(graph.entries) if e.spec is not None), default=-1)
    for k in reversed(range(len(graph.entries))):
        e = graph.entries[k]
        gs = [at.pop(id(o), None) for o in e.outputs]
        if e.spec is None:  # used as it is: its gradient is the alias's
            key = id(e.inputs[0])
            if gs[0] is not None:
                at[key] = gs[0] if key not in at else at[key] + gs[0]
            continue
        picked = [i for i, (x, g) in enumerate(zip(e.inputs, gs)) if g is not None and x.requires_grad]
        roles = tuple(split_transpose(e.spec.roles[i]) for i in picked)
        spec = JoinSpec(e.spec.link, roles, sync=True, along=along if k == last else ())
        for i, g in zip(picked, join(spec, [gs[i] for i in picked])):
            key = id(e.inputs[i])
            at[key] = g if key not in at else at[key] + g


def _let_go_unless_retained(ctx: Any, graph: _Graph) -> None:
    """At the end of the outer backward: func's graph is let go unless that backward retained its own graph."""

    def check() -> None:
        try:
            ctx.saved_tensors
        except RuntimeError:  # released: the outer graph was not retained
            graph.outs = None

    after_backward(check)
