"""Collectives with bounded waits, and the per-call status exchange.

Every collective cmap issues goes through here, so a peer that died or never arrived turns into a ``CmapError``
within the timeout instead of a hang.
"""

import os
import pickle
import struct
import zlib
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy
import torch
import torch.distributed as dist

from .errors import CmapError, RankFailure
from .groups import Group

TIMEOUT_ENV = "COLOSSALAI_CMAP_TIMEOUT"

# Every round (the end-of-shard status round, and the op round before each collective inside func) is one
# all_gather of the same fixed size: an int64 header per rank plus ROUND_PAYLOAD bytes. A rank that has finished
# its shard and a rank still inside func therefore always pair up and see that they are out of step, and ranks that
# passed different inputs can never make gloo abort on unequal sizes. Small outputs travel in the payload, so such
# a call needs this one collective and nothing else.
KIND, STATUS, ROWS, INPUT_SIG, LAYOUT_SIG, BATCH, PAYLOAD, BLOCK, SPECULATED = 0, 1, 2, 3, 4, 5, 6, 7, 8
HEADER_LEN = 10  # 80 bytes: keeps the payload 16-byte aligned
STATUS_ROUND, OP_ROUND = 1, 2
OK, EMPTY, FAILED = 0, 1, 2
ROUND_PAYLOAD = int(os.environ.get("COLOSSALAI_CMAP_ROUND_BYTES", "256")) // 16 * 16
# A cmap whose outputs needed a bigger payload last time uses a bigger round next time (up to this), so repeated
# calls of up to ROUND_MAX bytes per rank make one collective. Every rank derives the size from the same gathered
# table, so all ranks always agree on it.
ROUND_MAX = int(os.environ.get("COLOSSALAI_CMAP_ROUND_MAX", str(1 << 20))) // 16 * 16


def next_round_size(table: List[List[int]]) -> int:
    need = max(row[BLOCK] for row in table)
    if need <= ROUND_PAYLOAD or need > ROUND_MAX:
        return ROUND_PAYLOAD
    return min(1 << (need - 1).bit_length(), ROUND_MAX)


_HEADER_BYTES = HEADER_LEN * 8
_HEADER_FORMAT = f"<{HEADER_LEN}q"

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


def all_gather_pair(
    data: Tuple[torch.Tensor, torch.Tensor],
    status: Tuple[torch.Tensor, torch.Tensor],
    group: Group,
    call: str,
    timeout: Optional[float],
) -> None:
    """A data all-gather and a status round in flight together, each ``(out, inp)``; waits for both."""
    COUNTS["collectives"] += 2
    first = dist.all_gather_into_tensor(data[0], data[1], group=group.pg, async_op=True)
    second = dist.all_gather_into_tensor(status[0], status[1], group=group.pg, async_op=True)
    _wait(second, group, call, "all_gather", timeout)
    _wait(first, group, call, "all_gather", timeout)


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


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _decode(t: torch.Tensor) -> Any:
    return pickle.loads(t.cpu().numpy().tobytes())


def broadcast_object(
    obj: Any, src: int, group: Group, call: str, timeout: Optional[float] = None, device: Any = None
) -> Any:
    """Broadcast a picklable object from group rank ``src``: its length, then its bytes, both bounded waits."""
    device = torch.device("cpu") if device is None else device
    data = _encode(obj, device) if group.rank == src else None
    length = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    broadcast(length, src, group, call, timeout)
    if data is None:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    broadcast(data, src, group, call, timeout)
    return obj if group.rank == src else _decode(data)


