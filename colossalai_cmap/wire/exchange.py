"""``Split`` and ``Join``, the two communication primitives every layer above uses, with their records and their
plain (not differentiable) sides.

``split_values`` takes this rank's part of global values (no communication); ``join_values`` makes per-rank values
global in one round of the status protocol (:mod:`.rounds`), and a data phase for what does not fit it
(:mod:`.data_phase`). A spec with ``checked=False`` takes no round: Megatron's *f* and *g* (``Split``/``Join`` of
``COPY``) and sequence parallelism's rows, for tensor-parallel layers, cost one collective as Megatron's do (a rank
that fails between layers leaves its peers waiting until the timeout, which then names it). The transpose keeps the
spec's ``checked``.

``Split`` and ``Join`` wrap them as autograd Functions that compose with functorch: each is a
``torch.autograd.Function`` in the ``setup_context`` style, with ``backward``, ``jvp`` and ``vmap`` rules, so that
torch's autograd and torch.func handle everything around them: closures, higher-order gradients,
``grad``/``vjp``/``jvp``/``jacrev``/``jacfwd``/``hessian``, an outer ``torch.vmap`` and nesting. The backward of each
is the other (:mod:`.roles` has the transpose of every role), built from ``apply`` calls, so double backward works.
Inside ``torch.compile`` the same roles move through :mod:`.traced` instead.

:func:`through` is the one choice between a Function and its plain side: the Function where a derivative or a
function transform needs it, else the plain side, without the Function machinery. :func:`join` and :func:`split`
are what the layers above call.
"""

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import faults
from ..errors import CmapError, RankFailure
from ..torch_internals import current_level, in_forward_ad, is_wrapped, transform_levels
from . import comm, data_phase, rounds
from .link import Link
from .payload import Room, Route, cached_route, pack_payload, unpack_payload
from .roles import (
    COPY,
    EVEN,
    FIRST,
    FRACTION,
    IN_PLACE,
    SHARE,
    Role,
    Rows,
    gather_padded,
    is_rows,
    join_transpose,
    shifted,
    split_transpose,
)
from .rounds import Header, Kind, Round, Status

# ---- the records, and the plain sides


class Exit(NamedTuple):
    """A call's exit: the status fields of this rank's header, and which of them every rank must agree on.

    After the round, before any data moves, :func:`join_values` compares the ``agree`` fields across every rank's
    header and the ``agree_nonempty`` fields across the ranks that ran real examples; the first that differs raises
    :class:`~colossalai_cmap.wire.rounds.Disagreement` on every rank, for the caller to explain.
    """

    status: int
    input_sig: int
    layout_sig: int
    batch: int  # cmap: the global batch size; shard_map: a digest of the block lengths taken as known (0: none)
    graph_sig: int
    flags: int
    values: int
    agree: Tuple[str, ...] = ()
    agree_nonempty: Tuple[str, ...] = ()
    along: Tuple[Link, ...] = ()  # groups whose status rounds go with this exit's first round (a mesh's axes)


@dataclass(eq=False)
class Learned:
    """What a call's exit round told every rank, filled in by :func:`join_values`: the caller reads it afterwards
    (in-place flags), and backward reads the row counts only the round knew (``src="local"``)."""

    table: Tuple[Header, ...] = ()


