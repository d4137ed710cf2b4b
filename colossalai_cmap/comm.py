"""Collectives with bounded waits, and the per-call status exchange.

Every collective cmap issues goes through here, so a peer that died or never arrived turns into a ``CmapError``
within the timeout instead of a hang.
"""

import os
import zlib
from datetime import timedelta
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from .errors import CmapError, RankFailure
from .groups import Group

TIMEOUT_ENV = "COLOSSALAI_CMAP_TIMEOUT"

# Header fields of a round, one int64 row per rank. Every round has the same size, so a rank that has finished
# its shard (a status round) and a rank still inside func (an op round, before a collective such as psum) pair up
# and both see that they are out of step, instead of gloo aborting on mismatched sizes.
KIND, STATUS, ROWS, INPUT_SIG, LAYOUT_SIG, BATCH, HEADER_LEN = 0, 1, 2, 3, 4, 5, 6
STATUS_ROUND, OP_ROUND = 1, 2
OK, EMPTY, FAILED = 0, 1, 2

COUNTS = {"collectives": 0}
# Groups on which a collective failed or timed out: their collective sequence is out of step across ranks, so
# any further collective could pair with a stale one (gloo aborts the process then). cmap refuses them instead.
_BROKEN: dict = {}


def default_timeout() -> Optional[float]:
    value = os.environ.get(TIMEOUT_ENV)
    return float(value) if value else None


def digest(obj: Any) -> int:
    """A digest of ``repr(obj)`` that is the same in every process (``hash`` of a str is salted per process)."""
    return zlib.crc32(repr(obj).encode()) or 1


def check_usable(group: Group, call: str) -> None:
    """Refuse a group whose collectives fell out of step in an earlier call (a timeout or a dead peer)."""
    reason = _BROKEN.get(id(group.pg))
    if reason is not None and reason[0] is group.pg:
        raise CmapError(f"{call}: the process group is unusable: {reason[1]} Create a new group (or restart).")


def _wait(work: Any, group: Group, call: str, what: str, timeout: Optional[float]) -> None:
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=timeout))
    except Exception as exc:  # a peer died, or the wait timed out
        message = (
            f"{call}: {what} failed on group rank {group.rank} (global rank {group.global_rank}): "
            f"{type(exc).__name__}: {exc}. A peer rank may have died or not reached this cmap call."
        )
        _BROKEN[id(group.pg)] = (group.pg, f"an earlier cmap {what} failed on it ({type(exc).__name__}).")
        raise CmapError(message) from exc


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Group, call: str, timeout: Optional[float]) -> None:
    COUNTS["collectives"] += 1
    _wait(dist.all_gather_into_tensor(out, inp, group=group.pg, async_op=True), group, call, "all_gather", timeout)


def gather_to(
    inp: torch.Tensor, outs: Optional[List[torch.Tensor]], dst: int, group: Group, call: str, timeout: Optional[float]
) -> None:
    COUNTS["collectives"] += 1
    work = dist.gather(inp, outs, dst=group.ranks[dst], group=group.pg, async_op=True)
    _wait(work, group, call, "gather", timeout)


def scatter_from(
    out: torch.Tensor, ins: Optional[List[torch.Tensor]], src: int, group: Group, call: str, timeout: Optional[float]
) -> None:
    COUNTS["collectives"] += 1
    work = dist.scatter(out, ins, src=group.ranks[src], group=group.pg, async_op=True)
    _wait(work, group, call, "scatter", timeout)


def broadcast(t: torch.Tensor, src: int, group: Group, call: str, timeout: Optional[float]) -> None:
    COUNTS["collectives"] += 1
    _wait(dist.broadcast(t, group.ranks[src], group=group.pg, async_op=True), group, call, "broadcast", timeout)


def all_reduce(t: torch.Tensor, group: Group, call: str, timeout: Optional[float], op: Any = None) -> None:
    COUNTS["collectives"] += 1
    op = dist.ReduceOp.SUM if op is None else op
    _wait(dist.all_reduce(t, op=op, group=group.pg, async_op=True), group, call, "all_reduce", timeout)


def broadcast_object(obj: Any, src: int, group: Group, call: str) -> Any:
    """Broadcast a picklable object from group rank ``src`` (rare paths only: it has no bounded wait)."""
    COUNTS["collectives"] += 1
    box = [obj]
    try:
        dist.broadcast_object_list(box, src=group.ranks[src], group=group.pg)
    except Exception as exc:
        raise CmapError(f"{call}: broadcast of metadata from group rank {src} failed: {exc}") from exc
    return box[0]


def all_gather_object(obj: Any, group: Group, call: str) -> List[Any]:
    COUNTS["collectives"] += 1
    out: List[Any] = [None] * group.size
    try:
        dist.all_gather_object(out, obj, group=group.pg)
    except Exception as exc:
        raise CmapError(f"{call}: exchange of error details failed: {exc}") from exc
    return out


def exchange_round(
    header: Sequence[int], group: Group, device: torch.device, call: str, timeout: Optional[float]
) -> List[List[int]]:
    """All-gather every rank's small int64 header; returns one row per group rank."""
    mine = torch.tensor(list(header), dtype=torch.int64, device=device)
    rows = torch.empty(group.size * HEADER_LEN, dtype=torch.int64, device=device)
    all_gather_into(rows, mine, group, call, timeout)
    return rows.view(group.size, HEADER_LEN).tolist()


def exchange_status(
    fields: Sequence[int], group: Group, device: torch.device, call: str, timeout: Optional[float]
) -> List[List[int]]:
    """The end-of-shard status round. Repeats while peers are still inside func: they see this rank's status
    in their op round, abort their collective, and come to the status round too."""
    header = [STATUS_ROUND, *fields]
    while True:
        table = exchange_round(header, group, device, call, timeout)
        if all(row[KIND] == STATUS_ROUND for row in table):
            return table


class CollectiveAborted(RuntimeError):
    """Raised inside func when peers are not at the same collective (they finished, failed, or called another)."""


def op_round(op: str, detail: Any, group: Group, device: torch.device, call: str, timeout: Optional[float]) -> None:
    """Before an in-func collective: check that every rank is at the same collective with the same shape."""
    code = digest((op, detail))
    table = exchange_round([OP_ROUND, code, 0, 0, 0, 0], group, device, call, timeout)
    finished = [r for r, row in enumerate(table) if row[KIND] != OP_ROUND]
    if finished:
        raise CollectiveAborted(
            f"{op}: group rank(s) {finished} had already left func (finished or failed) while this rank called "
            f"{op}; every rank must make the same collective calls."
        )
    if len({row[STATUS] for row in table}) != 1:
        raise CollectiveAborted(
            f"{op}: ranks called different collectives or shapes here; every rank must make the "
            f"same collective calls with the same shapes ({detail})."
        )


def raise_failures(
    rows: List[List[int]], failure: Optional[RankFailure], group: Group, call: str, cause: Optional[BaseException]
) -> None:
    """If any rank reported a failure, every rank learns the details and raises the same ``CmapError``."""
    if not any(row[STATUS] == FAILED for row in rows):
        return
    failures = [f for f in all_gather_object(failure, group, call) if f is not None]
    raise CmapError.from_failures(call, failures, group.rank) from cause
