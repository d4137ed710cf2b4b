"""Collectives at their native algorithm's cost: a reduce-scatter, an all-gather and an all-to-all between ranks,
each an autograd Function whose backward is its transpose.

``Join`` and ``Split`` move *global* values (the same on every rank) to and from per-rank ones. The ops here move
per-rank values to per-rank values, as jax's ``psum_scatter``, ``all_gather`` and ``all_to_all`` do between devices:

==================  ==============================================  ============================  ==================
Function            this rank's result                              native collective             backward
==================  ==============================================  ============================  ==================
``ReduceScatter``   its rows (``sizes[rank]`` along ``dim``) of     ``reduce_scatter_tensor``     ``AllGather``
                    the sum over ranks
``AllGather``       every rank's rows along ``dim``, in order       ``all_gather_into_tensor``    ``ReduceScatter``
``AllToAll``        from each rank r, the rows r sent it, in order  ``all_to_all_single``         ``AllToAll``, the
                                                                                                  sizes swapped
``RoundFreeSum``    the sum over ranks (a value every rank holds)   ``all_reduce``, no round      ``RoundFreeCopy``
``RoundFreeCopy``   the value itself (entering per-rank work)       none                          ``RoundFreeSum``
``GatherFrom``      every rank's rows of a sequence, no round       ``all_gather_into_tensor``    ``ReduceScatterTo``
``Sequence``                                                                                      ``Sequence``
``ReduceScatterTo`` its rows of the sum over ranks, no round        ``reduce_scatter_tensor``     ``GatherFrom``
``Sequence``                                                                                      ``Sequence``
``ScatterTo``       its rows of a replicated sequence               none                          ``GatherFrom``
``Sequence``                                                                                      ``Sequence``
``all_reduce_max``  the elementwise max over ranks                  ``all_reduce`` (MAX), no      none (no
                                                                    round                         derivative)
==================  ==============================================  ============================  ==================

``RoundFreeSum`` and ``RoundFreeCopy`` are Megatron's *g* and *f*, for tensor-parallel layers: one all-reduce and
no status round, so a layer costs what Megatron's costs (a rank that fails between layers leaves its peers waiting
until the timeout, which then names it). ``Join`` and ``Split`` with role ``COPY`` are the same *g* and *f* through
a status round, for cmap's own exchanges; the names say the difference. Each of the others here is one status
round of a fixed, small size (:mod:`.rounds`: a peer that failed or left meets this rank there, and every rank
raises together), then the native collective on the data: only the rows the destination needs move.
Uneven row counts are padded to the largest for the first two (gloo needs equal sizes); the all-to-all takes them
as they are. Every rule is written with ``apply`` of these Functions, so double backward, ``torch.func`` transforms
and an outer ``torch.vmap`` compose (the vmap dim rides along as a data dim after ``dim``).
"""

from typing import Any, NamedTuple, Optional, Tuple

import torch

from .. import faults
from ..digests import digest
from ..torch_internals import backward_running
from . import comm, rounds
from .exchange import needs_function
from .link import Link
from .roles import first_row
from .rounds import Header, Kind, Status


class NativeSpec(NamedTuple):
    """One native collective: where it runs, the dim its rows are on, the row counts, and the round's name and kind.

    ``sizes`` is per rank: for ``ReduceScatter`` and ``AllGather`` each rank's rows of the whole; for ``AllToAll`` the
    rows this rank sends to each rank, with ``recv`` the rows it receives from each.
    """

    link: Link
    dim: int
    sizes: Tuple[int, ...]
    what: str
    kind: int = Kind.OP
    recv: Tuple[int, ...] = ()

    def shifted(self) -> "NativeSpec":
        return self._replace(dim=self.dim + 1)

    def swapped(self) -> "NativeSpec":
        return self._replace(sizes=self.recv, recv=self.sizes, kind=Kind.SYNC)