def all_gather_object(
    obj: Any, group: Group, call: str, timeout: Optional[float] = None, device: Any = None
) -> List[Any]:
    """Every rank's picklable object, in group-rank order (rare paths: failure details)."""
    device = torch.device("cpu") if device is None else device
    data = _encode(obj, device)
    lengths = torch.empty(group.size, dtype=torch.int64, device=device)
    all_gather_into(lengths, torch.tensor([data.numel()], dtype=torch.int64, device=device), group, call, timeout)
    sizes = lengths.tolist()
    cap = max(sizes)
    send = torch.zeros(cap, dtype=torch.uint8, device=device)
    send[: data.numel()] = data
    recv = torch.empty(group.size * cap, dtype=torch.uint8, device=device)
    all_gather_into(recv, send, group, call, timeout)
    return [_decode(recv[r * cap : r * cap + n]) for r, n in enumerate(sizes)]


def exchange_round(
    header: Sequence[int],
    group: Group,
    device: torch.device,
    call: str,
    timeout: Optional[float],
    payload: Optional[Callable[[torch.Tensor], None]] = None,
    payload_bytes: int = ROUND_PAYLOAD,
    also: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[List[List[int]], torch.Tensor]:
    """All-gather every rank's header and payload; returns one header row per group rank and the ``[P, bytes]``
    payloads. ``payload``, if given, writes this rank's payload into the view it is handed. ``also`` = (out, inp)
    is a data all-gather issued right behind the round, so that both are in flight together."""
    size = _HEADER_BYTES + payload_bytes
    if device.type == "cpu":
        mine = torch.empty(size, dtype=torch.uint8)
        head_view = mine.numpy()[:_HEADER_BYTES].view(numpy.int64)
        head_view[: len(header)] = header
        head_view[len(header) :] = 0
    else:
        head = struct.pack(_HEADER_FORMAT, *header, *([0] * (HEADER_LEN - len(header))))
        mine = torch.empty(size, dtype=torch.uint8, device=device)
        mine[:_HEADER_BYTES].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    if payload is not None:
        payload(mine.narrow(0, _HEADER_BYTES, payload_bytes))
    rounds = torch.empty((group.size, size), dtype=torch.uint8, device=device)
    if also is None:
        all_gather_into(rounds.view(-1), mine, group, call, timeout)
    else:
        all_gather_pair(also, (rounds.view(-1), mine), group, call, timeout)
    table = rounds.narrow(1, 0, _HEADER_BYTES).view(torch.int64).tolist()
    return table, rounds.narrow(1, _HEADER_BYTES, payload_bytes)


def exchange_status(
    fields: Sequence[int],
    group: Group,
    device: torch.device,
    call: str,
    timeout: Optional[float],
    payload: Optional[Callable[[torch.Tensor], None]] = None,
    payload_bytes: int = ROUND_PAYLOAD,
    also: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[List[List[int]], torch.Tensor]:
    """The end-of-shard status round. Repeats while peers are still inside func: they see this rank's status
    in their op round, abort their collective, and come to the status round too."""
    header = [STATUS_ROUND, *fields]
    while True:
        table, payloads = exchange_round(header, group, device, call, timeout, payload, payload_bytes, also)
        also = None
        if all(row[KIND] == STATUS_ROUND for row in table):
            return table, payloads


class CollectiveAborted(RuntimeError):
    """Raised inside func when peers are not at the same collective (they finished, failed, or called another)."""


def op_round(
    op: str,
    detail: Any,
    group: Group,
    device: torch.device,
    call: str,
    timeout: Optional[float],
    payload_bytes: int = ROUND_PAYLOAD,
) -> None:
    """Before an in-func collective: check that every rank is at the same collective with the same shape."""
    code = digest((op, detail))
    table, _ = exchange_round([OP_ROUND, code], group, device, call, timeout, None, payload_bytes)
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
    rows: List[List[int]],
    failure: Optional[RankFailure],
    group: Group,
    call: str,
    cause: Optional[BaseException],
    timeout: Optional[float] = None,
    device: Any = None,
) -> None:
    """If any rank reported a failure, every rank learns the details and raises the same ``CmapError``."""
    if not any(row[STATUS] == FAILED for row in rows):
        return
    failures = [f for f in all_gather_object(failure, group, call, timeout, device) if f is not None]
    raise CmapError.from_failures(call, failures, group.rank) from cause
