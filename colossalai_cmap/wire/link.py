"""Where an exchange communicates: its :class:`Link` (the data's group and device, and the group its rounds take),
that group's round buffers on this rank (:class:`Channel`), and the :class:`Route` of what rides in a round's payload.

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
that the next exit of that shape can send its data together with its status round (:mod:`.rounds`), and whether
this rank left a backward unfinished (then it does not send data early: a peer may still wait in that backward).

**The route (the payload).** An exchange's route through its round: which tensors travel, and where each sits in
every rank's payload.

What moves depends on each tensor's role (:mod:`.roles`): rows are concatenated in group-rank order, sums and
extrema are reduced, a first-rank value is taken from group rank 0; the other roles stay where they are. Each rank
packs its own rows into its payload area; when every rank's fit, the round carries them and the call needs no
other collective.

A route depends only on the roles, the tensors' dtypes and shapes, and the group, so it is worked out once and kept
with the group's round buffers: a repeated exchange copies into ready-made views of the payload area and reads out
of ready-made views of the gathered payloads.
"""

import os
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy
import torch

from ..digests import digest
from ..torch_internals import after_backward, outside_transforms
from .group import Group, host_of, host_plane_forced, state_of
from .roles import COPY, FIRST, MAX, MIN, Role, is_rows

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
        return Link(group, device, call, timeout, host_of(group))
    return Link(group, device, call, timeout)


# ---- the route: where each tensor sits in every rank's payload

_ALIGN = 16
REDUCED = (COPY, MAX, MIN)


class Item(NamedTuple):
    """One tensor that travels: its position among the exchanged tensors, its role, and its per-row shape."""

    index: int
    role: Role
    dtype: torch.dtype
    shape: Tuple[int, ...]  # per row for rows, the whole tensor otherwise
    nbytes: int  # per row for rows, the whole tensor otherwise

    @property
    def reduced(self) -> bool:
        return self.role in REDUCED

    def rows_shape(self, rows: int) -> Tuple[int, ...]:
        return (rows, *self.shape) if is_rows(self.role) else self.shape


class Route(NamedTuple):
    """One exchange's items, this rank's block, and the payload views to pack into and read from."""

    items: Tuple[Item, ...]
    sizes: Optional[Tuple[int, ...]]  # rows per rank (None: only the round knows, with src="local")
    rows: int
    block: int  # bytes this rank packs
    fits: bool  # this rank's block fits its payload area
    inline: Optional[bool]  # every rank's does (None: only the round knows)
    digest: int  # names the exchange in OP and SYNC headers
    send: Tuple[torch.Tensor, ...]  # per item, its view in this rank's payload area (empty unless fits)
    recv: Tuple[Tuple[torch.Tensor, ...], ...]  # per item, every rank's view in the gathered payloads (if inline)


def rows_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t if dim == 0 else t.movedim(dim, 0)