def _meet(spec: NativeSpec, x: torch.Tensor, op: str) -> None:
    """The status round before the data: every rank at the same collective, or every rank raises."""
    group, failure, cause = spec.link.group, None, None
    try:
        if faults.ACTIVE:
            faults.check("backward" if spec.kind == Kind.SYNC else "pack", group)
    except Exception as exc:
        failure, cause = group.failure(exc), exc
    if spec.kind == Kind.SYNC and backward_running():
        spec.link.channel().open_backward()
    # what every rank of the group shares (an all-to-all's row counts are this rank's own)
    sig = digest((op, spec.dim, x.dtype, tuple(x.shape[spec.dim + 1 :])))
    header = Header(kind=spec.kind, status=Status.FAILED if failure else Status.OK, digest=sig, inline=1)
    rnd = rounds.checked_round(spec.link, header, spec.what)
    if rnd.failed:
        link = spec.link._replace(call=f"{spec.link.call}: {spec.what}")
        rounds.raise_failures(rnd, failure, cause, link, in_func=spec.kind == Kind.OP)


def _first(x: torch.Tensor, dim: int) -> torch.Tensor:
    return (x if dim == 0 else x.movedim(dim, 0)).contiguous()


def _back(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if dim == 0 else x.movedim(0, dim)


def reduce_scatter(spec: NativeSpec, x: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the sum over ranks (the plain side of :class:`ReduceScatter`)."""
    _meet(spec, x, "reduce_scatter")
    return _scatter_sum(spec.link, spec.dim, spec.sizes, x, spec.what)


def _scatter_sum(link: Link, dim: int, sizes: Tuple[int, ...], x: torch.Tensor, what: str) -> torch.Tensor:
    rows, cap, rank = _first(x, dim), max(sizes), link.group.rank
    if any(n != cap for n in sizes):  # pad each rank's rows to the largest share
        padded = rows.new_zeros((cap * len(sizes), *rows.shape[1:]))
        start = 0
        for r, n in enumerate(sizes):
            padded.narrow(0, r * cap, n).copy_(rows.narrow(0, start, n))
            start += n
        rows = padded
    out = rows.new_empty((cap, *rows.shape[1:]))
    comm.reduce_scatter_into(out, rows, link.group, link.call, link.timeout, f"reduce_scatter ({what})")
    return _back(out.narrow(0, 0, sizes[rank]), dim)


def all_gather(spec: NativeSpec, x: torch.Tensor) -> torch.Tensor:
    """Every rank's rows along ``dim``, in rank order (the plain side of :class:`AllGather`)."""
    _meet(spec, x, "all_gather")
    return _gather(spec.link, spec.dim, spec.sizes, x, spec.what)


def _gather(link: Link, dim: int, sizes: Tuple[int, ...], x: torch.Tensor, what: str) -> torch.Tensor:
    rows, cap = _first(x, dim), max(sizes)
    if rows.shape[0] < cap:
        rows = torch.cat([rows, rows.new_zeros((cap - rows.shape[0], *rows.shape[1:]))])
    out = rows.new_empty((cap * len(sizes), *rows.shape[1:]))
    comm.all_gather_into(out, rows, link.group, link.call, link.timeout, f"all_gather ({what})")
    if any(n != cap for n in sizes):
        out = torch.cat([out.narrow(0, r * cap, n) for r, n in enumerate(sizes)])
    return _back(out, dim)


def all_to_all(spec: NativeSpec, x: torch.Tensor) -> torch.Tensor:
    """From each rank, the rows it sent this one, in rank order (the plain side of :class:`AllToAll`)."""
    _meet(spec, x, "all_to_all")
    link = spec.link
    rows = _first(x, spec.dim)
    out = rows.new_empty((sum(spec.recv), *rows.shape[1:]))
    splits = (list(spec.recv), list(spec.sizes))
    comm.all_to_all_into(out, rows, splits, link.group, link.call, link.timeout, what=f"all_to_all ({spec.what})")
    return _back(out, spec.dim)


def _vmapped(fn: Any, spec: NativeSpec, in_dims: Tuple[Optional[int], ...], x: torch.Tensor) -> Tuple[Any, int]:
    """A vmap rule: the vmap dim goes first and the rows' dim one after it."""
    d = in_dims[1]
    if d is None:
        return fn.apply(spec, x), None
    return fn.apply(spec.shifted(), x.movedim(d, 0)), 0


class ReduceScatter(torch.autograd.Function):
    """Per-rank values to this rank's rows of their sum; backward is :class:`AllGather`."""

    @staticmethod
    def forward(spec: NativeSpec, x: torch.Tensor) -> torch.Tensor:
        return reduce_scatter(spec, x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, torch.Tensor]:
        return None, AllGather.apply(ctx.spec._replace(kind=Kind.SYNC), grad)

    @staticmethod
    def jvp(ctx: Any, _: Any, tangent: torch.Tensor) -> torch.Tensor:
        return ReduceScatter.apply(ctx.spec._replace(kind=Kind.SYNC), tangent)

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], spec: NativeSpec, x: torch.Tensor) -> Tuple[Any, Any]:
        return _vmapped(ReduceScatter, spec, in_dims, x)