class JoinSpec(NamedTuple):
    """One Join: its tensors' roles, the round's kind and name, where the result goes, and a call's exit fields."""

    link: Link
    roles: Tuple[Role, ...]
    what: str = "a backward collective"
    kind: int = Kind.SYNC
    dst: int = -1  # -1: every rank gets the result; r: only group rank r (the others get None)
    exit: Optional[Exit] = None
    sync: bool = False  # a round even when nothing travels on this rank (its peers may have something)
    learned: Optional[Learned] = None  # filled in by its round (with an exit, or to read ``count``)
    host_metadata: bool = (
        False  # the tensors are host-side metadata (on the CPU): they may ride in a host group's round
    )
    count: int = 0  # a host-side number this rank reports in its header's rows (a Join with no Rows role): every
    # rank's comes back in ``learned``, with no read of the tensors (the count of values a sum is over)
    checked: bool = True  # a status round first; False: the collective alone (COPY or Rows), as Megatron's
    known: Optional[Tuple[torch.Tensor, ...]] = None  # the results, gathered already (by a call's exit round):
    # nothing moves, and the Function records the graph it would have (its backward and tangents are the same)
    # rounds on other groups, as (link, header), in flight with this one's in a guarded backward (its closing round)
    along: Tuple[Tuple[Link, Header], ...] = ()

    def sized_roles(self) -> Tuple[Role, ...]:
        """The roles with the row counts an exit learned from its round (``src="local"``) filled in."""
        if self.learned is None or all(not is_rows(r) or r.sizes is not None for r in self.roles):
            return self.roles
        sizes = tuple(h.rows for h in self.learned.table)
        return tuple(Rows(r.dim, sizes) if is_rows(r) and r.sizes is None else r for r in self.roles)


@dataclass(eq=False)
class CallTag:
    """Tags the entry ``Split`` nodes of one call: where the closure walk stops, and whether the call is still running
    func. A backward that reaches such a node while func runs is a gradient taken inside func (``torch.autograd.grad``
    or ``torch.func.grad`` per example), which stays per example: it gets this rank's share of the transpose, with no
    communication. Only a backward after the call, into the caller's graph, sums over the group.

    While func runs, the tag also notes each tagged Split it meets (weakly: the call holds the tensors), so that
    :mod:`.guard` can run this rank's backward through func's graph down to them, and their transposes after it.
    While the guard runs that backward, ``caught`` is set: a noted Split's backward then hands the gradients of its
    outputs to it (keyed by the entry's index and the output's) and stops there, so that the guard runs their
    transposes itself."""

    running: bool = True
    entries: List["Entry"] = field(default_factory=list)
    caught: Optional[Dict[Tuple[int, int], torch.Tensor]] = None
    held: List[torch.Tensor] = field(default_factory=list)  # what an entry took that the call made itself (a copy
    # in tile order): nothing else holds it until the entries are taken

    def note_entry(self, spec: Optional["SplitSpec"], inputs: Sequence[Any], outputs: Sequence[Any]) -> int:
        """Notes a tagged Split; returns its index among the entries, which :meth:`catch` takes."""
        self.entries.append(Entry(spec, tuple(_weak(x) for x in inputs), tuple(_weak(o) for o in outputs)))
        return len(self.entries) - 1

    def catches(self, ctx: Any) -> bool:
        """Whether the node ``ctx`` is a noted entry whose gradients the guard is taking now."""
        return self.caught is not None and getattr(ctx, "_cmap_entry", None) is not None

    def catch(self, ctx: Any, grads: Sequence[Optional[torch.Tensor]]) -> Tuple[None, ...]:
        """Keeps the gradients of the entry's outputs (summed, where its node runs more than once: a reentrant
        checkpoint's recomputation reaches it in a backward of its own); returns the node's empty gradients."""
        for k, g in enumerate(grads):
            if g is not None:
                key = (ctx._cmap_entry, k)
                self.caught[key] = g if key not in self.caught else self.caught[key] + g
        return (None,) * (len(grads) + 1)

    def take_entries(self) -> Optional[List["Entry"]]:
        """The tagged Splits met, in order, with their tensors; None if one of those is gone. Cleared."""
        found, self.entries = self.entries, []
        alive = [Entry(e.spec, tuple(r() for r in e.inputs), tuple(r() for r in e.outputs)) for e in found]
        self.held = []  # the entries hold them now
        return None if any(t is None for e in alive for t in e.inputs + e.outputs) else alive


class Entry(NamedTuple):
    """A tagged Split: its spec, the tensors it took and gave (weak references while noted). With no spec, a tensor
    from outside func that func used as it is (:func:`.guard.as_is`): its transpose is the identity."""

    spec: Optional["SplitSpec"]
    inputs: Tuple[Any, ...]
    outputs: Tuple[Any, ...]


