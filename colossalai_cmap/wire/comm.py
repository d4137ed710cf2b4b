"""Collectives with bounded waits, and the count of what cmap sent.

Every collective cmap issues goes through here, so a peer that died or never arrived turns into a ``CmapError``
within the timeout instead of a hang, :mod:`colossalai_cmap.stats` sees every collective and its bytes, and
:mod:`.presence` counts each one, so that the error names the ranks that did not arrive and what they last did.

A data phase's collective that may go right behind its round is described by its shape, one record per collective,
which issues it or a stand-in of it:

=====================  ============================================================  =============================
record                 the data phase                                                collective
=====================  ============================================================  =============================
:class:`GatherShape`   one rows tensor gathered to every rank or to one              ``all_gather`` / ``gather``
:class:`SumShape`      one flat buffer reduced (summed gradients, a ``psum``)        ``all_reduce``
:class:`ScatterShape`  this rank's rows of a sum (``psum_scatter``), padded          ``reduce_scatter``
:class:`SwapShape`     rows to and from each rank (``all_to_all``, ``ppermute``)     ``all_to_all``
=====================  ============================================================  =============================
"""

import atexit
import contextlib
import ctypes
import os
import pickle
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import stats
from ..digests import tensor_crc
from ..errors import CmapError
from ..torch_internals import outside_transforms
from . import presence
from .group import Group, kept_groups, state_of

TIMEOUT_ENV = "COLOSSALAI_CMAP_TIMEOUT"


def default_timeout() -> Optional[float]:
    value = os.environ.get(TIMEOUT_ENV)
    return float(value) if value else None


def check_usable(group: Group, call: str) -> None:
    """Refuse a group whose collectives fell out of step in an earlier call (a timeout or a dead peer)."""
    reason = state_of(group.pg).broken
    if reason is not None:
        raise CmapError(f"{call}: the process group is unusable: {reason} Create a new group (or restart).")


def is_broken(group: Group) -> bool:
    """Whether a wait failed on ``group`` (no further collective runs on it)."""
    return group.pg is not None and state_of(group.pg).broken is not None


class Pending(NamedTuple):
    """A collective in flight: its work, and its place in this process's count on the group (:mod:`.presence`)."""

    work: Any
    track: presence.Track
    doing: presence.Doing


def _track(group: Group) -> presence.Track:
    """The group's count of collectives (:mod:`.presence`), once the group is known to be in step.

    A wait that failed left the group's collective sequence out of step across ranks, so a further collective could
    pair with a stale one (gloo aborts the process then): every later one, in this call (reporting a failure inside
    func, say) or in any other, raises that wait's error again instead.
    """
    state = state_of(group.pg)
    if state.broken is not None:
        raise CmapError(
            f"{state.failure} No further cmap collective runs on this group: create a new group (or restart)."
        )
    if state.track is None:
        state.track = presence.track(str(getattr(group.pg, "group_name", group.ranks)), group.ranks)
    return state.track


# Every collective cmap issued and has not seen finish, with the tensors it reads and writes. One whose wait failed
# (a timeout, a dead peer) or that was issued ahead of a round that failed stays here: gloo's thread still holds its
# tensors, so Python must too, or the last reference to one would drop on that thread, which then needs the GIL,
# while a group's destructor holding the GIL joins that thread (a hang at exit).
_IN_FLIGHT: Dict[int, Tuple[Any, Tuple[torch.Tensor, ...]]] = {}


@atexit.register
def _keep_until_exit() -> None:
    """Where work was left in flight, neither it nor the groups are destroyed at interpreter exit: the process ends
    with gloo's threads, instead of a group's destructor waiting for them."""
    if _IN_FLIGHT:
        for kept in (_IN_FLIGHT, kept_groups()):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))


def abandoned() -> int:
    """How many collectives cmap issued on this process that have not finished (none while every group is in step)."""
    return len(_IN_FLIGHT)


def _wait(pending: Pending, group: Group, call: str, what: str, timeout: Optional[float]) -> None:
    try:
        if timeout is None:
            pending.work.wait()
        else:
            pending.work.wait(timeout=timedelta(seconds=timeout))
    except Exception as exc:  # a peer died, or the wait timed out
        # The group's collective sequence may now be out of step across ranks (see _track). A failure inside func or
        # cmap's own code never lands here: every rank learns of it in a round, in step.
        state = state_of(group.pg)
        state.broken = f"an earlier cmap {what} failed on it ({type(exc).__name__})."
        where = presence.absent(pending.track, pending.doing, group.rank, f"{type(exc).__name__}: {exc}"[:120])
        state.failure = (
            f"{call}: {what} failed on group rank {group.rank} (global rank {group.global_rank}): "
            f"{type(exc).__name__}: {exc}. A peer rank may have died or not reached this cmap call.{where}"
        )
        raise CmapError(state.failure) from exc
    _IN_FLIGHT.pop(id(pending.work), None)
    presence.note_returned(pending.track, pending.doing)