class AllGather(torch.autograd.Function):
    """Per-rank rows to every rank's rows, on every rank; backward is :class:`ReduceScatter`."""

    @staticmethod
    def forward(spec: NativeSpec, x: torch.Tensor) -> torch.Tensor:
        return all_gather(spec, x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, torch.Tensor]:
        return None, ReduceScatter.apply(ctx.spec._replace(kind=Kind.SYNC), grad)

    @staticmethod
    def jvp(ctx: Any, _: Any, tangent: torch.Tensor) -> torch.Tensor:
        return AllGather.apply(ctx.spec._replace(kind=Kind.SYNC), tangent)

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], spec: NativeSpec, x: torch.Tensor) -> Tuple[Any, Any]:
        return _vmapped(AllGather, spec, in_dims, x)


class AllToAll(torch.autograd.Function):
    """Rows sent to each rank, rows received from each; backward is itself with the sizes swapped."""

    @staticmethod
    def forward(spec: NativeSpec, x: torch.Tensor) -> torch.Tensor:
        return all_to_all(spec, x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, torch.Tensor]:
        return None, AllToAll.apply(ctx.spec.swapped(), grad)

    @staticmethod
    def jvp(ctx: Any, _: Any, tangent: torch.Tensor) -> torch.Tensor:
        return AllToAll.apply(ctx.spec._replace(kind=Kind.SYNC), tangent)

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], spec: NativeSpec, x: torch.Tensor) -> Tuple[Any, Any]:
        return _vmapped(AllToAll, spec, in_dims, x)


def all_reduce(link: Link, x: torch.Tensor) -> torch.Tensor:
    """The sum over the group of every rank's ``x``, with no status round: Megatron's *g* (the plain side of
    :class:`RoundFreeSum`). A rank that fails before it leaves its peers waiting until the timeout, as in Megatron."""
    if x.is_meta:
        return torch.empty_like(x)
    out = x.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    comm.all_reduce(torch.view_as_real(out) if out.is_complex() else out, link.group, link.call, link.timeout)
    return out


def all_reduce_max(link: Link, x: torch.Tensor) -> torch.Tensor:
    """The elementwise max over the group of every rank's ``x``, with no status round and no derivative (a
    numerical shift, such as a softmax's max, that the result does not depend on)."""
    out = x.detach().clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, link.group, link.call, link.timeout, op=torch.distributed.ReduceOp.MAX)
    return out


class SequenceSpec(NamedTuple):
    """Rows of a sequence split over a group, for the round-free sequence-parallel Functions: group rank ``r``
    holds ``sizes[r]`` rows along ``dim``; ``what`` names them in messages."""

    link: Link
    dim: int
    sizes: Tuple[int, ...]
    what: str


