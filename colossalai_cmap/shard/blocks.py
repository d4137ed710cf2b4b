"""Global values to this rank's blocks and back, one mesh axis at a time, with the two wire primitives.

Cutting a block is a ``Split`` per axis (this rank's rows along a split axis; along an axis the spec leaves out, the
value itself): no communication. Its transpose, in backward, is a ``Join`` per axis in the reverse order: the
block's gradients summed over the replicated axes, then gathered along the split ones, so each global input's
``.grad`` is the whole gradient, on every rank.

Assembling is a ``Join`` per axis: along an axis the spec leaves out, the value at coordinate 0 of that axis (jax
reads a replicated output from one device too); then every block, gathered along the split axes. Its transpose is a
``Split``: this rank's block of the output's cotangent, over the size of each replicated axis (jax splits the
cotangent of a replicated output evenly across its copies, so an output that in fact varies gets jax's gradient).
Every rank holds the global output, and its cotangent counts once over the mesh: this is jax's transposition with
``check_vma=False``, where ``psum`` transposes to ``psum``.

With ``local=True`` nothing is cut or assembled, but the gradients are the same: along an axis the spec leaves out,
an argument enters through a ``Split(COPY)`` (its gradient summed over the axis, as a replicated global input's) and
an output leaves through a ``Join(ONCE)`` (each rank its cotangent over the axis size, so the ranks' copies of one
replicated value count once).
"""

from typing import Any, Dict, List, Optional, Sequence

import torch

from ..torch_internals import outside_transforms
from ..wire.exchange import CallTag, JoinSpec, SplitSpec, join, requires_grad, split
from ..wire.link import Link
from ..wire.roles import COPY, FIRST, ONCE, is_rows
from ..wire.rounds import Kind
from .specs import Placement, Step


def cut(
    values: Sequence[Any], places: Sequence[Placement], links: Dict[str, Link], view: Any, tag: CallTag
) -> List[Any]:
    """Each global value's block on this rank (the tag marks the entry, as a cmap call's)."""
    steps = [
        p.cut_steps(v.shape, view.sizes, view.coords) if isinstance(v, torch.Tensor) else []
        for v, p in zip(values, places)
    ]
    return _run(list(values), steps, lambda axis, roles, xs: split(SplitSpec(links[axis], roles, tag), xs))


def cut_local(values: Sequence[Any], places: Sequence[Placement], links: Dict[str, Link], tag: CallTag) -> List[Any]:
    """``local=True``: each block as given, through a ``Split(COPY)`` on every axis its spec leaves out (no
    communication; backward sums the gradient over those axes)."""
    steps = [
        [Step(a, COPY) for a in p.replicated] if isinstance(v, torch.Tensor) else [] for v, p in zip(values, places)
    ]
    return _run(list(values), steps, lambda axis, roles, xs: split(SplitSpec(links[axis], roles, tag), xs))


def assemble_local(values: Sequence[Any], places: Sequence[Placement], links: Dict[str, Link], what: str) -> List[Any]:
    """``local=True``: each output block as it is, through a ``Join(ONCE)`` on every axis its spec leaves out (no
    communication; backward gives each rank its cotangent over the axis size, so the replicated value counts once)."""
    steps = [
        [Step(a, ONCE) for a in p.replicated] if isinstance(v, torch.Tensor) else [] for v, p in zip(values, places)
    ]
    return _run(list(values), steps, lambda axis, roles, xs: join(JoinSpec(links[axis], roles, what, Kind.SYNC), xs))


def block_lengths(values: Sequence[Any], places: Sequence[Placement]) -> Optional[torch.Tensor]:
    """This rank's block length along every split dim of every output, as one row ``[1, k]`` on the host (None:
    nothing is split). Blocks need not be equal, so every rank's row travels in the exit's round over the whole
    mesh, as host-side metadata."""
    lengths = [v.shape[d] for v, p in zip(values, places) if isinstance(v, torch.Tensor) for d, _ in p.split]
    if not lengths:
        return None
    with outside_transforms():  # plain ints, whatever function transform is around the call
        return torch.tensor([lengths], dtype=torch.int64)