class _Landing:
    """A collective's work that writes into a twin of an inference tensor, copied over once it is done.

    gloo writes gathered data from its own thread, where inference mode is off, so it refuses to write into an
    inference tensor (any buffer allocated under ``torch.inference_mode``).
    """

    def __init__(self, work: Any, pairs: List[Any]) -> None:
        self.work, self.pairs = work, pairs

    def wait(self, **kwargs: Any) -> None:
        self.work.wait(**kwargs)
        for out, twin in self.pairs:
            out.copy_(twin)


def _twin(out: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.empty_like(out)


def _landing(outs: Sequence[torch.Tensor]) -> Tuple[Sequence[torch.Tensor], List[Any]]:
    """The buffers a collective writes into (a twin for each inference tensor), and the (out, twin) pairs."""
    if not any(out.is_inference() for out in outs):  # the common case: the buffers themselves
        return outs, []
    pairs = [(out, _twin(out)) for out in outs if out.is_inference()]
    twins = {id(out): twin for out, twin in pairs}
    return [twins.get(id(out), out) for out in outs], pairs


def _issue(
    name: str,
    nbytes: int,
    group: Group,
    call: str,
    outs: Sequence[torch.Tensor],
    issue: Callable,
    *,
    what: str,
    reads: Sequence[Optional[torch.Tensor]] = (),
) -> Pending:
    """One collective, counted (:mod:`colossalai_cmap.stats`, :mod:`.presence`) and left in flight: ``issue``
    gets the buffers to write into and starts it with ``async_op=True``; it reads ``reads`` and writes ``outs``,
    which stay referenced until it finished (``_IN_FLIGHT``)."""
    tr = _track(group)
    stats.note(name, nbytes)
    targets, pairs = _landing(outs)
    work = issue(*targets)
    work = _Landing(work, pairs) if pairs else work
    _IN_FLIGHT[id(work)] = (work, tuple(t for t in (*targets, *outs, *reads) if t is not None))
    return Pending(work, tr, presence.note_issued(tr, call, what))


def all_gather_into(
    out: torch.Tensor, inp: torch.Tensor, group: Group, call: str, timeout: Optional[float], what: str = "all_gather"
) -> None:
    _wait(issue_all_gather(out, inp, group, call, what), group, call, "all_gather", timeout)


def issue_all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group, call: str, what: str) -> Pending:
    """An all-gather left in flight, to wait for with :func:`wait_for` (data sent together with a round). ``what``
    says what it carries, for a peer's error should this rank not arrive at the next one."""

    def issue(target: torch.Tensor) -> Any:
        return dist.all_gather_into_tensor(target, inp, group=group.pg, async_op=True)

    return _issue("all_gather", _nbytes(inp), group, call, [out], issue, what=what, reads=[inp])


def wait_for(pending: Pending, group: Group, call: str, timeout: Optional[float], name: str = "all_gather") -> None:
    """Wait, with the bound, for a collective left in flight (:func:`issue_all_gather`, :func:`issue_gather`,
    :func:`issue_all_reduce`)."""
    _wait(pending, group, call, name, timeout)


def reduce_scatter_into(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: Group,
    call: str,
    timeout: Optional[float],
    what: str = "reduce_scatter",
) -> None:
    """``out`` gets this rank's equal share of the sum of every rank's ``inp`` (the tensor form: gloo has no list
    form)."""
    _wait(issue_reduce_scatter(out, inp, group, call, what), group, call, "reduce_scatter", timeout)


def issue_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group, call: str, what: str) -> Pending:
    """:func:`reduce_scatter_into` left in flight, to wait for with :func:`wait_for`."""

    def issue(target: torch.Tensor) -> Any:
        return dist.reduce_scatter_tensor(target, inp, group=group.pg, async_op=True)

    return _issue("reduce_scatter", _nbytes(inp), group, call, [out], issue, what=what, reads=[inp])


def all_to_all_into(
    out: torch.Tensor,
    inp: torch.Tensor,
    splits: Tuple[List[int], List[int]],
    group: Group,
    call: str,
    timeout: Any,
    *,
    what: str = "all_to_all",
) -> None:
    """``out`` gets, from each rank in order, the rows of its ``inp`` that rank sends this one: ``splits`` is (rows
    received from each rank, rows sent to each rank)."""
    _wait(issue_all_to_all(out, inp, splits, group, call, what), group, call, "all_to_all", timeout)