def gather_sequence(spec: SequenceSpec, x: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, in rank order, contiguous: an all-gather with no status round (the plain side of
    :class:`GatherFromSequence`)."""
    return _gather(spec.link, spec.dim, spec.sizes, x, spec.what).contiguous()


def scatter_sequence_sum(spec: SequenceSpec, x: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the sum over ranks: a reduce-scatter with no status round (the plain side of
    :class:`ReduceScatterToSequence`)."""
    return _scatter_sum(spec.link, spec.dim, spec.sizes, x, spec.what)


class GatherFromSequence(torch.autograd.Function):
    """Megatron's sequence-parallel entry: this rank's rows of a sequence to the whole sequence (an all-gather, no
    round); backward is :class:`ReduceScatterToSequence` (each rank's gradient of the whole sequence summed, its own
    rows kept)."""

    @staticmethod
    def forward(spec: SequenceSpec, x: torch.Tensor) -> torch.Tensor:
        return gather_sequence(spec, x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, torch.Tensor]:
        return None, ReduceScatterToSequence.apply(ctx.spec, grad)


class ReduceScatterToSequence(torch.autograd.Function):
    """Megatron's sequence-parallel exit: per-rank partial values of the whole sequence to this rank's rows of
    their sum (a reduce-scatter, no round); backward is :class:`GatherFromSequence`."""

    @staticmethod
    def forward(spec: SequenceSpec, x: torch.Tensor) -> torch.Tensor:
        return scatter_sequence_sum(spec, x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, torch.Tensor]:
        return None, GatherFromSequence.apply(ctx.spec, grad)


class ScatterToSequence(torch.autograd.Function):
    """A replicated sequence to this rank's rows (no communication); backward is :class:`GatherFromSequence`'s
    plain gather (each rank's rows of the gradient, so that every rank holds the whole gradient of the replicated
    value)."""

    @staticmethod
    def forward(spec: SequenceSpec, x: torch.Tensor) -> torch.Tensor:
        rank = spec.link.group.rank
        return x.narrow(spec.dim, first_row(spec.sizes, rank), spec.sizes[rank])

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, torch.Tensor]:
        return None, GatherFromSequence.apply(ctx.spec, grad)


class RoundFreeSum(torch.autograd.Function):
    """Megatron's *g*: per-rank partial values to their sum, on every rank, in one all-reduce; backward is
    :class:`RoundFreeCopy` (the identity), since the sum is a value every rank holds alike."""

    @staticmethod
    def forward(link: Link, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(link, x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.link = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, torch.Tensor]:
        return None, RoundFreeCopy.apply(ctx.link, grad)

    @staticmethod
    def jvp(ctx: Any, _: Any, tangent: torch.Tensor) -> torch.Tensor:
        return RoundFreeSum.apply(ctx.link, tangent)

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], link: Link, x: torch.Tensor) -> Tuple[Any, Any]:
        return RoundFreeSum.apply(link, x), in_dims[1]


class RoundFreeCopy(torch.autograd.Function):
    """Megatron's *f*: a value every rank holds alike, entering per-rank computations: the identity forward, and
    backward the sum of the ranks' gradients (:class:`RoundFreeSum`)."""

    @staticmethod
    def forward(link: Link, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.link = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, torch.Tensor]:
        return None, RoundFreeSum.apply(ctx.link, grad)

    @staticmethod
    def jvp(ctx: Any, _: Any, tangent: torch.Tensor) -> torch.Tensor:
        return RoundFreeCopy.apply(ctx.link, tangent)

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], link: Link, x: torch.Tensor) -> Tuple[Any, Any]:
        return RoundFreeCopy.apply(link, x), in_dims[1]


_PLAIN = {ReduceScatter: reduce_scatter, AllGather: all_gather, AllToAll: all_to_all}


def run(fn: Any, spec: NativeSpec, x: torch.Tensor) -> torch.Tensor:
    """``fn`` (one of the Functions) where a derivative or a function transform needs it, else its plain side."""
    if needs_function([x]):
        return fn.apply(spec, x)
    return _PLAIN[fn](spec, x)


def summed(link: Link, x: torch.Tensor) -> torch.Tensor:
    """:class:`RoundFreeSum` where a derivative or a function transform needs it, else the plain all-reduce."""
    return RoundFreeSum.apply(link, x) if needs_function([x]) else all_reduce(link, x)


__all__ = [
    "NativeSpec",
    "ReduceScatter",
    "AllGather",
    "AllToAll",
    "RoundFreeSum",
    "RoundFreeCopy",
    "run",
    "summed",
    "all_reduce",
    "all_reduce_max",
    "SequenceSpec",
    "GatherFromSequence",
    "ReduceScatterToSequence",
    "ScatterToSequence",
    "gather_sequence",
    "scatter_sequence_sum",
]