def travelling(roles: Sequence[Role], tensors: Sequence[torch.Tensor]) -> Tuple[Item, ...]:
    items = []
    for i, (role, t) in enumerate(zip(roles, tensors)):
        if is_rows(role):
            shape = tuple(rows_first(t, role.dim).shape[1:])
        elif role in REDUCED or role == FIRST:
            shape = tuple(t.shape)
        else:
            continue
        items.append(Item(i, role, t.dtype, shape, numel(shape) * t.element_size()))
    return tuple(items)


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def offsets(items: Sequence[Item], rows: int) -> Tuple[List[int], int]:
    """Byte offset of each item in a block packed for ``rows`` rows, and the block's size."""
    found, acc = [], 0
    for it in items:
        found.append(acc)
        acc += -(-it.nbytes * (rows if is_rows(it.role) else 1) // _ALIGN) * _ALIGN
    return found, acc


def typed(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    nbytes = numel(shape) * dtype.itemsize
    if nbytes == 0:  # a zero-size slice may sit at an odd storage offset: view() refuses it
        return buf.new_empty(tuple(shape), dtype=dtype)
    return buf.narrow(0, offset, nbytes).view(dtype).view(tuple(shape))


def cached_route(
    cache: Dict[Any, Route],
    rank: int,
    views: Tuple[torch.Tensor, torch.Tensor],
    key: Tuple[Any, ...],
    tensors: Sequence[torch.Tensor],
    inline: bool = True,
) -> Route:
    """The route for ``key = (what, roles, sizes)`` and these tensors, from ``cache`` or worked out now.

    ``views`` are the group's payload area and gathered payloads ``[P, bytes]``, whose views the route keeps.
    Without ``inline`` nothing rides in the round (its buffers are not where the tensors live): the data phase moves
    everything.
    """
    full = key + (inline,) + tuple((t.dtype, t.shape) for t in tensors)
    found = cache.get(full)
    if found is None:
        with torch.inference_mode(False):  # views kept for later calls under any mode are never inference tensors
            found = cache[full] = _work_out(rank, views, key, tensors, inline)
    return found


def _work_out(
    rank: int,
    views: Tuple[torch.Tensor, torch.Tensor],
    key: Tuple[Any, ...],
    tensors: Sequence[torch.Tensor],
    inline_ok: bool,
) -> Route:
    what, roles, sizes = key
    payload, payloads = views
    room = payload.numel() if inline_ok else -1
    items = travelling(roles, tensors)
    rows = next((t.shape[r.dim] for r, t in zip(roles, tensors) if is_rows(r)), 0)
    mine, block = offsets(items, rows)
    fits = block <= room
    send = tuple(typed(payload, off, it.dtype, it.rows_shape(rows)) for it, off in zip(items, mine)) if fits else ()
    inline = None if sizes is None else all(offsets(items, n)[1] <= room for n in sizes)
    recv: Tuple[Tuple[torch.Tensor, ...], ...] = ()
    if inline:
        layouts = [offsets(items, n)[0] for n in sizes]
        recv = tuple(
            tuple(typed(payloads[r], layouts[r][k], it.dtype, it.rows_shape(n)) for r, n in enumerate(sizes))
            for k, it in enumerate(items)
        )
    sig = digest((what, [(it.role, it.dtype, it.shape) for it in items]))
    # block: what the round's payload would need for this rank's items (0 when none can ride in it)
    return Route(items, sizes, rows, block if inline_ok else 0, fits, inline, sig, send, recv)


def pack_payload(rt: Route, tensors: Sequence[torch.Tensor]) -> None:
    """This rank's items into its payload area."""
    for it, view in zip(rt.items, rt.send):
        t = tensors[it.index]
        if is_rows(it.role):
            if rt.rows:
                view.copy_(rows_first(t, it.role.dim))
        else:
            view.copy_(t)


def unpack_payload(rt: Route, receives: bool) -> Dict[int, torch.Tensor]:
    """The results (rows first) from the gathered payloads: rows in group-rank order, reductions in group-rank order.

    They are at most P payload areas in all, so they are allocated here, after the round.
    """
    results: Dict[int, torch.Tensor] = {}
    if not receives:
        return results
    for it, parts in zip(rt.items, rt.recv):
        if is_rows(it.role):
            filled = [p for p, n in zip(parts, rt.sizes) if n] or [parts[0]]
            results[it.index] = filled[0].clone() if len(filled) == 1 else torch.cat(filled)
        elif it.role == FIRST:
            results[it.index] = parts[0].clone()
        else:
            results[it.index] = out = torch.empty_like(parts[0])
            reduce_into(out, it.role, parts)
    return results


def reduce_into(out: torch.Tensor, role: Role, parts: Sequence[torch.Tensor]) -> None:
    """Sum (or max, min) in group-rank order, so that every rank computes the very same bits."""
    out.copy_(parts[0])
    for p in parts[1:]:
        if role == COPY:
            out.add_(p)
        elif out.dtype == torch.bool:
            torch.logical_or(out, p, out=out) if role == MAX else torch.logical_and(out, p, out=out)
        else:
            torch.maximum(out, p, out=out) if role == MAX else torch.minimum(out, p, out=out)