def issue_all_to_all(
    out: torch.Tensor, inp: torch.Tensor, splits: Tuple[List[int], List[int]], group: Group, call: str, what: str
) -> Pending:
    """:func:`all_to_all_into` left in flight, to wait for with :func:`wait_for`."""
    out_splits, in_splits = splits

    def issue(target: torch.Tensor) -> Any:
        return dist.all_to_all_single(target, inp, out_splits, in_splits, group=group.pg, async_op=True)

    return _issue("all_to_all", _nbytes(inp), group, call, [out], issue, what=what, reads=[inp])


def gather_to(
    inp: torch.Tensor, outs: Optional[List[torch.Tensor]], dst: int, group: Group, call: str, timeout: Optional[float]
) -> None:
    _wait(issue_gather(inp, outs, dst, group, call, "gather"), group, call, "gather", timeout)


def issue_stacked(
    recv: Optional[torch.Tensor], send: torch.Tensor, dst: int, group: Group, call: str, what: str
) -> Pending:
    """Every rank's ``send`` into ``recv`` in group-rank order along dim 0, on every rank (``dst`` -1: one
    all-gather, in the concatenated form, the only one gloo takes) or on group rank ``dst`` only (one gather; ``recv``
    is None elsewhere); left in flight."""
    if dst == -1:
        return issue_all_gather(recv.view(group.size * send.shape[0], *send.shape[1:]), send, group, call, what)
    outs = None if recv is None else list(recv.view(group.size, *send.shape).unbind(0))
    return issue_gather(send, outs, dst, group, call, what)


def issue_gather(
    inp: torch.Tensor, outs: Optional[List[torch.Tensor]], dst: int, group: Group, call: str, what: str
) -> Pending:
    """Every rank's ``inp`` into ``outs`` on group rank ``dst`` (None elsewhere), left in flight like
    :func:`issue_all_gather`."""

    def issue(*targets: torch.Tensor) -> Any:
        return dist.gather(inp, list(targets) if outs else None, dst=group.ranks[dst], group=group.pg, async_op=True)

    return _issue("gather", _nbytes(inp), group, call, outs or [], issue, what=what, reads=[inp])


def scatter_from(
    out: torch.Tensor, ins: Optional[List[torch.Tensor]], src: int, group: Group, call: str, timeout: Optional[float]
) -> None:
    def issue() -> Any:
        return dist.scatter(out, ins, src=group.ranks[src], group=group.pg, async_op=True)

    _wait(
        _issue("scatter", _nbytes(out), group, call, [], issue, what="scatter", reads=[out, *(ins or [])]),
        group,
        call,
        "scatter",
        timeout,
    )


def broadcast(t: torch.Tensor, src: int, group: Group, call: str, timeout: Optional[float]) -> None:
    def issue() -> Any:
        return dist.broadcast(t, group.ranks[src], group=group.pg, async_op=True)

    _wait(
        _issue("broadcast", _nbytes(t), group, call, [], issue, what="broadcast", reads=[t]),
        group,
        call,
        "broadcast",
        timeout,
    )


def all_reduce(t: torch.Tensor, group: Group, call: str, timeout: Optional[float], op: Any = None) -> None:
    """``t`` summed (or reduced by ``op``) over the group, in place."""
    wait_for(issue_all_reduce(t, group, call, "all_reduce", op), group, call, timeout, "all_reduce")


def issue_all_reduce(t: torch.Tensor, group: Group, call: str, what: str, op: Any = None) -> Pending:
    """:func:`all_reduce` left in flight, to wait for with :func:`wait_for` (data sent together with a round)."""

    def issue() -> Any:
        return dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group.pg, async_op=True)

    return _issue("all_reduce", _nbytes(t), group, call, [], issue, what=what, reads=[t])


def checksum(values: Sequence[Any], start: int = 0) -> int:
    """crc32 of the tensors among ``values`` (:func:`~colossalai_cmap.digests.tensor_crc`), its copies of device
    memory to the host counted (:func:`colossalai_cmap.stats.host_read`): the value checks read the data itself."""
    stats.host_read(sum(1 for v in values if isinstance(v, torch.Tensor) and v.device.type != "cpu"))
    return tensor_crc(values, start)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _decode(t: torch.Tensor) -> Any:
    return pickle.loads(_on_host(t).numpy().tobytes())


