"""Collectives at their native algorithm's cost: a reduce-scatter, an all-gather and an all-to-all between ranks,
one autograd Function (:class:`Native`) whose spec names the collective, and whose backward is its transpose.

``Join`` and ``Split`` move *global* values (the same on every rank) to and from per-rank ones. The ops here move
per-rank values to per-rank values, as jax's ``psum_scatter``, ``all_gather`` and ``all_to_all`` do between devices.
Each collective is one :class:`Collective` record, its plain side and its transpose together:

==================  ==============================================  ============================  ==================
Collective          this rank's result                              native collective             transpose
==================  ==============================================  ============================  ==================
``ReduceScatter``   its rows (``sizes[rank]`` along ``dim``) of     ``reduce_scatter_tensor``     ``AllGather``
                    the sum over ranks
``AllGather``       every rank's rows along ``dim``, in order       ``all_gather_into_tensor``    ``ReduceScatter``
``AllToAll``        from each rank r, the rows r sent it, in order  ``all_to_all_single``         ``AllToAll``, the
                                                                                                  sizes swapped
``all_reduce_max``  the elementwise max over ranks                  ``all_reduce`` (MAX), no      none (no
                                                                    round                         derivative)
==================  ==============================================  ============================  ==================

With ``checked=True`` (cmap's own exchanges) each is one status round (:mod:`.rounds`: a peer that failed or left
meets this rank there, and every rank raises together), then the native collective on the data: only the rows the
destination needs move. Once the steps repeat (the collective has the shape that followed a round of the same name
the last time), the collective goes right behind its round, both in flight together (:mod:`.comm`'s shape records). Small data rides in the round instead, which is an all-gather, as a ``Join``'s
(:func:`~.exchange.join_values`): one collective. An all-gather's rows always may; a reduce-scatter's whole value (a
sum's ``Join``, this rank's rows cut) and an all-to-all's (every rank's rows, where every rank knows every rank's
row counts, ``sent``) while the round's bytes cost little more than the native collective's
(:func:`~.payload.costs_little`), on a group whose rounds carry data. With ``checked=False`` (Megatron's sequence
parallelism, in ``shard_model``) the collective runs alone, as Megatron's, and so does its transpose. Megatron's *f* and *g* are
``Split`` and ``Join`` of role ``COPY`` with ``checked=False`` (:mod:`.exchange`). Uneven row counts are padded to
the largest for the first two (gloo needs equal sizes: :func:`~.roles.gather_padded`,
:func:`~.roles.padded_shares`); the all-to-all takes them as they are. Every rule is written with ``apply`` of
:class:`Native`, so double backward, ``torch.func`` transforms and an outer ``torch.vmap`` compose (the vmap dim
rides along as a data dim after ``dim``).
"""

import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import faults
from ..digests import digest
from . import comm, rounds
from .exchange import JoinSpec, all_reduce, join_values, through
from .link import Link
from .payload import costs_little
from .roles import COPY, Rows, first_row, first_rows, padded_shares
from .rounds import Header, Kind, Status
from .traced import traced_join, traced_split


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
    checked: bool = True  # a status round first; False: the collective alone, as Megatron's sequence parallelism
    collective: str = ""  # which :class:`Collective` (:func:`run` sets it)
    sent: Tuple[Tuple[int, ...], ...] = ()  # an all-to-all's row counts from every rank to each, where every rank
    # knows them (from the op's arguments): then, small, every rank's rows can ride in its round

    def rule(self) -> "Collective":
        return _COLLECTIVES[self.collective]

    def transposed(self) -> "NativeSpec":
        """The spec of this collective's transpose, met in backward."""
        rule = self.rule()
        spec = self._replace(collective=rule.transpose, kind=Kind.SYNC)
        if not rule.swaps:
            return spec
        return spec._replace(sizes=self.recv, recv=self.sizes, sent=tuple(zip(*self.sent)))


class _Ready(NamedTuple):
    """A native collective made ready before its round (a failure there travels in the round): its buffers' shape as
    the channel notes it, the collective on them (left in flight), and the buffer it writes this rank's result to."""

    shape: comm.DataShape
    issue: Callable[[], comm.Pending]
    out: torch.Tensor


