"""The status protocol: every collective a peer might be waiting in is a round of one fixed size.

A round is one ``all_gather`` of a header (:class:`Header`, six int64 on the wire) and a payload area per rank (256
bytes to start with; :mod:`channel` says how it adapts, always alike on every rank). Small data rides in the payload, so a
small call costs this one collective. Because every round on a group has the same size on every rank, whatever two
ranks are doing, their rounds pair up: a rank that failed,
finished early or left a backward meets its peers in a round, they read its header, and all of them raise or retry
together. gloo never sees unequal sizes, and the group stays in step.

Kinds of round: ``STATUS`` ends a call's forward shard; ``OP`` precedes a collective inside ``func``; ``SYNC``
carries a collective outside ``func`` (backward, and cmap's own data movement). A ``STATUS`` round that meets a peer
still in an ``OP`` or ``SYNC`` round repeats: that peer sees it, gives up its collective, and comes to its next
round.
"""

import contextlib
import threading
from enum import IntEnum
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import stats
from ..errors import CmapError, CollectiveAborted, RankFailure
from . import comm
from . import route as routes
from .channel import Channel, channel
from .group import Group, host_of, host_plane_forced
from .route import Route

_HOST = torch.device("cpu")


class Link(NamedTuple):
    """Where an exchange communicates, and how its errors are named.

    ``group`` and ``device`` are the data's: where its collectives run. ``status`` is the host group its rounds take
    instead (with nothing of the data inline), or None when rounds run on ``group`` itself; see :func:`link_for`.
    """

    group: Group
    device: torch.device
    call: str
    timeout: Optional[float]
    status: Optional[Group] = None

    @property
    def round_group(self) -> Group:
        return self.group if self.status is None else self.status

    @property
    def round_device(self) -> torch.device:
        return self.device if self.status is None else _HOST

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


class Kind(IntEnum):
    STATUS = 1
    OP = 2
    SYNC = 3  # any other exchange: backward, tangents, write-back, tensor-parallel sums, state dicts


ROUND_NAMES = {Kind.STATUS: "exit round", Kind.OP: "op round", Kind.SYNC: "sync round"}


class Status(IntEnum):
    OK = 0
    EMPTY = 1  # an empty shard: the rank ran a stand-in example
    FAILED = 2


class Header(NamedTuple):
    """One rank's row of a round. ``digest`` identifies the collective (``OP``/``SYNC``) or the output layout.

    On the wire it is six int64 (:func:`pack`): the signatures and checksums are 32-bit digests, so a round's
    header is 48 bytes per rank."""

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
    early: int = 0  # 1: this rank sent its data together with this round (:mod:`transfer`)


_M32 = 0xFFFFFFFF
_BLOCK_MAX = 1 << 40  # a block is compared with the payload's size (1 KiB at most): larger ones only need to read large


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def pack(h: Header) -> Tuple[int, ...]:
    """A header as the six int64 of its row: the flags and small fields share one, the 32-bit digests pair up."""
    small = h.kind | h.status << 4 | h.inline << 8 | h.early << 9 | min(h.block, _BLOCK_MAX) << 10
    sigs = _signed((h.input_sig & _M32) | (h.values & _M32) << 32)
    layout = _signed((h.digest & _M32) | (h.graph_sig & _M32) << 32)
    return (small, h.rows, h.batch, sigs, layout, h.flags)


def unpack(row: Sequence[int]) -> Header:
    small, rows, batch, sigs, layout, flags = row
    return Header(
        small & 15,
        (small >> 4) & 15,
        rows,
        sigs & _M32,
        layout & _M32,
        batch,
        small >> 10,
        (small >> 8) & 1,
        (layout >> 32) & _M32,
        flags,
        (sigs >> 32) & _M32,
        (small >> 9) & 1,
    )


class Round(NamedTuple):
    """A finished round: every rank's header, and the payloads (valid until the next round on this group)."""

    table: Tuple[Header, ...]
    payloads: torch.Tensor  # [P, payload bytes] uint8
    early: Any = None  # the data collective sent right behind the round, still in flight

    @property
    def failed(self) -> bool:
        return any(h.status == Status.FAILED for h in self.table)

    @property
    def inline(self) -> bool:
        return all(h.inline for h in self.table)


_ROUTES_MAX = 512


def route(
    link: Link, key: Tuple[Any, ...], tensors: Sequence[torch.Tensor], after: Optional[Round] = None, host: bool = False
) -> Route:
    """The route of an exchange on this group (:mod:`route`), kept with the group's round buffers; or, ``after`` a
    round (when only the round told the row counts), through that round's payloads, whatever buffers come next.

    Over a host group, only ``host`` tensors (host-side metadata, made on the CPU) ride in the round: data takes its
    own collective on the data's group, so the round never copies device memory."""
    ch, inline = link.channel(), host or link.status is None
    if after is not None:
        return routes.route(
            {}, link.group.rank, (after.payloads[link.group.rank], after.payloads), key, tensors, inline
        )
    if len(ch.routes) > _ROUTES_MAX:
        ch.routes.clear()
    return routes.route(ch.routes, link.group.rank, (ch.payload, ch.payloads), key, tensors, inline)