def _weak(t: Any) -> Any:
    return weakref.ref(t) if isinstance(t, torch.Tensor) else (lambda: t)


class SplitSpec(NamedTuple):
    link: Link
    roles: Tuple[Role, ...]
    tag: Optional[CallTag] = None  # a call's entry (None: any other Split)
    checked: bool = True  # whether its transpose, a Join, takes a status round


def local_transpose(spec: SplitSpec, role: Role, grad: torch.Tensor) -> torch.Tensor:
    """A Split's transpose on this rank alone: the identity, or for rows this rank's rows in zeros of the whole."""
    if not is_rows(role):
        return grad
    before, n = role.held(spec.link.group.rank)
    after = sum(role.sizes) - before - n
    parts = [
        grad.new_zeros(_with(grad.shape, role.dim, before)),
        grad,
        grad.new_zeros(_with(grad.shape, role.dim, after)),
    ]
    return torch.cat(parts, role.dim)


def _with(shape: Sequence[int], dim: int, n: int) -> Tuple[int, ...]:
    out = list(shape)
    out[dim] = n
    return tuple(out)


def split_values(spec: SplitSpec, tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """Global values to this rank's per-rank values: no communication."""
    rank = spec.link.group.rank
    out = []
    for role, t in zip(spec.roles, tensors):
        if is_rows(role):
            out.append(t.narrow(role.dim, *role.held(rank)))
        elif role == FIRST and rank != 0:
            out.append(torch.zeros_like(t))
        elif role in (FRACTION, SHARE):
            out.append(t / spec.link.group.size)
        else:
            out.append(t)
    return tuple(out)


_TRAVELS_AS = {EVEN: FIRST, SHARE: COPY}  # rank 0's value; the mean over ranks: their sum, over P after it


def join_values(spec: JoinSpec, tensors: Sequence[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """Per-rank values to global ones: one round, and a data phase for what does not fit its payload."""
    if spec.known is not None:
        return spec.known
    if not spec.link.wired:  # alone: every value is already global, and a round would agree with itself
        return tuple(tensors)
    tensors = _sent(spec, tensors)
    if not spec.checked:
        return tuple(_round_free(spec, role, t) for role, t in zip(spec.roles, tensors))
    if any(r in _TRAVELS_AS for r in spec.roles):
        moved = join_values(spec._replace(roles=tuple(_TRAVELS_AS.get(r, r) for r in spec.roles)), tensors)
        return tuple(t / spec.link.group.size if r == SHARE else t for r, t in zip(spec.roles, moved))
    if spec.host_metadata:
        spec = spec._replace(link=spec.link.host_side())
    link = spec.link
    group = link.group
    # rows per rank: a Rows role's (None where only the round knows them); with no rows, none on any rank
    sizes = next((r.sizes for r in spec.roles if is_rows(r)), (0,) * group.size)
    if any(t.is_meta for t in tensors):
        return _shapes_only(spec, tensors, sizes)
    ch = link.channel()
    rt = _route(link, (spec.what, spec.roles, sizes, spec.dst), tensors, host_metadata=spec.host_metadata, ch=ch)
    if not rt.items and spec.exit is None and not spec.sync:
        return tuple(tensors)  # nothing moves, nothing to agree on
    prep, results, failure, cause = None, {}, None, None
    try:  # everything that can fail on one rank, before the round that tells every rank
        if faults.ACTIVE:
            faults.check("backward" if spec.kind == Kind.SYNC else "pack", group)
        if rt.fits:
            pack_payload(rt, tensors)
        if rt.inline is False and rt.items:
            if faults.ACTIVE:
                faults.check("gather", group)
            prep = data_phase.prepare(rt.items, tensors, rt.sizes, group, spec.dst)
    except Exception as exc:
        failure, cause = group.failure(exc), exc
    # the round before this one: the data phase that followed it the last time goes right behind this round, where
    # this one's has its shape (every rank at this point expects that shape: it sends it early, or a stand-in of it)
    before = ch.last
    early = data_phase.early(prep, ch.expected_data(), link, spec.dst)
    rnd = _round(spec, _header(spec, rt, failure, early is not None), early)
    if rnd.failed:
        rounds.raise_failures(rnd, failure, cause, link._replace(call=_name(spec)), in_func=spec.kind == Kind.OP)
    if spec.learned is not None:
        spec.learned.table = rnd.table
    if spec.exit is not None:
        rounds.check_agreement(rnd.table, spec.exit.agree, spec.exit.agree_nonempty)
    if rt.items:
        results, prep = _deliver(spec, rt, rnd, tensors, prep)
    ch.note_data(before, data_phase.shape_of(prep, link, spec.dst))  # every rank passed the round: in step
    return tuple(_output(role, t, results.get(i)) for i, (role, t) in enumerate(zip(spec.roles, tensors)))


def _sent(spec: JoinSpec, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """What this rank sends of each tensor: a copy of another rank's rows sends none (:class:`~.roles.Rows`)."""
    rank = spec.link.group.rank
    if all(not is_rows(r) or r.sends(rank) for r in spec.roles):
        return tensors
    return [t if not is_rows(r) or r.sends(rank) else t.narrow(r.dim, 0, 0) for r, t in zip(spec.roles, tensors)]


def _round_free(spec: JoinSpec, role: Role, x: torch.Tensor) -> torch.Tensor:
    """A Join with no status round: Megatron's *g* (the sum over ranks, one all-reduce), or every rank's rows (one
    all-gather of shares padded to the largest)."""
    link = spec.link
    if role == COPY:
        return all_reduce(link, x)
    if not is_rows(role):
        raise NotImplementedError(f"{link.call}: a {role} over ranks has no round-free Join.")
    rows = x if role.dim == 0 else x.movedim(role.dim, 0)
    full = gather_padded(rows, role.sizes, lambda padded: _all_gather(link, padded, spec.what))
    return (full if role.dim == 0 else full.movedim(0, role.dim)).contiguous()


def _all_gather(link: Link, rows: torch.Tensor, what: str) -> torch.Tensor:
    out = rows.new_empty((rows.shape[0] * link.group.size, *rows.shape[1:]))
    comm.all_gather_into(out, rows, link.group, link.call, link.timeout, f"all_gather ({what})")
    return out


def all_reduce(link: Link, x: torch.Tensor) -> torch.Tensor:
    """The sum over the group of every rank's ``x``, with no status round: Megatron's *g*, the plain side of
    ``Join`` of ``COPY`` with ``checked=False``. A rank that fails before it leaves its peers waiting until the
    timeout, as in Megatron."""
    if x.is_meta:
        return torch.empty_like(x)
    out = x.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    comm.all_reduce(torch.view_as_real(out) if out.is_complex() else out, link.group, link.call, link.timeout)
    return out


_ROUTES_MAX = 512


def _route(
    link: Link,
    key: Tuple[Any, ...],
    tensors: Sequence[torch.Tensor],
    after: Optional[Any] = None,
    host_metadata: bool = False,
    ch: Optional[Any] = None,
) -> Route:
    """The route of an exchange on this group (:class:`Route`), kept with the group's round buffers; or, ``after`` a
    round (when only the round told the row counts), through that round's payloads, whatever buffers come next.

    Over a host group, only ``host_metadata`` tensors (host-side metadata, made on the CPU) ride in the round: data takes its
    own collective on the data's group, so the round never copies device memory. ``ch``: the link's channel, where
    the caller has it."""
    ch, inline, rank = ch if ch is not None else link.channel(), host_metadata or link.host is None, link.group.rank
    if after is not None:
        return cached_route({}, rank, Room(after.payloads[rank], after.payloads, 0, 0), key, tensors, inline)
    buffers = ch.buffers
    if len(buffers.routes) > _ROUTES_MAX:
        buffers.routes.clear()
    room = Room(buffers.payload, buffers.payloads, ch.max, ch.fuse_max)
    return cached_route(buffers.routes, rank, room, key, tensors, inline)


def _deliver(spec: JoinSpec, rt: Any, rnd: Round, tensors: Sequence[torch.Tensor], prep: Any) -> Tuple[dict, Any]:
    """After the round: the payloads into the results, or the data phase (the row counts come from the round
    when only it knew them: ``src="local"``, a shard_map exit); and the data phase as prepared (None: none)."""
    link = spec.link
    if rt.sizes is None:
        sizes = tuple(h.rows for h in rnd.table)
        rt = _route(link, (spec.what, spec.roles, sizes, spec.dst), tensors, rnd, spec.host_metadata)
        if not rnd.inline:
            prep = data_phase.prepare(rt.items, tensors, sizes, link.group, spec.dst)
    if rnd.inline:
        return unpack_payload(rt, spec.dst in (-1, link.group.rank)), None
    if all(h.early for h in rnd.table):
        return data_phase.taken_early(prep), prep
    if prep.flats and rnd.table[link.group.rank].early:  # this rank's sum went early, paired with a stand-in
        prep = data_phase.prepare(rt.items, tensors, rt.sizes, link.group, spec.dst)
    return data_phase.run_data_phase(prep, link.group, spec.dst, link.call, link.timeout), prep


def _shapes_only(
    spec: JoinSpec, tensors: Sequence[torch.Tensor], sizes: Optional[Tuple[int, ...]]
) -> Tuple[torch.Tensor, ...]:
    """The meta implementation: the results' shapes and dtypes, with no communication."""
    out = []
    for role, t in zip(spec.roles, tensors):
        if is_rows(role):
            if sizes is None:
                raise ValueError(f"{spec.link.call}: meta tensors with src='local': the global row count is unknown.")
            shape = list(t.shape)
            shape[role.dim] = sum(sizes)
            out.append(t.new_empty(shape))
        else:
            out.append(torch.empty_like(t))
    return tuple(out)


def _output(role: Role, mine: torch.Tensor, found: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if found is not None:
        return found.movedim(0, role.dim) if is_rows(role) and role.dim else found
    return mine if role in IN_PLACE else None  # a travelling tensor off dst


def report_failure(spec: JoinSpec, failure: RankFailure, cause: BaseException, along: Sequence[Link] = ()) -> None:
    """This rank's side of a call's exit when func raised here: the same round, then every rank raises. ``along``:
    groups whose status rounds this rank's exit takes too, issued with this one, all before any is waited for (a peer
    may be waiting on any of them)."""
    link = spec.link
    if not link.wired:  # alone: this rank's failure is the whole table
        raise rounds.told(CmapError.from_failures(link.call, [failure], link.group.rank), link) from cause
    header = Header(kind=Kind.STATUS, status=Status.FAILED, inline=1)
    rnd = rounds.status_round(link, header, along=along)
    rounds.raise_failures(rnd, failure, cause, link)
    raise AssertionError("unreachable: this rank reported a failure")  # pragma: no cover


def _header(spec: JoinSpec, rt: Any, failure: Any, early: bool = False) -> Header:
    status = Status.FAILED if failure is not None else Status.OK
    ex = spec.exit
    if ex is None:
        rows = rt.rows or spec.count
        return Header(
            kind=spec.kind,
            status=status,
            rows=rows,
            digest=rt.digest,
            block=rt.block,
            inline=int(rt.fits),
            early=int(early),
        )
    status = status if status == Status.FAILED else ex.status
    return Header(
        kind=Kind.STATUS,
        status=status,
        rows=rt.rows,
        input_sig=ex.input_sig,
        digest=ex.layout_sig,
        batch=ex.batch,
        block=rt.block,
        inline=int(rt.fits),
        graph_sig=ex.graph_sig,
        flags=ex.flags,
        values=ex.values,
        early=int(early),
    )


def _round(spec: JoinSpec, header: Header, early: Optional[Callable[[], Any]] = None) -> Round:
    link = spec.link
    if spec.kind == Kind.STATUS:
        return rounds.status_round(link, header, early, spec.exit.along if spec.exit is not None else ())
    return rounds.checked_round(link, header, spec.what, early, spec.along)


def _name(spec: JoinSpec) -> str:
    return spec.link.call if spec.kind == Kind.STATUS else f"{spec.link.call}: {spec.what}"


# ---- the autograd Functions, and the verbs the layers above call


def requires_grad(t: Any) -> bool:
    """Whether ``t`` requires grad at any autograd level (a vmap wrapper hides its inner tensor's flag)."""
    if not isinstance(t, torch.Tensor):
        return False
    if t.requires_grad or not is_wrapped(t):  # a plain tensor (the common case) has one level: its own
        return t.requires_grad
    return any(level.requires_grad for level in transform_levels(t))


def needs_function(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the Function machinery is needed: a derivative to track (forward-mode too), or a function transform to
    obey."""
    if current_level() is not None or in_forward_ad():
        return True
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def through(fn: Any, plain: Callable[[Any, Sequence[torch.Tensor]], Any], spec: Any, tensors: Sequence[Any]) -> Any:
    """``fn.apply(spec, *tensors)`` where a derivative or a function transform needs it, else ``plain(spec,
    tensors)``, without the Function machinery: the one choice every exchange makes. Alone (an unwired link)
    nothing moves either way, so the plain side serves."""
    if spec.link.wired and needs_function(tensors):
        return fn.apply(spec, *tensors)
    return plain(spec, tensors)


def join(spec: JoinSpec, tensors: Sequence[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """Per-rank values to global ones, through :func:`through` (never :class:`Join` with a ``dst``: only that rank
    gets the result, so no backward could meet)."""
    if spec.dst != -1:
        return join_values(spec, tensors)
    return through(Join, join_values, spec, tensors)


def split(spec: SplitSpec, tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """Global values to per-rank ones, through :func:`through`. Inside a map call's ``f`` on a mesh, its group is
    noted where its transpose's round in backward would be the only one there (:func:`~.rounds.note_split`)."""
    if spec.checked and spec.link.wired:
        rounds.note_split(spec.link)
    return through(Split, split_values, spec, tensors)


def _non_differentiable(ctx: Any, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
    """Outputs that carry no derivative, as vmap's would: integer ones, and (outside function transforms and
    forward-mode AD) those whose input needs none, so that ``requires_grad`` comes back as the input had it."""
    plain = current_level() is None and not in_forward_ad()
    fixed = [
        o
        for o, x in zip(outputs, inputs)
        if isinstance(o, torch.Tensor)
        and (not (o.is_floating_point() or o.is_complex()) or (plain and not x.requires_grad))
    ]
    if fixed:
        ctx.mark_non_differentiable(*fixed)


def _wanted(ctx: Any, grads: Sequence[Any]) -> list:
    return [i for i, g in enumerate(grads) if ctx.needs_input_grad[i + 1] and g is not None]


def _spread(picked: Sequence[int], values: Sequence[Any], count: int) -> Tuple[Any, ...]:
    out: list = [None] * count
    for i, v in zip(picked, values):
        out[i] = v
    return (None, *out)


def _vmapped(apply: Callable, spec: Any, in_dims: Sequence[Optional[int]], xs: Sequence[Any]) -> Tuple[Any, Any]:
    """Both vmap rules: each batched tensor's vmap dim goes to the front, row dims shift by one; one collective."""
    batched = [d is not None for d in in_dims[1:]]
    moved = [x.movedim(d, 0) if d is not None else x for x, d in zip(xs, in_dims[1:])]
    out = apply(spec._replace(roles=shifted(spec.roles, batched)), *moved)
    return out, tuple(0 if b else None for b in batched)


class Join(torch.autograd.Function):
    """Per-rank values to global ones (see :mod:`.roles`); backward is :class:`Split`."""

    @staticmethod
    def forward(spec: JoinSpec, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return tuple(o if o is not x else x.view_as(x) for o, x in zip(join_values(spec, xs), xs))

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]
        ctx.like = [(x.shape, x.dtype, x.device) for x in inputs[1:]]  # zeros for a missing tangent
        _non_differentiable(ctx, inputs[1:], output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        spec, picked = ctx.spec, _wanted(ctx, grads)
        sized = spec.sized_roles()
        roles = [join_transpose(sized[i]) for i in picked]
        sub = SplitSpec(spec.link, tuple(roles), checked=spec.checked)
        out = Split.apply(sub, *[grads[i] for i in picked]) if picked else ()
        return _spread(picked, out, len(grads))

    @staticmethod
    def jvp(ctx: Any, _: Any, *tangents: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        # Every rank joins every tangent (zeros where one has none): a peer's may be set where this one's is not.
        full = [t if t is not None else torch.zeros(s, dtype=d, device=v) for t, (s, d, v) in zip(tangents, ctx.like)]
        what = f"the tangents of {ctx.spec.what}"
        sub = JoinSpec(ctx.spec.link, ctx.spec.sized_roles(), what, sync=True, checked=ctx.spec.checked)
        return tuple(Join.apply(sub, *full))

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], spec: JoinSpec, *xs: torch.Tensor) -> Tuple[Any, Any]:
        return _vmapped(Join.apply, spec, in_dims, xs)


class Split(torch.autograd.Function):
    """Global values to this rank's per-rank values (see :mod:`.roles`); backward is :class:`Join`."""

    @staticmethod
    def forward(spec: SplitSpec, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return tuple(o if o is not x else x.view_as(x) for o, x in zip(split_values(spec, xs), xs))

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]
        tag = inputs[0].tag
        if tag is not None:
            ctx._cmap_tag = tag
            if tag.running:
                ctx._cmap_entry = tag.note_entry(inputs[0], inputs[1:], output)
        ctx.set_materialize_grads(False)  # an unused value gets no gradient (None), as without cmap
        _non_differentiable(ctx, inputs[1:], output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        spec, picked = ctx.spec, _wanted(ctx, grads)
        if spec.tag is not None and spec.tag.catches(ctx):  # the guard's backward: it runs the transpose
            return spec.tag.catch(ctx, grads)
        if spec.tag is not None and spec.tag.running:  # a gradient taken inside func: per example, here
            return _spread(picked, [local_transpose(spec, spec.roles[i], grads[i]) for i in picked], len(grads))
        roles = tuple(split_transpose(spec.roles[i]) for i in picked)
        sub = JoinSpec(spec.link, roles, checked=spec.checked)
        out = Join.apply(sub, *[grads[i] for i in picked]) if picked else ()
        return _spread(picked, out, len(grads))

    @staticmethod
    def jvp(ctx: Any, _: Any, *tangents: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        spec = ctx.spec
        picked = [i for i, t in enumerate(tangents) if t is not None]
        sub = SplitSpec(spec.link, tuple(spec.roles[i] for i in picked), checked=spec.checked)
        out = Split.apply(sub, *[tangents[i] for i in picked]) if picked else ()
        return _spread(picked, out, len(tangents))[1:]

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], spec: SplitSpec, *xs: torch.Tensor) -> Tuple[Any, Any]:
        return _vmapped(Split.apply, spec, in_dims, xs)


class _Refused(torch.autograd.Function):
    """Identity forward; backward raises the message (no collective is involved, so nothing can hang)."""

    @staticmethod
    def forward(message: str, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.message = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, ...]:
        raise RuntimeError(ctx.message)


def not_differentiable(value: Any, message: str) -> Any:
    """``value`` marked so that backpropagating through it raises ``message``."""
    if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
        return value
    return _Refused.apply(message, value.detach().requires_grad_())


__all__ = ["Join", "Split", "join", "split", "through", "all_reduce", "requires_grad", "not_differentiable"]
