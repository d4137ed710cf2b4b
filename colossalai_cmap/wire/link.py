"""Where an exchange communicates: its :class:`Link` (the data's group and device, and the group its rounds take),
and that group's round buffers on this rank (:class:`Channel`). :mod:`.payload` routes what rides in them.

**The channel.** One group's side of the status protocol on this rank: its round buffers, always in host memory
(rounds of device data take the group's host group), and what its rounds agreed.

Every round on a group has the same size on every rank, whatever each rank is doing: the size of the next round is
a function of the tables of the rounds before it, which every rank has seen in the same order. Two rules make it:

- **Learned transitions.** After each round the channel notes how many payload bytes the round needed (the largest
  block any rank asked for) under the name of the round before it, and sizes the next round by what followed a
  round of the current one's name the last times. A loop of calls, forward or forward and backward, repeats its
  sequence of rounds, so from its third pass every round is sized for the data it carries: an output gathered to
  every rank rides in the exit round, up to :data:`FUSE_BYTES` received in all, and the call costs that one
  collective. A round larger than the small payload is made only for a transition seen twice in a row, so a loop
  whose calls alternate unpredictably rarely pays for a large round it does not use.
  Exchanges whose data would cost more bytes in an all-gather than in their own collective (sums at P > 2, rows to
  one rank) ask for room only while the difference stays small (:func:`~.payload.may_grow`).
- **Otherwise, a small payload** (:data:`PAYLOAD_BASE` to :data:`PAYLOAD_MAX`): it grows at once to fit the largest
  small block any rank needed, and shrinks by half after :data:`_QUIET_ROUNDS` rounds in a row that needed a quarter
  of it or less. On larger groups it is capped lower (:func:`payload_bounds`) so that a round stays within
  :data:`ROUND_BUDGET` bytes per rank up to P = 64.

A round whose ranks were at different kinds of round (a peer still inside ``func`` or in a backward) changes
nothing: the round a rank repeats after it has the same size, and so does the one its peer makes next.

Data too large to ride in a round takes its own collective after it. An exchange whose data has the shape that the
exchange after the same round sent the last time (a shape record of :mod:`.comm`: the channel notes it per round
name, as it notes the payload each round needed) issues it right behind its round, so both are in flight together:
a training loop's forward and backward, and the collectives inside f, each send theirs early.
"""

import os
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import numpy
import torch

from ..torch_internals import outside_transforms
from .group import Group, host_of, host_plane_forced, state_of

# ---- the channel: one group's round buffers on this rank