def exchange(link: Link, header: Header, also: Optional[Callable[[], Any]] = None, what: Optional[str] = None) -> Round:
    """One round: every rank's header and payload (packed beforehand, through a :class:`Route`). ``also`` issues a
    collective right behind the round (data sent early), left in flight in the returned round's ``early``. ``what``
    names the collective an ``OP`` or ``SYNC`` round precedes, for a peer's error should this rank stop here."""
    ch, group = link.channel(), link.round_group
    ch.write_header(pack(header))
    name = ROUND_NAMES[header.kind] if what is None else f"{ROUND_NAMES[header.kind]} ({what})"
    work = comm.issue_all_gather(ch.recv.view(-1), ch.send, group, link.call, name)
    early = also() if also is not None else None
    comm.wait_for(work, group, link.call, link.timeout)
    if link.status is None:  # the table sits in the data's own buffers
        stats.host_read()
    rnd = Round(tuple(unpack(row) for row in ch.read_rows()), ch.payloads, early)
    ch.agree(max(h.block for h in rnd.table))
    return rnd


def status_round(link: Link, header: Header, also: Optional[Callable[[], Any]] = None) -> Round:
    """The end-of-shard round; repeats while a peer is still in an ``OP`` or ``SYNC`` round (it gives that up). Data
    is sent early (``also``) only where no peer can be in such a round, so a repeat never follows it."""
    while True:
        rnd = exchange(link, header, also)
        if all(h.kind == Kind.STATUS for h in rnd.table):
            return rnd
        also = None


def checked_round(link: Link, header: Header, what: str) -> Round:
    """An ``OP`` or ``SYNC`` round: every rank must be at the same collective (same ``digest``). A round where a
    rank posted a failure returns as it is, whatever the others were at: the caller raises it on every rank."""
    rnd = exchange(link, header, what=what)
    if rnd.failed:
        return rnd
    away = [r for r, h in enumerate(rnd.table) if h.kind != header.kind]
    if away and header.kind == Kind.OP:
        raise CollectiveAborted(_away_in_func(what, away))
    if away:
        raise told(CmapError(_away_in_backward(link.call, what, away)), link)
    if len({h.digest for h in rnd.table}) != 1:
        if header.kind == Kind.OP:
            raise CollectiveAborted(_mismatch(what, rnd))
        raise told(CmapError(f"{link.call}: {_mismatch(what, rnd)}"), link)
    return rnd


GUARD_DIGEST = 0x6A2D0001  # a guarded backward's failure (:mod:`.guard`): its round names the call's backward
_GUARDED = threading.local()  # depth of guarded backwards (:mod:`.guard`) running on this thread


@contextlib.contextmanager
def guarding() -> Iterator[None]:
    """Inside a guarded backward (:mod:`.guard`): a failure met in an ``OP`` round there is raised on every rank as
    a backward's is (no call's exit follows to report it)."""
    _GUARDED.depth = getattr(_GUARDED, "depth", 0) + 1
    try:
        yield
    finally:
        _GUARDED.depth -= 1


def told(err: CmapError, link: Link) -> CmapError:
    """``err``, raised on every rank of the link's round group alike (from one round's table), marked so."""
    err._cmap_told = link.round_group.pg
    return err


def was_told(exc: BaseException, link: Link) -> bool:
    """Whether ``exc`` was raised from a round of the link's round group (so every rank raises it) or the group
    can no longer run a round."""
    return getattr(exc, "_cmap_told", None) is link.round_group.pg or (
        isinstance(exc, CmapError) and comm.is_broken(link.round_group)
    )


class Disagreement(Exception):
    """Raised on every rank when the ranks' headers differ in a field they must agree on; the caller explains it."""

    def __init__(self, field: str, table: Tuple[Header, ...]) -> None:
        super().__init__(f"ranks differ in {field}: {[getattr(h, field) for h in table]}")
        self.field, self.table = field, table


def check_agreement(table: Tuple[Header, ...], agree: Sequence[str], agree_nonempty: Sequence[str]) -> None:
    """Raise :class:`Disagreement` for the first field of ``agree`` that differs across ranks, or of
    ``agree_nonempty`` across the ranks that ran real examples. Every rank holds the same table: same verdict."""
    for field in agree:
        if len({getattr(h, field) for h in table}) > 1:
            raise Disagreement(field, table)
    for field in agree_nonempty:
        if len({getattr(h, field) for h in table if h.status == Status.OK}) > 1:
            raise Disagreement(field, table)


def raise_failures(
    rnd: Round, failure: Optional[RankFailure], cause: Optional[BaseException], link: Link, in_func: bool = False
) -> None:
    """If any rank reported a failure, every rank learns the details and raises the same ``CmapError``. ``in_func``
    (a collective inside func, whose call's exit tells every rank): the failing rank raises its own error and the
    others ``CollectiveAborted``, so that the exit reports the failure once, as it is."""
    if not rnd.failed:
        return
    if in_func and not getattr(_GUARDED, "depth", 0):
        if cause is not None:
            raise cause
        failed = [r for r, h in enumerate(rnd.table) if h.status == Status.FAILED]
        raise CollectiveAborted(f"{link.call}: group rank(s) {failed} failed as they entered it.")
    found = comm.all_gather_object(failure, link.round_group, link.call, link.timeout, link.round_device)
    failures = [f for f in found if f]
    real = [f for f in failures if f.exc_type != CollectiveAborted.__qualname__]
    call = link.call
    if any(h.status == Status.FAILED and h.digest == GUARD_DIGEST for h in rnd.table):  # one name on every rank
        call = f"{call[: call.index('): ') + 1] if '): ' in call else call} (backward)"  # the call, not the round
    raise told(CmapError.from_failures(call, real or failures, link.group.rank), link) from cause


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