def _meet(spec: NativeSpec, x: torch.Tensor, op: str, prepare: Callable[[], _Ready]) -> _Ready:
    """The collective ``prepare`` makes ready, behind its status round: every rank at the same collective, or every
    rank raises. Where its shape is the one that followed a round of the last round's name the last time
    (:meth:`~.link.Channel.expected_data`), it is issued right behind the round, both in flight together; a peer that
    does not send it sends a stand-in (:mod:`.comm`'s shape records), and then every rank runs it after the round."""
    link = spec.link
    group, failure, cause, ready = link.group, None, None, None
    try:
        if faults.ACTIVE:
            faults.check("backward" if spec.kind == Kind.SYNC else "pack", group)
        ready = prepare()
    except Exception as exc:
        failure, cause = group.failure(exc), exc
    # what every rank of the group shares (an all-to-all's row counts are this rank's own)
    sig = digest((op, spec.dim, x.dtype, tuple(x.shape[spec.dim + 1 :])))
    ch = link.channel()
    before = ch.last
    early = ready.issue if ready is not None and comm.matches(ready.shape, ch.expected_data()) else None
    status = Status.FAILED if failure else Status.OK
    header = Header(kind=spec.kind, status=status, digest=sig, inline=1, early=int(early is not None))
    rnd = rounds.checked_round(link, header, spec.what, early)
    if rnd.failed:
        rounds.raise_failures(
            rnd, failure, cause, link._replace(call=f"{link.call}: {spec.what}"), spec.kind == Kind.OP
        )
    ch.note_data(before, ready.shape)  # every rank passed the round: in step
    if not all(h.early for h in rnd.table):  # sent early by every rank, it has arrived; else it goes now
        comm.wait_for(ready.issue(), group, link.call, link.timeout, ready.shape.collective())
    return ready


def _run(spec: NativeSpec, x: torch.Tensor, op: str, prepare: Callable[[], _Ready]) -> torch.Tensor:
    """The collective ``prepare`` makes ready, checked (:func:`_meet`) or alone; this rank's result buffer."""
    if spec.checked:
        return _meet(spec, x, op, prepare).out
    ready = prepare()
    comm.wait_for(ready.issue(), spec.link.group, spec.link.call, spec.link.timeout, ready.shape.collective())
    return ready.out


def _first(x: torch.Tensor, dim: int) -> torch.Tensor:
    return (x if dim == 0 else x.movedim(dim, 0)).contiguous()