HEADER_LEN = 6  # int64 (:func:`~colossalai_cmap.wire.rounds.pack_header`)
HEADER_BYTES = HEADER_LEN * 8  # keeps the payload 16-byte aligned
PAYLOAD_BASE = max(16, int(os.environ.get("COLOSSALAI_CMAP_ROUND_BYTES", "256")) // 16 * 16)
PAYLOAD_MAX = max(PAYLOAD_BASE, int(os.environ.get("COLOSSALAI_CMAP_ROUND_MAX", "1024")) // 16 * 16)
ROUND_BUDGET = 4096  # bytes one rank sends in a round, (P - 1) (header + payload), held up to P = 64
FUSE_BYTES = int(os.environ.get("COLOSSALAI_CMAP_FUSE_BYTES", str(4 << 20)))  # most a round receives, P payloads
_QUIET_ROUNDS = 8
_TRANSITIONS_MAX = 256


def payload_bounds(size: int) -> Tuple[int, int]:
    """A group of ``size`` ranks' first and largest small payload per rank: :data:`PAYLOAD_BASE` and
    :data:`PAYLOAD_MAX`, capped so that a round sends at most :data:`ROUND_BUDGET` bytes per rank (16 at least)."""
    fit = max(16, (ROUND_BUDGET // max(size - 1, 1) - HEADER_BYTES) // 16 * 16)
    return min(PAYLOAD_BASE, fit), min(PAYLOAD_MAX, fit)


class Buffers(NamedTuple):
    """A round's buffers for one payload size: views of the channel's backing store, and the routes through them."""

    send: torch.Tensor  # this rank's header and payload
    recv_flat: torch.Tensor  # everyone's, as the all-gather writes them
    payload: torch.Tensor  # this rank's payload area
    payloads: torch.Tensor  # everyone's payload areas, [P, size]
    head: Any  # this rank's header, as int64 (numpy)
    table: Any  # everyone's headers, [P, 6] int64 (numpy)
    routes: Dict[Any, Any]  # :class:`~.payload.Route` per exchange, views into these buffers


_SIZES_KEPT = 64


class Channel:
    """The round buffers (this rank's header and payload, everyone's as received, for the current round's size), the
    routes through them, and the agreed state: the next round's payload size and what it was learned from."""

    def __init__(self, group: Group, device: torch.device) -> None:
        if device.type != "cpu":  # link_for sends the rounds of device data over the host group
            raise ValueError(f"status rounds run in host memory, not on {device}")
        self.size, self.device = group.size, device
        self.base, self.max = payload_bounds(group.size)
        self.fuse_max = max(self.max, FUSE_BYTES // group.size // 16 * 16)  # per rank
        self.small = self.base  # the small payload (second rule)
        self.quiet = 0  # rounds in a row that needed a quarter of the small payload or less
        self.after: Dict[Tuple[int, ...], Tuple[int, int]] = {}  # a round's name -> (the bytes the round after it
        # needed, how many times in a row)
        self.last: Optional[Tuple[int, ...]] = None  # the name of the last round
        self.data_after: Dict[Any, Any] = {}  # a round's name -> the data phase (a shape record of .comm, None:
        # another, or none) the exchange after it sent the last time, where every rank passed that exchange's round
        self.stored = 0  # payload bytes the backing buffers hold
        self.written: Optional[Sequence[int]] = None  # the header in the send buffer (every size's view shares it)
        self.views: Dict[int, Buffers] = {}  # payload size -> its buffers and routes
        self._use(self.base)

    def _use(self, size: int) -> None:
        """Make the round buffers those of a ``size``-byte payload (views of one backing store per direction)."""
        found = self.views.get(size)
        if found is None:
            if size > self.stored:
                self._store(size)
            elif len(self.views) >= _SIZES_KEPT:
                self.views = {}
            found = self.views[size] = self._views(size)
        self.payload_bytes, self.buffers = size, found

    def _store(self, size: int) -> None:
        # written later under any mode, so never an inference tensor, and plain even when a round resizes them
        # inside a torch.func transform (a functorch-wrapped buffer has no storage to read the table from)
        with torch.inference_mode(False), outside_transforms():
            self._send = torch.zeros(HEADER_BYTES + size, dtype=torch.uint8, device=self.device)
            self._recv = torch.empty(self.size * (HEADER_BYTES + size), dtype=torch.uint8, device=self.device)
        self.stored, self.views, self.written = size, {}, None  # a returned round still holds views of the old buffers

    def _views(self, size: int) -> Buffers:
        total = HEADER_BYTES + size
        with torch.inference_mode(False), outside_transforms():
            send = self._send.narrow(0, 0, total)
            recv_flat = self._recv.narrow(0, 0, self.size * total)
            recv = recv_flat.view(self.size, total)
            head = send.numpy()[:HEADER_BYTES].view(numpy.int64)
            table = recv.numpy()[:, :HEADER_BYTES].view(numpy.int64)
            payload, payloads = send.narrow(0, HEADER_BYTES, size), recv.narrow(1, HEADER_BYTES, size)
        return Buffers(send, recv_flat, payload, payloads, head, table, {})

    def write_header(self, header: Sequence[int]) -> None:
        if header != self.written:  # a steady loop sends the same header call after call
            self.buffers.head[:] = header
            self.written = header

    def read_rows(self) -> list:
        return self.buffers.table.tolist()

    def agree(self, name: Optional[Tuple[int, ...]], need: int) -> None:
        """After a round, from its table alone: ``name`` is group rank 0's (kind, digest, input signature), None where
        the ranks were at different kinds of round; ``need`` the largest block any rank asked for. Sizes the next
        round (the module docstring has the rules)."""
        if name is None:
            return  # ranks at different kinds of round: the next round (a repeat) keeps this size
        if need <= self.max:
            self._small(need)
        if self.last is not None:
            if len(self.after) >= _TRANSITIONS_MAX:
                self.after.clear()
            before = self.after.get(self.last)
            self.after[self.last] = (need, before[1] + 1 if before is not None and before[0] == need else 1)
        self.last = name
        size = self._fit(*self.after.get(name, (0, 0)))
        if size != self.payload_bytes:
            self._use(size)

    def expected_data(self) -> Optional[Any]:
        """The data phase the exchange after the last round sent the last time: what an exchange now sends right
        behind its round where its own has that shape, and what a rank elsewhere sends a stand-in of. Alike on every
        rank at the same point of the group's rounds (the rounds' names are)."""
        return self.data_after.get(self.last)

    def note_data(self, before: Any, shape: Optional[Any]) -> None:
        """After an exchange's round every rank passed (in step): the data phase it sent after the round ``before``."""
        if len(self.data_after) >= _TRANSITIONS_MAX and before not in self.data_after:
            self.data_after.clear()
        self.data_after[before] = shape

    def _fit(self, need: int, times: int) -> int:
        if need <= self.small:
            return self.small
        if need <= self.max:
            return min(self.max, 1 << (need - 1).bit_length())
        if need <= self.fuse_max and times >= 2:  # a large round only for a transition seen twice in a row
            return -(-need // 16) * 16
        return self.small

    def _small(self, need: int) -> None:
        if self.small < need:
            self.small, self.quiet = min(self.max, max(self.base, 1 << (need - 1).bit_length())), 0
        elif need <= self.small // 4 and self.small > self.base:
            self.quiet += 1
            if self.quiet >= _QUIET_ROUNDS:
                self.small, self.quiet = max(self.base, self.small // 2), 0
        else:
            self.quiet = 0


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
