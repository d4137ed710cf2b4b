"""Where an exchange communicates: its :class:`Link` (the data's group and device, and the group its rounds take),
and that group's round buffers on this rank (:class:`Channel`). :mod:`.payload` routes what rides in them.

**The channel.** One group's side of the status protocol on this rank: its reusable round buffers, always in host
memory (rounds of device data take the group's host group), and what its rounds agreed.

Every round on a group has the same size on every rank, whatever each rank is doing. The size adapts, but only as a
function of the tables every rank has seen, in the same order, so every rank always agrees on it: it grows at once
to fit the largest block any rank needed (up to :data:`PAYLOAD_MAX`, 1 KiB), and shrinks by half after
:data:`_QUIET_ROUNDS` rounds in a row that needed a quarter of it or less. A round is an all-gather, so each rank
sends P - 1 headers and payloads: on larger groups the payload is capped lower (:func:`payload_bounds`) so that a
round stays within :data:`ROUND_BUDGET` bytes per rank up to P = 64. Repeated calls with outputs up to 1 KiB
per rank then make one collective, and a group that goes back to small outputs goes back to small rounds. Larger
data takes its own collective, at its native cost: every round would carry the payload area of every rank, so a
payload grown to the size of one large call would tax every later round on the group, however small.

The channel also keeps the shape of the last call exit's data phase (every rank derives it from the same table), so
that the next exit of that shape can send its data together with its status round (:mod:`.data_phase`), and whether
this rank left a backward unfinished (then it does not send data early: a peer may still wait in that backward).
"""

import os
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import numpy
import torch

from ..torch_internals import after_backward, outside_transforms
from .group import Group, host_of, host_plane_forced, state_of

# ---- the channel: one group's round buffers on this rank

