"""Public, read-only introspection: what one call did (``cmap(f).stats``) and which collectives ran
(``colossalai_cmap.record_collectives()``).

Both are records built from what the call path reports; nothing here changes what a call does.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Tuple


@dataclass(eq=False)
class CollectiveLog:
    """The collectives cmap issued while a :func:`record_collectives` block was open, in order.

    Attributes:
        entries: ``(op, bytes sent by this rank)`` per collective, e.g. ``("all_gather", 336)``.
        host_reads: how many tensors on the data's side the host read (a round's table in the data's buffers, a
            checksum of the data): on an accelerator, each is a copy to the host and a wait for the device.
    """

    entries: List[Tuple[str, int]] = field(default_factory=list)
    host_reads: int = 0

    @property
    def count(self) -> int:
        return len(self.entries)

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.entries)

    def ops(self, name: str) -> int:
        """How many collectives of one kind (``"all_gather"``, ``"all_reduce"``, ...) ran."""
        return sum(1 for op, _ in self.entries if op == name)


@dataclass(frozen=True)
class CallStats:
    """What the last call of a cmapped function did on this rank.

    Attributes:
        group_size: P, the number of ranks the call ran on (1 when it ran in this process alone).
        local: the call ran alone, with no communication: a group of one, no ``torch.distributed``, a cmap
            nested in a cmap over the same group, or meta inputs.
        fast_path: the call reused the checked shares of an earlier call with the same argument shapes.
        batch: the global batch size B (-1 when only the table knew it, with ``src="local"``).
        sizes: rows per group rank (``(B,)`` when the call ran alone), or None when only the table knew them.
        collectives: the collectives of the forward call (in-func ones included), by this rank.
        bytes: the bytes this rank sent in them.
        ops: their names, in order.
        host_reads: the tensors on the data's side the host read in them (:attr:`CollectiveLog.host_reads`): 0 in
            the steady path when status rounds take a host group (on GPUs, or with
            ``COLOSSALAI_CMAP_STATUS_PLANE=host``).
    """

    group_size: int
    local: bool
    fast_path: bool
    batch: int
    sizes: Optional[Tuple[int, ...]]
    collectives: int
    bytes: int
    ops: Tuple[str, ...]
    host_reads: int = 0


_LOGS: List[CollectiveLog] = []


def open_log() -> CollectiveLog:
    """Start counting one call's collectives (the call path's own log; see :func:`record_collectives`)."""
    log = CollectiveLog()
    _LOGS.append(log)
    return log


def close_log(log: CollectiveLog) -> None:
    _LOGS.remove(log)


def describe(log: CollectiveLog, group_size: int, local: bool, fast_path: bool, shares: Any) -> CallStats:
    """A call's :class:`CallStats` (``shares`` is its :class:`~colossalai_cmap.call.records.Shares`, or None)."""
    batch, sizes = (shares.batch, shares.sizes) if shares is not None else (-1, None)
    ops = tuple(op for op, _ in log.entries)
    return CallStats(group_size, local, fast_path, batch, sizes, log.count, log.bytes, ops, log.host_reads)


def note(op: str, nbytes: int) -> None:
    """Called by :mod:`comm` for every collective."""
    for log in _LOGS:
        log.entries.append((op, nbytes))


def host_read(count: int = 1) -> None:
    """Called where the host reads tensors on the data's side (:attr:`CollectiveLog.host_reads`)."""
    for log in _LOGS:
        log.host_reads += count


@contextlib.contextmanager
def record_collectives() -> Iterator[CollectiveLog]:
    """Record every collective cmap issues in the block (forward, backward, and inside ``func``).

    Example:
        >>> with record_collectives() as log:
        ...     cmap(torch.sin)(x)
        >>> log.count  # one all_gather: the status round carried the 32-byte output too
        1
    """
    log = CollectiveLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)
