"""The status protocol: every collective a peer might be waiting in is a round of one fixed size.

A round is one ``all_gather`` of a header (:class:`Header`, twelve int64) and a payload area of
:data:`PAYLOAD_BYTES` per rank. Small data rides in the payload, so a small call costs this one collective. Because
every round on a group has the same size, whatever two ranks are doing, their rounds pair up: a rank that failed,
finished early or left a backward meets its peers in a round, they read its header, and all of them raise or retry
together. gloo never sees unequal sizes, and the group stays in step.

Kinds of round: ``STATUS`` ends a call's forward shard; ``OP`` precedes a collective inside ``func``; ``GRAD``
carries a collective outside ``func`` (backward, and cmap's own data movement). A ``STATUS`` round that meets a peer
still in an ``OP`` or ``GRAD`` round repeats: that peer sees it, gives up its collective, and comes to its next
round.
"""

import os
from enum import IntEnum
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

import numpy
import torch

from . import comm
from . import route as routes
from .errors import CmapError, CollectiveAborted, RankFailure
from .groups import Group
from .route import Route

HEADER_LEN = 12
HEADER_BYTES = HEADER_LEN * 8  # keeps the payload 16-byte aligned
PAYLOAD_BYTES = max(16, int(os.environ.get("COLOSSALAI_CMAP_ROUND_BYTES", "256")) // 16 * 16)
ROUND_BYTES = HEADER_BYTES + PAYLOAD_BYTES


class Link(NamedTuple):
    """Where an exchange communicates, and how its errors are named."""

    group: Group
    device: torch.device
    call: str
    timeout: Optional[float]


class Kind(IntEnum):
    STATUS = 1
    OP = 2
    GRAD = 3


class Status(IntEnum):
    OK = 0
    EMPTY = 1  # an empty shard: the rank ran a stand-in example
    FAILED = 2


class Header(NamedTuple):
    """One rank's row of a round. ``digest`` identifies the collective (``OP``/``GRAD``) or the output layout."""

    kind: int
    status: int = Status.OK
    rows: int = 0
    input_sig: int = 0
    digest: int = 0
    batch: int = 0
    block: int = 0  # bytes of data this rank sends
    inline: int = 0  # 1: they ride in this round's payload
    graph_sig: int = 0  # the closure edges found in this rank's local graph
    flags: int = 0  # bit k: func changed the k-th mapped input in place
    values: int = 0  # check_inputs: a checksum of the out_dims=None outputs (0 on an empty shard)
    spare: int = 0


class Round(NamedTuple):
    """A finished round: every rank's header, and the payloads (valid until the next round on this group)."""

    table: Tuple[Header, ...]
    payloads: torch.Tensor  # [P, PAYLOAD_BYTES] uint8

    @property
    def failed(self) -> bool:
        return any(h.status == Status.FAILED for h in self.table)

    @property
    def inline(self) -> bool:
        return all(h.inline for h in self.table)


class _Buffers:
    """One group's reusable round buffers: this rank's header is written in place, the table read in place."""

    def __init__(self, group: Group, device: torch.device) -> None:
        with torch.inference_mode(False):  # written later under any mode, so never an inference tensor
            self.send = torch.zeros(ROUND_BYTES, dtype=torch.uint8, device=device)
            self.recv = torch.empty((group.size, ROUND_BYTES), dtype=torch.uint8, device=device)
        self.payload = self.send.narrow(0, HEADER_BYTES, PAYLOAD_BYTES)
        self.payloads = self.recv.narrow(1, HEADER_BYTES, PAYLOAD_BYTES)
        self.cpu = device.type == "cpu"
        self.routes: dict = {}  # the exchanges' routes through these buffers (:mod:`route`)
        if self.cpu:
            self.head = self.send.numpy()[:HEADER_BYTES].view(numpy.int64)
            self.table = self.recv.numpy()[:, :HEADER_BYTES].view(numpy.int64)

    def write_header(self, header: Header) -> None:
        if self.cpu:
            self.head[:] = header
        else:
            self.send[:HEADER_BYTES].copy_(torch.tensor(header, dtype=torch.int64).view(torch.uint8))

    def read_table(self) -> Tuple[Header, ...]:
        rows = self.table.tolist() if self.cpu else self.recv[:, :HEADER_BYTES].view(torch.int64).tolist()
        return tuple(Header._make(row) for row in rows)


_BUFFERS: Dict[Tuple[int, torch.device], Tuple[object, _Buffers]] = {}


def _buffers(group: Group, device: torch.device) -> _Buffers:
    key = (id(group.pg), device)
    found = _BUFFERS.get(key)
    if found is None or found[0] is not group.pg:
        found = _BUFFERS[key] = (group.pg, _Buffers(group, device))
    return found[1]


_ROUTES_MAX = 512


def route(link: Link, key: Tuple[Any, ...], tensors: Sequence[torch.Tensor]) -> Route:
    """The route of an exchange on this group (:mod:`route`), kept with the group's round buffers."""
    buf = _buffers(link.group, link.device)
    if len(buf.routes) > _ROUTES_MAX:
        buf.routes.clear()
    return routes.route(buf.routes, link.group.rank, (buf.payload, buf.payloads), key, tensors)


def exchange(link: Link, header: Header) -> Round:
    """One round: every rank's header and payload (packed beforehand, through a :class:`Route`)."""
    buf = _buffers(link.group, link.device)
    buf.write_header(header)
    comm.all_gather_into(buf.recv.view(-1), buf.send, link.group, link.call, link.timeout)
    return Round(buf.read_table(), buf.payloads)


def status_round(link: Link, header: Header) -> Round:
    """The end-of-shard round; repeats while a peer is still in an ``OP`` or ``GRAD`` round (it gives that up)."""
    while True:
        rnd = exchange(link, header)
        if all(h.kind == Kind.STATUS for h in rnd.table):
            return rnd


def checked_round(link: Link, header: Header, what: str) -> Round:
    """An ``OP`` or ``GRAD`` round: every rank must be at the same collective (same ``digest``)."""
    rnd = exchange(link, header)
    away = [r for r, h in enumerate(rnd.table) if h.kind != header.kind]
    if away and header.kind == Kind.OP:
        raise CollectiveAborted(_away_in_func(what, away))
    if away:
        raise CmapError(_away_in_backward(link.call, what, away))
    if len({h.digest for h in rnd.table}) != 1:
        if header.kind == Kind.OP:
            raise CollectiveAborted(_mismatch(what, rnd))
        raise CmapError(f"{link.call}: {_mismatch(what, rnd)}")
    return rnd


def raise_failures(rnd: Round, failure: Optional[RankFailure], cause: Optional[BaseException], link: Link) -> None:
    """If any rank reported a failure, every rank learns the details and raises the same ``CmapError``."""
    if not rnd.failed:
        return
    failures = [f for f in comm.all_gather_object(failure, link.group, link.call, link.timeout, link.device) if f]
    real = [f for f in failures if f.exc_type != CollectiveAborted.__qualname__]
    raise CmapError.from_failures(link.call, real or failures, link.group.rank) from cause


def _away_in_func(what: str, away: list) -> str:
    return (
        f"{what}: group rank(s) {away} had already left func (finished or failed) while this rank called it; "
        f"every rank must make the same collective calls."
    )


def _away_in_backward(call: str, what: str, away: list) -> str:
    return (
        f"{call} (backward): group rank(s) {away} did not take part in {what}: their backward raised before it, or "
        f"they skipped this call's backward. Every rank must backpropagate through the same cmap outputs."
    )


def _mismatch(what: str, rnd: Round) -> str:
    digests = ", ".join(f"group rank {r}: {h.digest:#x}" for r, h in enumerate(rnd.table))
    return (
        f"{what}: ranks called different collectives or shapes here ({digests}); every rank must make the same "
        f"collective calls with the same shapes."
    )
