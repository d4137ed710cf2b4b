"""What a data phase's collective sends, where it may go right behind its round: one record per collective.

A channel notes, per round name, the shape of the data phase that followed a round of that name
(:meth:`~.link.Channel.note_data`). The next exchange after a round of that name whose data has that shape issues
its collective right behind its round; a rank at that point that does not (it fails, or its data has another shape)
sends a stand-in of the noted shape (:meth:`stand_in`, contents unused), so that the collectives pair up in the same
order on every rank. Each record names its collective and issues its stand-in:

=====================  ============================================================  =============================
record                 the data phase                                                collective
=====================  ============================================================  =============================
:class:`GatherShape`   one rows tensor gathered to every rank or to one              ``all_gather`` / ``gather``
:class:`SumShape`      one flat buffer reduced (summed gradients, a ``psum``)        ``all_reduce``
:class:`ScatterShape`  this rank's rows of a sum (``psum_scatter``), padded          ``reduce_scatter``
:class:`SwapShape`     rows to and from each rank (``all_to_all``, ``ppermute``)     ``all_to_all``
=====================  ============================================================  =============================

A stand-in pairs with what its peers send because the note was made on every rank after the same round, which every
rank passed: the shapes of a gather, a sum and a reduce-scatter are alike on every rank; an all-to-all's row counts are
each rank's own, and every rank's noted ones are those of the one all-to-all they last ran together.

May import: torch, :mod:`.comm` and :mod:`.group`.
"""

from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import comm
from .group import Group


class GatherShape(NamedTuple):
    """One rows tensor gathered to every rank (``dst`` -1) or to group rank ``dst``: the rows per rank (padded to the
    largest share), a row's shape and dtype, and where it goes."""

    rows: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    group: Group
    device: torch.device
    dst: int = -1

    def collective(self) -> str:
        """The collective that carries it, as :mod:`.comm` names it."""
        return "all_gather" if self.dst == -1 else "gather"

    def what(self) -> str:
        """What a peer's error says this rank was last in, should it stop there."""
        where = "" if self.dst == -1 else f" to group rank {self.dst}"
        return f"{self.collective()}{where} (data sent with the exit round)"

    def issue(self, recv: Optional[torch.Tensor], send: torch.Tensor, call: str) -> comm.Pending:
        """Every rank's ``send`` into ``recv`` (None off ``dst``), stacked in group-rank order, left in flight."""
        return comm.issue_stacked(recv, send, self.dst, self.group, call, self.what())

    def stand_in(self, call: str) -> comm.Pending:
        """The gather a peer's early data pairs with (its contents unused), issued and left in flight."""
        send = torch.empty((self.rows, *self.shape), dtype=self.dtype, device=self.device)
        recv = None
        if self.dst in (-1, self.group.rank):
            recv = torch.empty((self.group.size, self.rows, *self.shape), dtype=self.dtype, device=self.device)
        return self.issue(recv, send, call)


class SumShape(NamedTuple):
    """One all-reduce of a flat buffer (a backward's summed gradients: a shared weight's, a module's parameters'; a
    ``psum`` inside f): its element count, dtype (as it travels) and reduction."""

    numel: int
    dtype: torch.dtype
    op: str  # "SUM", "MAX" or "MIN"
    group: Group
    device: torch.device

    def collective(self) -> str:
        return "all_reduce"

    def what(self) -> str:
        return "all_reduce (data sent with its round)"

    def issue(self, flat: torch.Tensor, call: str) -> comm.Pending:
        """The all-reduce of ``flat``, in place, left in flight."""
        return comm.issue_all_reduce(flat, self.group, call, self.what(), getattr(dist.ReduceOp, self.op))

    def stand_in(self, call: str) -> comm.Pending:
        return self.issue(torch.empty(self.numel, dtype=self.dtype, device=self.device), call)


class ScatterShape(NamedTuple):
    """One reduce-scatter (``psum_scatter``, or a transpose that is one): each rank's rows of the sum, every rank's
    share padded to ``rows``, a row's shape and dtype."""

    rows: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    group: Group
    device: torch.device

    def collective(self) -> str:
        return "reduce_scatter"

    def what(self) -> str:
        return "reduce_scatter (data sent with its round)"

    def issue(self, out: torch.Tensor, rows: torch.Tensor, call: str, what: Optional[str] = None) -> comm.Pending:
        """``out`` (``rows`` rows) gets this rank's rows of the sum of every rank's ``rows`` (P times as many);
        ``what`` names it for a peer's error (by default, as a stand-in)."""
        return comm.issue_reduce_scatter(out, rows, self.group, call, what or self.what())

    def stand_in(self, call: str) -> comm.Pending:
        out = torch.empty((self.rows, *self.shape), dtype=self.dtype, device=self.device)
        rows = torch.empty((self.group.size * self.rows, *self.shape), dtype=self.dtype, device=self.device)
        return self.issue(out, rows, call)


class SwapShape(NamedTuple):
    """One all-to-all (``all_to_all``, ``ppermute``): the rows this rank sends to each rank and receives from each, a
    row's shape and dtype."""

    sent: Tuple[int, ...]
    received: Tuple[int, ...]
    shape: Tuple[int, ...]
    dtype: torch.dtype
    group: Group
    device: torch.device

    def collective(self) -> str:
        return "all_to_all"

    def what(self) -> str:
        return "all_to_all (data sent with its round)"

    def issue(self, out: torch.Tensor, rows: torch.Tensor, call: str, what: Optional[str] = None) -> comm.Pending:
        """``out`` gets from each rank in order the rows of its ``rows`` it sends this one; ``what`` as
        :meth:`ScatterShape.issue`'s."""
        splits = (list(self.received), list(self.sent))
        return comm.issue_all_to_all(out, rows, splits, self.group, call, what or self.what())

    def stand_in(self, call: str) -> comm.Pending:
        out = torch.empty((sum(self.received), *self.shape), dtype=self.dtype, device=self.device)
        rows = torch.empty((sum(self.sent), *self.shape), dtype=self.dtype, device=self.device)
        return self.issue(out, rows, call)


DataShape = Union[GatherShape, SumShape, ScatterShape, SwapShape]


def matches(shape: Optional[DataShape], expected: Optional[DataShape]) -> bool:
    """Whether ``shape`` is the ``expected`` one: the same collective (records are tuples, which compare by their
    fields alone) with the same fields."""
    return shape is not None and type(shape) is type(expected) and shape == expected


__all__ = ["GatherShape", "SumShape", "ScatterShape", "SwapShape", "DataShape", "matches"]
