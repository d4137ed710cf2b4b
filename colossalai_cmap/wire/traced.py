"""``Split`` and ``Join`` inside ``torch.compile``: each role of :mod:`.roles` written with functional collectives
(``torch_internals.functional_*``), which dynamo traces into the graph, as one autograd Function whose
backward is the other one's role (its transpose), so a compiled cmap's gradients are the eager ones. The named-axis
collectives lower to them there too (``axis.lowering``): a sum is ``Split(COPY)`` of ``Join(COPY)``, an all-gather
``Split(COPY)`` of ``Join(Rows)``, whose transposes are the eager Functions' (an all-reduce and this rank's rows).

No status round, no bounded wait, no presence tracking and no count of collectives: inside a graph a collective is
one op on the process group, waiting as long as the group's own timeout. Every rank must reach every collective; a
rank that failed before one leaves its peers waiting (docs/collectives.md, "torch.compile").
"""

from typing import Any, Callable, Optional, Tuple

import torch

from ..torch_internals import (
    differentiable_all_gather,
    functional_all_gather_op,
    functional_all_reduce,
    functional_broadcast,
    not_traced,
)
from .roles import (
    COPY,
    FIRST,
    FRACTION,
    IN_PLACE,
    MAX,
    MIN,
    Role,
    gather_padded,
    is_rows,
    join_transpose,
    split_transpose,
)

SPLIT, JOIN = "split", "join"
_REDUCE_OPS = {COPY: "sum", MAX: "max", MIN: "min"}


def move(way: str, role: Role, t: torch.Tensor, pg: Any, rank: int) -> torch.Tensor:
    """``t`` through a ``Split`` (global to per rank) or a ``Join`` (per rank to global) of ``role`` on ``pg``: the
    traced form of each role of :mod:`.roles`."""
    if is_rows(role):
        if way == JOIN:
            size = len(role.sizes)
            rows = t.movedim(role.dim, 0).narrow(0, 0, role.sizes[rank])  # a copy of another rank's rows sends none
            return gather_padded(rows, role.sizes, lambda p: functional_all_gather_op(p, size, pg)).movedim(0, role.dim)
        return t.narrow(role.dim, *role.held(rank))
    if way == JOIN and role in _REDUCE_OPS:
        return functional_all_reduce(t.contiguous(), _REDUCE_OPS[role], pg)
    if way == JOIN and role == FIRST:  # rank 0's value, on every rank
        return functional_broadcast(t.contiguous(), 0, pg)
    if role == FIRST:
        return t.clone() if rank == 0 else torch.zeros_like(t)
    if role == FRACTION:
        return t / torch.distributed.get_world_size(pg)
    if role == COPY or role in IN_PLACE:
        return t.clone()
    raise RuntimeError(f"a {role} over ranks has no traced {way}.")


class Traced(torch.autograd.Function):
    """One tensor through a traced Split or Join, every role: the one autograd Function inside ``torch.compile``;
    backward is the other, of the transposed role (:mod:`.roles`). ``forward(ctx, ...)`` style with plain calls in
    backward: dynamo traces neither ``setup_context`` nor ``Function.apply`` there, so this cannot be the eager
    ``Split``/``Join`` (whose ``apply`` in backward makes double backward and function transforms compose)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, way: str, role: Role, pg: Any, rank: int) -> torch.Tensor:
        ctx.way, ctx.role, ctx.pg, ctx.rank = way, role, pg, rank
        return move(way, role, t, pg, rank)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None, None]:
        if ctx.way == SPLIT:
            back = move(JOIN, split_transpose(ctx.role), grad, ctx.pg, ctx.rank)
        else:
            back = move(SPLIT, join_transpose(ctx.role), grad, ctx.pg, ctx.rank)
        return back, None, None, None, None


def traced_split(t: torch.Tensor, role: Role, pg: Any, rank: int) -> torch.Tensor:
    """A global value's per-rank part (``narrow`` for rows, the value itself otherwise); backward is the Join."""
    return Traced.apply(t, SPLIT, role, pg, rank)


def traced_join(t: torch.Tensor, role: Role, pg: Any, rank: int) -> torch.Tensor:
    """Per-rank values to the global one (rows all-gathered, sums all-reduced); backward is the Split."""
    return Traced.apply(t, JOIN, role, pg, rank)


def gather_under_vmap(t: torch.Tensor, pg: Any) -> torch.Tensor:
    """Every rank's ``t`` stacked along dim 0, differentiable inside a ``torch.vmap`` level, where no autograd
    Function can run in a compiled graph (functorch asks for ``setup_context``, which dynamo does not trace): the
    all-gather op with its own autograd kernel (backward: a reduce-scatter of the cotangents), waited on outside
    autograd, which has no kernel for the wait."""
    pending, done = differentiable_all_gather(t.contiguous(), torch.distributed.get_world_size(pg), pg)
    # done's values with pending's gradient: the difference is exactly zero where finite, and done is kept as is
    # where it is not (an infinite sum stays infinite, with no gradient, instead of inf - inf)
    return torch.where(done.isfinite(), pending + (done - pending).detach(), done)


def out_of_graph(fn: Callable[..., Any], why: str) -> Callable[..., Any]:
    """``fn``, run eagerly outside any graph (one graph break). With ``fullgraph=True`` dynamo's error shows the
    function's name, so it is named ``why``: the sentence that says why it cannot be traced and what to do. The one
    such wrapper: every map, collective and maker that runs out of the graph is named by its reason here."""

    def run(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    run.__name__ = run.__qualname__ = why
    return not_traced(run)
