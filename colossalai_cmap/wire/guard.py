"""A rank's own backward through func, guarded: an exception there reaches every rank, as forward's does.

Rounds keep the group in step only where cmap's own code runs. A node of func's graph (a custom ``autograd.Function``
whose backward raises on one rank, a hook, an out-of-memory error) raises inside torch's engine, between cmap's
nodes: without a guard, that rank's ``.backward()`` raises the bare exception while its peers wait in the next
backward round, and the rank's next collective (the user's own ``dist.all_reduce``) pairs with that round.

:func:`guard` puts one node, ``_Guard``, at the boundary of func's graph on this rank, as checkpointing puts its node
around a recomputed graph: its inputs are the tensors the call's tagged Splits handed to func (its entry, the
closure interceptor's routes, shard_map's blocks), and its outputs stand for func's outputs. Its backward runs this
rank's backward through func's graph (``torch.autograd.grad`` down to those inputs) inside a ``try``, then takes
part in one ``SYNC`` round of its own, posting the failure there if the graph raised. A peer is then either in a
backward round inside func's graph or in its own guard's round: it meets the failure in that round, and every rank
raises the same ``CmapError`` (:func:`~.protocol.raise_failures`), the failing rank with its exception as
``__cause__``. Each rank has made the same rounds when ``.backward()`` raises, or returns.

It guards only where nothing else owns the graph's boundary: ordinary autograd (no ``torch.func`` transform or
forward-mode level around the call) and a graph whose only ways out are the tagged Splits (the closure walk found no
other edge). Elsewhere the call's backward runs unguarded, as before.
"""

from typing import Any, List, Sequence

import torch
import torch.autograd.forward_ad as fwAD

from . import protocol
from .exchange import CallTag
from .protocol import Header, Kind, Link, Status

WHAT = "the end of func's backward on every rank"
_DIGEST = 0x6A2D0001  # names the guard's round, for a peer at another collective


def guard(flat: List[Any], owner: CallTag, link: Link) -> List[Any]:
    """func's outputs ``flat``, with those that carry a gradient replaced by ``_Guard``'s stand-ins, where the
    backward through func's graph on this rank can be guarded (see the module's docstring); else ``flat``."""
    boundary = owner.take_entered()
    if link.group.pg is None or not boundary or not _plain_autograd():
        return flat
    picked = [i for i, v in enumerate(flat) if _guardable(v)]
    if not picked:
        return flat
    outs = _Guard.apply(link, tuple(flat[i] for i in picked), *boundary)
    guarded = list(flat)
    for i, v in zip(picked, outs):
        guarded[i] = v
    return guarded


def _plain_autograd() -> bool:
    return (
        torch.is_grad_enabled()
        and torch._C._functorch.maybe_current_level() is None
        and fwAD._current_level < 0
        and not torch.is_inference_mode_enabled()
    )


def _guardable(v: Any) -> bool:
    return (
        isinstance(v, torch.Tensor)
        and v.requires_grad
        and v.grad_fn is not None
        and not torch._C._functorch.is_functorch_wrapped_tensor(v)
    )


class _Guard(torch.autograd.Function):
    """Forward: func's outputs, detached (the outer graph meets func's only here and at the boundary). Backward:
    func's graph on this rank, inside a ``try``, then the guard's round. Never under a function transform
    (:func:`guard` checks), hence the plain ``ctx`` style."""

    @staticmethod
    def forward(ctx: Any, link: Link, outs: Sequence[torch.Tensor], *boundary: torch.Tensor) -> Any:
        ctx.link, ctx.outs, ctx.boundary = link, tuple(outs), boundary
        ctx.save_for_backward(boundary[0])  # freed by the engine after backward unless the graph is retained
        ctx.set_materialize_grads(False)
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        link = ctx.link
        found: Sequence[Any] = (None,) * len(ctx.boundary)
        failure = cause = None
        pairs = [(o, g) for o, g in zip(ctx.outs or (), grads) if g is not None]
        try:
            if ctx.outs is None:
                raise RuntimeError(
                    "Trying to backward through the graph a second time; specify retain_graph=True the first time."
                )
            if pairs:
                with protocol.guarding():
                    found = torch.autograd.grad(
                        [o for o, _ in pairs],
                        ctx.boundary,
                        [g for _, g in pairs],
                        retain_graph=True,  # the outer backward decides: dropped at its end unless it retains
                        create_graph=torch.is_grad_enabled(),
                        allow_unused=True,
                    )
        except Exception as exc:
            if protocol.was_told(exc, link):  # raised from a round: every rank raises it already
                raise
            failure, cause = link.group.failure(exc), exc
        _drop_unless_retained(ctx)
        header = Header(Kind.SYNC, Status.FAILED if failure is not None else Status.OK, digest=_DIGEST)
        rnd = protocol.checked_round(link, header, WHAT)
        protocol.raise_failures(rnd, failure, cause, link._replace(call=f"{link.call} (backward)"))
        return (None, None, *found)


def _drop_unless_retained(ctx: Any) -> None:
    """At the end of the outer backward: func's graph is let go unless that backward retained its own graph."""

    def check() -> None:
        try:
            ctx.saved_tensors
        except RuntimeError:  # released: the outer graph was not retained
            ctx.outs = None

    torch.autograd.Variable._execution_engine.queue_callback(check)