@contextlib.contextmanager
def _plain_tensors() -> Iterator[None]:
    """Where the object verbs make their byte tensors: plain ones, even inside a torch.func transform (a wrapped
    tensor has no storage to read back) or under ``inference_mode``."""
    with torch.inference_mode(False), outside_transforms(), torch.no_grad():
        yield


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory, counted (:func:`colossalai_cmap.stats.host_read`) when that copies device memory."""
    if t.device.type != "cpu":
        stats.host_read()
    return t.cpu()


def broadcast_object(obj: Any, src: int, group: Group, call: str, timeout: Optional[float], device: Any) -> Any:
    """Broadcast a picklable object from group rank ``src``: its length, then its bytes, both bounded waits."""
    with _plain_tensors():
        return _broadcast_object(obj, src, group, call, timeout, device)


def _broadcast_object(obj: Any, src: int, group: Group, call: str, timeout: Optional[float], device: Any) -> Any:
    data = _encode(obj, device) if group.rank == src else None
    length = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    broadcast(length, src, group, call, timeout)
    if data is None:
        data = torch.empty(int(_on_host(length).item()), dtype=torch.uint8, device=device)
    broadcast(data, src, group, call, timeout)
    return obj if group.rank == src else _decode(data)


def all_gather_object(obj: Any, group: Group, call: str, timeout: Optional[float], device: Any) -> List[Any]:
    """Every rank's picklable object, in group-rank order (rare paths: failure details, layouts)."""
    with _plain_tensors():
        return _all_gather_object(obj, group, call, timeout, device)


def _all_gather_object(obj: Any, group: Group, call: str, timeout: Optional[float], device: Any) -> List[Any]:
    data = _encode(obj, device)
    lengths = torch.empty(group.size, dtype=torch.int64, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    all_gather_into(lengths, length, group, call, timeout, "all_gather of objects")
    sizes = _on_host(lengths).tolist()
    cap = max(sizes)
    send = torch.zeros(cap, dtype=torch.uint8, device=device)
    send[: data.numel()] = data
    recv = torch.empty(group.size * cap, dtype=torch.uint8, device=device)
    all_gather_into(recv, send, group, call, timeout, "all_gather of objects")
    return [_decode(recv[r * cap : r * cap + n]) for r, n in enumerate(sizes)]


# ---- a data phase's collective, by its shape
# What a data phase's collective sends, where it may go right behind its round: one record per collective. A
# channel notes, per round name, the shape of the data phase that followed a round of that name
# (:meth:`~.link.Channel.note_data`). The next exchange after a round of that name whose data has that shape issues
# its collective right behind its round; a rank at that point that does not (it fails, or its data has another
# shape) sends a stand-in of the noted shape (``stand_in``, contents unused), so that the collectives pair up in the
# same order on every rank. The shapes of a gather, a sum and a reduce-scatter are alike on every rank; an
# all-to-all's row counts are each rank's own, and every rank's noted ones are those of the one all-to-all they last
# ran together, after a round every rank passed.


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

    def issue(self, recv: Optional[torch.Tensor], send: torch.Tensor, call: str) -> Pending:
        """Every rank's ``send`` into ``recv`` (None off ``dst``), stacked in group-rank order, left in flight."""
        return issue_stacked(recv, send, self.dst, self.group, call, self.what())

    def stand_in(self, call: str) -> Pending:
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

    def issue(self, flat: torch.Tensor, call: str) -> Pending:
        """The all-reduce of ``flat``, in place, left in flight."""
        return issue_all_reduce(flat, self.group, call, self.what(), getattr(dist.ReduceOp, self.op))

    def stand_in(self, call: str) -> Pending:
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

    def issue(self, out: torch.Tensor, rows: torch.Tensor, call: str, what: Optional[str] = None) -> Pending:
        """``out`` (``rows`` rows) gets this rank's rows of the sum of every rank's ``rows`` (P times as many);
        ``what`` names it for a peer's error (by default, as a stand-in)."""
        return issue_reduce_scatter(out, rows, self.group, call, what or self.what())

    def stand_in(self, call: str) -> Pending:
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

    def issue(self, out: torch.Tensor, rows: torch.Tensor, call: str, what: Optional[str] = None) -> Pending:
        """``out`` gets from each rank in order the rows of its ``rows`` it sends this one; ``what`` as
        :meth:`ScatterShape.issue`'s."""
        splits = (list(self.received), list(self.sent))
        return issue_all_to_all(out, rows, splits, self.group, call, what or self.what())

    def stand_in(self, call: str) -> Pending:
        out = torch.empty((sum(self.received), *self.shape), dtype=self.dtype, device=self.device)
        rows = torch.empty((sum(self.sent), *self.shape), dtype=self.dtype, device=self.device)
        return self.issue(out, rows, call)


DataShape = Union[GatherShape, SumShape, ScatterShape, SwapShape]


def matches(shape: Optional[DataShape], expected: Optional[DataShape]) -> bool:
    """Whether ``shape`` is the ``expected`` one: the same collective (records are tuples, which compare by their
    fields alone) with the same fields."""
    return shape is not None and type(shape) is type(expected) and shape == expected