def _back(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if dim == 0 else x.movedim(0, dim)


def _rides(spec: "NativeSpec", x: torch.Tensor, fused_rows: int, own_rows: int) -> bool:
    """Whether the data may ride in the status round, an all-gather of ``fused_rows`` rows from each rank, where its
    own collective sends ``own_rows`` (the most any rank sends): small data, where the round costs little more bytes
    (:func:`~.payload.costs_little`), on a group whose rounds carry data (not a host plane's). Alike on every rank,
    which knows every rank's row counts."""
    if not spec.checked or spec.link.host is not None:
        return False
    row = x.element_size() * math.prod(n for d, n in enumerate(x.shape) if d != spec.dim)  # alike on every rank
    return costs_little((spec.link.group.size - 1) * fused_rows * row, own_rows * row)


def _reduce_scatter(spec: "NativeSpec", tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """This rank's rows of the sum. Small, it is a ``Join`` of the sum (psum's), whose round carries it, then this
    rank's rows cut: one collective, the status with the data; else the status round and the reduce-scatter
    (:func:`_meet`)."""
    (x,) = tensors
    sizes, rank = spec.sizes, spec.link.group.rank
    if _rides(spec, x, sum(sizes), sum(sizes) - min(sizes)):
        (total,) = join_values(JoinSpec(spec.link, (COPY,), spec.what, kind=spec.kind), [x])
        return total.narrow(spec.dim, first_row(sizes, rank), sizes[rank])
    link = spec.link

    def prepare() -> _Ready:
        rows = padded_shares(_first(x, spec.dim), sizes)
        out = rows.new_empty((max(sizes), *rows.shape[1:]))
        shape = comm.ScatterShape(max(sizes), tuple(rows.shape[1:]), rows.dtype, link.group, link.device)
        return _Ready(shape, lambda: shape.issue(out, rows, link.call, f"reduce_scatter ({spec.what})"), out)

    return _back(_run(spec, x, "reduce_scatter", prepare).narrow(0, 0, sizes[rank]), spec.dim)


def _all_gather(spec: "NativeSpec", tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every rank's rows, contiguous (a sequence's whole length feeds views). Checked, the rows are a ``Join``'s: its
    round carries them where they fit the payload (one collective, the status with the data), else their gather
    follows it (right behind it in backward, where the shape repeats)."""
    rows = Rows(spec.dim, spec.sizes)
    return join_values(JoinSpec(spec.link, (rows,), spec.what, kind=spec.kind, checked=spec.checked), tensors)[0]


def _all_to_all(spec: "NativeSpec", tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """From each rank, the rows it sent this rank, in rank order. Small, where every rank knows what every rank sends
    (``sent``), every rank's rows are a ``Join``'s, whose round carries them, and this rank's are cut from each: one
    collective; else the status round and the all-to-all (:func:`_meet`)."""
    (x,) = tensors
    link = spec.link
    rows = _first(x, spec.dim)
    if spec.sent:
        totals = tuple(sum(s) for s in spec.sent)
        if _rides(spec, x, max(totals), max(t - s[r] for r, (t, s) in enumerate(zip(totals, spec.sent)))):
            (every,) = join_values(JoinSpec(link, (Rows(0, totals),), spec.what, kind=spec.kind), [rows])
            me, starts = link.group.rank, first_rows(totals)
            parts = [every.narrow(0, starts[r] + first_row(s, me), s[me]) for r, s in enumerate(spec.sent)]
            return _back(torch.cat(parts), spec.dim)

    def prepare() -> _Ready:
        out = rows.new_empty((sum(spec.recv), *rows.shape[1:]))
        shape = comm.SwapShape(spec.sizes, spec.recv, tuple(rows.shape[1:]), rows.dtype, link.group, link.device)
        return _Ready(shape, lambda: shape.issue(out, rows, link.call, f"all_to_all ({spec.what})"), out)

    return _back(_run(spec, x, "all_to_all", prepare), spec.dim)


def _all_gather_traced(x: torch.Tensor, sizes: Tuple[int, ...], pg: Any, rank: int) -> torch.Tensor:
    """Inside ``torch.compile``: ``Split(COPY)`` of ``Join(Rows)`` (dim 0), whose transpose is this one's: the
    cotangents' sum (an all-reduce), this rank's rows."""
    return traced_split(traced_join(x, Rows(0, sizes), pg, rank), COPY, pg, rank)


class Collective(NamedTuple):
    """One native collective's rules, registered together (as jax registers a primitive's): its plain side (the
    status round, unless the spec is round-free, then the data), its transpose (the collective backward runs, the
    spec's row counts swapped where the transpose sends what it received), and its form inside ``torch.compile``
    (None: it runs eagerly, out of the graph)."""

    name: str
    plain: Callable[["NativeSpec", Sequence[torch.Tensor]], torch.Tensor]
    transpose: str
    swaps: bool = False
    traced: Optional[Callable[..., torch.Tensor]] = None


ReduceScatter = Collective("reduce_scatter", _reduce_scatter, "all_gather")
AllGather = Collective("all_gather", _all_gather, "reduce_scatter", traced=_all_gather_traced)
AllToAll = Collective("all_to_all", _all_to_all, "all_to_all", swaps=True)
_COLLECTIVES = {c.name: c for c in (ReduceScatter, AllGather, AllToAll)}


class Native(torch.autograd.Function):
    """Every native collective (the spec's ``collective``); backward is its transpose, jvp itself."""

    @staticmethod
    def forward(spec: NativeSpec, x: torch.Tensor) -> torch.Tensor:
        return spec.rule().plain(spec, [x])

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, torch.Tensor]:
        return None, Native.apply(ctx.spec.transposed(), grad)

    @staticmethod
    def jvp(ctx: Any, _: Any, tangent: torch.Tensor) -> torch.Tensor:
        return Native.apply(ctx.spec._replace(kind=Kind.SYNC), tangent)

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], spec: NativeSpec, x: torch.Tensor) -> Tuple[Any, Any]:
        """The vmap dim goes first and the rows' dim one after it."""
        d = in_dims[1]
        if d is None:
            return Native.apply(spec, x), None
        return Native.apply(spec._replace(dim=spec.dim + 1), x.movedim(d, 0)), 0


def run(collective: Collective, spec: NativeSpec, x: torch.Tensor) -> torch.Tensor:
    """``collective`` of ``x`` through :class:`Native` or its plain side (:func:`~.exchange.through`)."""
    spec = spec._replace(collective=collective.name)
    return through(Native, spec.rule().plain, spec, [x])


def all_reduce_max(link: Link, x: torch.Tensor) -> torch.Tensor:
    """The elementwise max over the group of every rank's ``x``, with no status round and no derivative (a
    numerical shift, such as a softmax's max, that the result does not depend on)."""
    out = x.detach().clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, link.group, link.call, link.timeout, op=torch.distributed.ReduceOp.MAX)
    return out


__all__ = [
    "NativeSpec",
    "Collective",
    "ReduceScatter",
    "AllGather",
    "AllToAll",
    "Native",
    "run",
    "all_reduce",
    "all_reduce_max",
]