HEADER_LEN = 6  # int64 (:func:`~colossalai_cmap.wire.rounds.pack_header`)
HEADER_BYTES = HEADER_LEN * 8  # keeps the payload 16-byte aligned
PAYLOAD_BASE = max(16, int(os.environ.get("COLOSSALAI_CMAP_ROUND_BYTES", "256")) // 16 * 16)
PAYLOAD_MAX = max(PAYLOAD_BASE, int(os.environ.get("COLOSSALAI_CMAP_ROUND_MAX", "1024")) // 16 * 16)
ROUND_BUDGET = 4096  # bytes one rank sends in a round, (P - 1) (header + payload), held up to P = 64
_QUIET_ROUNDS = 8


def payload_bounds(size: int) -> Tuple[int, int]:
    """A group of ``size`` ranks' first and largest payload per rank: :data:`PAYLOAD_BASE` and :data:`PAYLOAD_MAX`,
    capped so that a round sends at most :data:`ROUND_BUDGET` bytes per rank (16 bytes at least)."""
    fit = max(16, (ROUND_BUDGET // max(size - 1, 1) - HEADER_BYTES) // 16 * 16)
    return min(PAYLOAD_BASE, fit), min(PAYLOAD_MAX, fit)


class Channel:
    """The round buffers (this rank's header and payload, everyone's as received), the routes through them, and the
    agreed state: the payload size, the last data phase's shape, and whether a backward was left unfinished."""

    def __init__(self, group: Group, device: torch.device) -> None:
        if device.type != "cpu":  # link_for sends the rounds of device data over the host group
            raise ValueError(f"status rounds run in host memory, not on {device}")
        self.size, self.device = group.size, device
        self.base, self.max = payload_bounds(group.size)
        self.payload_bytes = self.base
        self.quiet = 0  # rounds in a row that needed a quarter of the payload or less
        self.last_data: Optional[Tuple[Any, ...]] = None  # (rows per rank, row shape, dtype) of the last exit's data
        self.backward_open = False  # this rank started a backward exchange that has not finished
        self._allocate()

    def _allocate(self) -> None:
        total = HEADER_BYTES + self.payload_bytes
        # written later under any mode, so never an inference tensor, and plain even when a round resizes them
        # inside a torch.func transform (a functorch-wrapped buffer has no storage to read the table from)
        with torch.inference_mode(False), outside_transforms():
            self.send = torch.zeros(total, dtype=torch.uint8, device=self.device)
            self.recv = torch.empty((self.size, total), dtype=torch.uint8, device=self.device)
            self.recv_flat = self.recv.view(-1)  # what a round's all-gather writes into, made once
            self.payload = self.send.narrow(0, HEADER_BYTES, self.payload_bytes)
            self.payloads = self.recv.narrow(1, HEADER_BYTES, self.payload_bytes)
            self.head = self.send.numpy()[:HEADER_BYTES].view(numpy.int64)
            self.table = self.recv.numpy()[:, :HEADER_BYTES].view(numpy.int64)
        self.routes: Dict[Any, Any] = {}  # views into these buffers (:class:`Route`)

    def write_header(self, header: Sequence[int]) -> None:
        self.head[:] = header

    def read_rows(self) -> list:
        return self.table.tolist()

    def open_backward(self) -> None:
        """Inside a backward: until it finishes, a peer may be left waiting in one of its exchanges if this rank's
        backward raises, so this rank must not send data ahead of its next round."""
        self.backward_open = True

        def closed() -> None:
            self.backward_open = False

        after_backward(closed)

    def agree(self, need: int) -> None:
        """After a round: the payload size of the next one, from the largest block any rank needed in this one."""
        size = self.payload_bytes
        if size < need <= self.max:
            size = min(self.max, max(self.base, 1 << (need - 1).bit_length()))
        elif need <= self.payload_bytes // 4 and self.payload_bytes > self.base:
            self.quiet += 1
            if self.quiet >= _QUIET_ROUNDS:
                size = max(self.base, self.payload_bytes // 2)
        else:
            self.quiet = 0
        if size != self.payload_bytes:
            self.payload_bytes, self.quiet = size, 0
            self._allocate()  # a returned round still holds views of the old buffers


def channel(group: Group, device: torch.device) -> Channel:
    """The group's channel on ``device``, kept in its :class:`~colossalai_cmap.wire.group.GroupState`."""
    channels = state_of(group.pg).channels
    found = channels.get(device)
    if found is None:
        found = channels[device] = Channel(group, device)
    return found


_HOST = torch.device("cpu")


class Link(NamedTuple):
    """Where an exchange communicates, and how its errors are named.

    ``group`` and ``device`` are the data's: where its collectives run. ``host`` is the host group its rounds take
    instead (with nothing of the data inline), or None when rounds run on ``group`` itself; see :func:`link_for`.
    """

    group: Group
    device: torch.device
    call: str
    timeout: Optional[float]
    host: Optional[Group] = None  # the group's host group (GroupState.host), where the rounds take one

    @property
    def wired(self) -> bool:
        """Whether the link reaches other ranks; an unwired link (a group of one, with no process group) is where a
        call runs alone: its exchanges move nothing and its rounds agree with themselves."""
        return self.group.pg is not None

    @property
    def round_group(self) -> Group:
        return self.group if self.host is None else self.host

    @property
    def round_device(self) -> torch.device:
        return self.device if self.host is None else _HOST

    def host_side(self) -> "Link":
        """The link for host-side metadata (CPU tensors): everything over the group the rounds take."""
        return self._replace(group=self.round_group, device=self.round_device)

    def channel(self) -> Channel:
        """The round buffers and agreed state of this link's rounds."""
        return channel(self.round_group, self.round_device)


def link_for(group: Group, device: torch.device, call: str, timeout: Optional[float]) -> Link:
    """Where a call on ``group`` with data on ``device`` communicates.

    - Data on an accelerator (or any data, with ``COLOSSALAI_CMAP_STATUS_PLANE=host``): data collectives on
      ``group``, rounds on its host gloo group, in host memory, so a round never reads device memory (no sync).
    - CPU data on a group whose backend cannot move CPU tensors (nccl): everything on the host group.
    - CPU data on gloo: everything on ``group``, and small data rides inline in the rounds.
    """
    if group.pg is None:
        return Link(group, device, call, timeout)
    cpu = device.type == "cpu"
    if cpu and "gloo" not in group.backend():
        return Link(host_of(group), device, call, timeout)
    if not cpu or host_plane_forced():
        return Link(group, device, call, timeout, host=host_of(group))
    return Link(group, device, call, timeout)