def assemble(
    values: Sequence[Any], places: Sequence[Placement], links: Dict[str, Link], view: Any, table: Any, what: str
) -> list:
    """Each block assembled into its global value, on every rank. ``table`` holds every rank's
    :func:`block_lengths` row, in the whole mesh's group-rank order."""
    keys = [(i, d) for i, (v, p) in enumerate(zip(values, places)) if isinstance(v, torch.Tensor) for d, _ in p.split]
    column = {key: k for k, key in enumerate(keys)}

    def length(i: int) -> Any:
        return lambda coords, d: table[view.whole_rank(coords)][column[(i, d)]]

    steps = [
        p.assemble_steps(view.sizes, view.coords, length(i)) if isinstance(v, torch.Tensor) else []
        for i, (v, p) in enumerate(zip(values, places))
    ]

    def apply(axis: str, roles: Sequence[Any], xs: List[Any]) -> List[Any]:
        spec = JoinSpec(links[axis], tuple(roles), what, Kind.SYNC)
        even = [r == FIRST and requires_grad(x) for r, x in zip(roles, xs)]
        if not any(even):
            return join(spec, xs)
        out = join(spec, [x.detach() if e else x for e, x in zip(even, xs)])
        return [_EvenCotangent.apply(x, o, links[axis]) if e else o for e, x, o in zip(even, xs, out)]

    return _run(list(values), steps, apply)


class _EvenCotangent(torch.autograd.Function):
    """A replicated output along one axis: forward, the value at coordinate 0 (joined already); backward, this
    rank's share of the cotangent (:class:`_Shares`), as jax transposes a ``P()`` output with ``check_vma=False``
    (coordinate 0 alone would get the whole cotangent of an output that in fact varies)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(mine: torch.Tensor, first: torch.Tensor, link: Link) -> torch.Tensor:
        return first.view_as(first)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.link = inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _Shares.apply(grad, ctx.link), None, None


class _Shares(torch.autograd.Function):
    """Each rank's share of a cotangent every rank holds whole: it over the axis size, with no communication. Its
    transpose (met in double backward, where the ranks' cotangents of the shares differ) is their mean over the
    axis: the linear map is one value over the axis size to every rank, so its transpose is the sum over the axis
    size (jax's second derivatives through a ``P()`` output agree)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad: torch.Tensor, link: Link) -> torch.Tensor:
        return grad / link.group.size

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.link = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        spec = JoinSpec(ctx.link, (COPY,), "the double backward of a replicated output", Kind.SYNC)
        return join(spec, [grad])[0] / ctx.link.group.size, None


def _run(values: List[Any], steps: List[List[Step]], apply: Any) -> List[Any]:
    """Every leaf's steps, in order per leaf: one primitive per axis for all leaves whose next step is on it, and
    whose blocks along it have the same lengths (an exchange carries one row count per rank: a batch's blocks
    and a weight's columns make two)."""
    pending = [list(s) for s in steps]
    while any(pending):
        axis = next(s[0].axis for s in pending if s)
        lengths = next((_lengths_of(s[0]) for s in pending if s and s[0].axis == axis and _lengths_of(s[0])), None)
        picked = [i for i, s in enumerate(pending) if s and s[0].axis == axis and _lengths_of(s[0]) in (None, lengths)]
        roles = tuple(pending[i][0].role for i in picked)
        out = apply(axis, roles, [values[i] for i in picked])
        for i, v in zip(picked, out):
            values[i] = v
            pending[i].pop(0)
    return values


def _lengths_of(step: Step) -> Any:
    """Every rank's block length along the step's axis; None for a value that is not split along it."""
    return step.role.sizes if is_rows(step.role) else None
