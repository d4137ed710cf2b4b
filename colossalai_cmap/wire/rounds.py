"""A round of the status protocol, whole: its header, its kinds, the rounds a call takes, how their failures are
raised on every rank, and the data phase behind a round for what did not fit its payload (:mod:`.link` has the
buffers and the payload's route).

**The round.** Every collective a peer might be waiting in is a round of one fixed size.

A round is one ``all_gather`` of a header (:class:`Header`, six int64 on the wire) and a payload area per rank (256
bytes to start with; the channel says how it adapts, always alike on every rank). Small data rides in the payload, so a
small call costs this one collective. Because every round on a group has the same size on every rank, whatever two
ranks are doing, their rounds pair up: a rank that failed,
finished early or left a backward meets its peers in a round, they read its header, and all of them raise or retry
together. gloo never sees unequal sizes, and the group stays in step.

Kinds of round: ``STATUS`` ends a call's forward pass; ``OP`` precedes a collective inside ``func``; ``SYNC``
carries a collective outside ``func`` (backward, and cmap's own data movement). A ``STATUS`` round that meets a peer
still in an ``OP`` or ``SYNC`` round repeats: that peer sees it, gives up its collective, and comes to its next
round.

**The data phase.** An exchange whose tensors did not fit the round's payload.

One all-gather carries every gathered tensor, padded to the largest share because gloo aborts on unequal sizes (a
single one travels in its own dtype, and the receive buffer's first rows are the result); one all-reduce per
reduction and dtype carries the sums. :func:`prepare` packs and allocates everything before the round, so that a
failure there travels in the round; :func:`run_data_phase` only runs the collectives and copies into those buffers.
"""

import contextlib
import threading
from enum import IntEnum
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import stats
from ..errors import CmapError, CollectiveAborted, RankFailure
from . import comm
from .group import Group
from .link import Channel, Item, Link, Route, cached_route, numel, offsets, rows_first, typed
from .roles import COPY, MAX, MIN, Role, Rows, first_row, is_rows

# ---- the round: its header, and the rounds a call takes


class Kind(IntEnum):
    STATUS = 1
    OP = 2
    SYNC = 3  # any other exchange: backward, tangents, write-back, tensor-parallel sums, state dicts


ROUND_NAMES = {Kind.STATUS: "exit round", Kind.OP: "op round", Kind.SYNC: "sync round"}


class Status(IntEnum):
    OK = 0
    EMPTY = 1  # an empty share: the rank ran a stand-in example
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
    values: int = 0  # check_inputs: a checksum of the out_dims=None outputs (0 on an empty share)
    early: int = 0  # 1: this rank sent its data together with this round (the data phase)


_M32 = 0xFFFFFFFF
_BLOCK_MAX = 1 << 40  # a block is compared with the payload's size (1 KiB at most): larger ones only need to read large


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def pack_header(h: Header) -> Tuple[int, ...]:
    """A header as the six int64 of its row: the flags and small fields share one, the 32-bit digests pair up."""
    small = h.kind | h.status << 4 | h.inline << 8 | h.early << 9 | min(h.block, _BLOCK_MAX) << 10
    sigs = _signed((h.input_sig & _M32) | (h.values & _M32) << 32)
    layout = _signed((h.digest & _M32) | (h.graph_sig & _M32) << 32)
    return (small, h.rows, h.batch, sigs, layout, h.flags)


def unpack_header(row: Sequence[int]) -> Header:
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
    """The route of an exchange on this group (:class:`Route`), kept with the group's round buffers; or, ``after`` a
    round (when only the round told the row counts), through that round's payloads, whatever buffers come next.

    Over a host group, only ``host`` tensors (host-side metadata, made on the CPU) ride in the round: data takes its
    own collective on the data's group, so the round never copies device memory."""
    ch, inline = link.channel(), host or link.host is None
    if after is not None:
        return cached_route(
            {}, link.group.rank, (after.payloads[link.group.rank], after.payloads), key, tensors, inline
        )
    if len(ch.routes) > _ROUTES_MAX:
        ch.routes.clear()
    return cached_route(ch.routes, link.group.rank, (ch.payload, ch.payloads), key, tensors, inline)


def exchange(link: Link, header: Header, also: Optional[Callable[[], Any]] = None, what: Optional[str] = None) -> Round:
    """One round: every rank's header and payload (packed beforehand, through a :class:`Route`). ``also`` issues a
    collective right behind the round (data sent early), left in flight in the returned round's ``early``. ``what``
    names the collective an ``OP`` or ``SYNC`` round precedes, for a peer's error should this rank stop here."""
    ch, group = link.channel(), link.round_group
    ch.write_header(pack_header(header))
    name = ROUND_NAMES[header.kind] if what is None else f"{ROUND_NAMES[header.kind]} ({what})"
    work = comm.issue_all_gather(ch.recv.view(-1), ch.send, group, link.call, name)
    early = also() if also is not None else None
    comm.wait_for(work, group, link.call, link.timeout)
    if link.host is None:  # the table sits in the data's own buffers
        stats.host_read()
    rnd = Round(tuple(unpack_header(row) for row in ch.read_rows()), ch.payloads, early)
    ch.agree(max(h.block for h in rnd.table))
    return rnd


def status_round(link: Link, header: Header, also: Optional[Callable[[], Any]] = None) -> Round:
    """The round at the end of a call's forward pass; repeats while a peer is still in an ``OP`` or ``SYNC`` round
    (it gives that up). Data is sent early (``also``) only where no peer can be in such a round, so a repeat never
    follows it."""
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


def agree_rows(link: Link, rows: int, what: str = "the call's start") -> Tuple[int, ...]:
    """Every rank's row count, in group-rank order: one ``OP`` round, for when only each rank knows its own."""
    if not link.wired:
        return (rows,)
    rnd = checked_round(link, Header(Kind.OP, rows=rows, input_sig=0, digest=1), what)
    return tuple(h.rows for h in rnd.table)


def gather_objects(link: Link, obj: Any) -> List[Any]:
    """Every rank's picklable ``obj``, over the group the rounds take (an error path's details, never data)."""
    return comm.all_gather_object(obj, link.round_group, link.call, link.timeout, link.round_device)


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


# ---- the data phase: what did not fit the round

_REDUCE_OPS = {COPY: "SUM", MAX: "MAX", MIN: "MIN"}
_EARLY = "all_gather (data sent with the exit round)"  # what a peer's error says this rank was last in


class Prepared(NamedTuple):
    """This rank's side of a data phase, made ready before the round."""

    items: Tuple[Item, ...]
    sizes: Tuple[int, ...]
    results: Dict[int, torch.Tensor]  # rows first for rows items; filled by run_data_phase()
    send: Optional[torch.Tensor]  # the gathered items' send buffer
    recv: Optional[torch.Tensor]  # their receive buffer; None off dst
    flats: Dict[Tuple[Role, torch.dtype], torch.Tensor]  # one buffer per reduction and dtype, reduced in place


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` without a lazy conjugate or negative bit: collectives send the raw memory."""
    return t.resolve_conj().resolve_neg() if t.is_complex() or t.is_neg() else t


def prepare(
    items: Sequence[Item], tensors: Sequence[torch.Tensor], sizes: Sequence[int], group: Group, dst: int
) -> Prepared:
    receives = dst == -1 or dst == group.rank
    device = tensors[items[0].index].device
    gathered = [it for it in items if not it.reduced]
    results: Dict[int, torch.Tensor] = {}
    send = recv = None
    if len(gathered) == 1 and is_rows(gathered[0].role):
        send, recv = _direct_buffers(gathered[0], tensors, sizes, group, receives)
        if recv is not None:
            results[gathered[0].index] = cut_rows(recv, sizes, max(sizes))
    elif gathered:
        cap = max(sizes)
        send = torch.zeros(offsets(gathered, cap)[1], dtype=torch.uint8, device=device)
        pack_padded(gathered, tensors, cap, send)
        recv = torch.empty((group.size, send.numel()), dtype=torch.uint8, device=device) if receives else None
        if receives:
            total = sum(sizes)
            results.update(
                {it.index: torch.empty(it.rows_shape(total), dtype=it.dtype, device=device) for it in gathered}
            )
    flats = {key: _flat(found, tensors) for key, found in _by_op(items).items()}
    return Prepared(tuple(items), tuple(sizes), results, send, recv, flats)


def pack_padded(items: Sequence[Item], tensors: Sequence[torch.Tensor], cap: int, out: torch.Tensor) -> None:
    offs, _ = offsets(items, cap)
    for it, off in zip(items, offs):
        t = tensors[it.index]
        if is_rows(it.role):
            rows = rows_first(t, it.role.dim)
            typed(out, off, it.dtype, (rows.shape[0], *it.shape)).copy_(rows)
        else:
            typed(out, off, it.dtype, it.shape).copy_(t)


def _direct_buffers(
    it: Item, tensors: Sequence[torch.Tensor], sizes: Sequence[int], group: Group, receives: bool
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One rows tensor, in its own dtype, padded to the largest share."""
    t = tensors[it.index]
    cap, n = max(sizes), sizes[group.rank]
    send = resolved(rows_first(t, it.role.dim))
    if n < cap:
        padded = torch.empty((cap, *it.shape), dtype=it.dtype, device=t.device)
        padded.narrow(0, 0, n).copy_(send)
        send = padded
    else:
        send = send.contiguous()
    recv = torch.empty((group.size * cap, *it.shape), dtype=it.dtype, device=t.device) if receives else None
    return send, recv


def cut_rows(recv: torch.Tensor, sizes: Sequence[int], cap: int) -> torch.Tensor:
    """The rows of ``[P * cap, ...]`` gathered blocks without their padding: a view of the first ``sum(sizes)``
    rows when they form a prefix (blocks of ``cap`` rows, the last nonempty one short), else a new tensor."""
    last = max((r for r, n in enumerate(sizes) if n), default=-1)
    if all(n == cap for n in sizes[:last]):
        return recv.narrow(0, 0, sum(sizes))
    return torch.empty((sum(sizes), *recv.shape[1:]), dtype=recv.dtype, device=recv.device)


def _by_op(items: Sequence[Item]) -> Dict[Tuple[Role, torch.dtype], List[Item]]:
    found: Dict[Tuple[Role, torch.dtype], List[Item]] = {}
    for it in items:
        if it.reduced:
            found.setdefault((it.role, it.dtype), []).append(it)
    return found


def _flat(items: Sequence[Item], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Same-dtype items in one buffer for one all-reduce (gloo reduces no bool; complex goes as real pairs)."""
    flat = torch.cat([resolved(tensors[it.index]).reshape(-1) for it in items])
    return flat.to(torch.uint8) if flat.dtype == torch.bool else torch.view_as_real(flat) if flat.is_complex() else flat


# ------------------------------------------------------------------------------------------------ data sent early
def early_shape(prep: Prepared) -> Optional[Tuple[Any, ...]]:
    """What a data phase sends, when it is one rows tensor in its own dtype: (rows per rank, row shape, dtype)."""
    gathered = [it for it in prep.items if not it.reduced]
    if prep.flats or len(gathered) != 1 or not is_rows(gathered[0].role):
        return None
    return (max(prep.sizes), gathered[0].shape, gathered[0].dtype)


def early(prep: Optional[Prepared], ch: Channel, link: Link) -> Optional[Callable[[], Any]]:
    """The data phase, to issue right behind the round, when its shape is the one the last exit on this group agreed
    (so every rank in step sends the same shape) and no backward of this rank is unfinished (no peer may wait in it).
    Ranks that do not send early learn from the round who did, and send a stand-in of that shape (:func:`meet_early`).
    """
    if prep is None or ch.backward_open or ch.last_data is None or early_shape(prep) != ch.last_data:
        return None
    return lambda: comm.issue_all_gather(prep.recv, prep.send, link.group, link.call, _EARLY)


def meet_early(rnd: Round, ch: Channel, link: Link) -> None:
    """After the round: wait for this rank's early data, or, if peers sent theirs and this rank did not, send a
    stand-in of the same shape, so that the collectives pair up (in the same order on every rank)."""
    if rnd.early is not None:
        comm.wait_for(rnd.early, link.group, link.call, link.timeout)
    elif any(h.early for h in rnd.table):
        rows, shape, dtype = ch.last_data
        send = torch.empty((rows, *shape), dtype=dtype, device=link.device)
        recv = torch.empty((link.group.size * rows, *shape), dtype=dtype, device=link.device)
        comm.all_gather_into(recv, send, link.group, link.call, link.timeout, _EARLY)


def taken_early(prep: Prepared) -> Dict[int, torch.Tensor]:
    """The results of a data phase every rank sent early: only the cut remains."""
    it = next(it for it in prep.items if not it.reduced)
    _fill_cut(prep.results[it.index], prep.recv, prep.sizes)
    return prep.results


def run_data_phase(
    prep: Prepared, group: Group, dst: int, call: str, timeout: Optional[float]
) -> Dict[int, torch.Tensor]:
    """Run the data phase's collectives and fill the results (rows first)."""
    gathered = [it for it in prep.items if not it.reduced]
    if prep.send is not None:
        _gather(prep.recv, prep.send, group, dst, call, timeout)
    if prep.recv is not None and len(gathered) == 1 and is_rows(gathered[0].role):
        _fill_cut(prep.results[gathered[0].index], prep.recv, prep.sizes)
    elif prep.recv is not None:
        _from_padded(prep, gathered)
    for (role, dtype), flat in prep.flats.items():
        comm.all_reduce(flat, group, call, timeout, op=getattr(dist.ReduceOp, _REDUCE_OPS[role]))
        _split_flat(prep, role, dtype, flat)
    return prep.results


def _gather(
    recv: Optional[torch.Tensor], send: torch.Tensor, group: Group, dst: int, call: str, timeout: Optional[float]
) -> None:
    """``recv`` holds every rank's ``send`` in group-rank order along dim 0 (None off ``dst``)."""
    if dst == -1:  # gloo takes the concatenated form only
        comm.all_gather_into(recv.view(group.size * send.shape[0], *send.shape[1:]), send, group, call, timeout)
        return
    outs = None if recv is None else list(recv.view(group.size, *send.shape).unbind(0))
    comm.gather_to(send, outs, dst, group, call, timeout)


def _fill_cut(result: torch.Tensor, recv: torch.Tensor, sizes: Sequence[int]) -> None:
    if result.data_ptr() == recv.data_ptr():
        return  # the prefix view: already in place
    cap, start = max(sizes), 0
    for r, n in enumerate(sizes):
        if n:
            result.narrow(0, start, n).copy_(recv.narrow(0, r * cap, n))
        start += n


def _from_padded(prep: Prepared, items: Sequence[Item]) -> None:
    cap = max(prep.sizes)
    offs, _ = offsets(items, cap)
    for it, off in zip(items, offs):
        out = prep.results[it.index]
        if is_rows(it.role):
            start = 0
            for r, n in enumerate(prep.sizes):
                if n:
                    out.narrow(0, start, n).copy_(typed(prep.recv[r], off, it.dtype, (n, *it.shape)))
                start += n
        else:  # FIRST: rank 0's value
            out.copy_(typed(prep.recv[0], off, it.dtype, it.shape))


def _split_flat(prep: Prepared, role: Role, dtype: torch.dtype, flat: torch.Tensor) -> None:
    values = flat.to(torch.bool) if dtype == torch.bool else torch.view_as_complex(flat) if dtype.is_complex else flat
    start = 0
    for it in prep.items:
        if it.role == role and it.dtype == dtype:
            n = it.nbytes // dtype.itemsize
            prep.results[it.index] = values.narrow(0, start, n).view(it.shape)
            start += n


class Scattered(NamedTuple):
    """What :func:`scatter_rows` gives this rank: its rows of each tensor, and on an empty share each tensor's first
    example in its block instead (the share's stand-in), else None."""

    rows: List[torch.Tensor]
    stand_in: Optional[List[torch.Tensor]]


def scatter_rows(
    link: Link,
    src: int,
    sizes: Sequence[int],
    kinds: Sequence[Tuple[Tuple[int, ...], torch.dtype, int]],
    full: Optional[Sequence[torch.Tensor]],
) -> Scattered:
    """Group rank ``src``'s tensors (``full``, there only) cut into every rank's rows and sent in one ``scatter``,
    all packed together per rank for the largest share. ``kinds`` gives each tensor's example shape, dtype and
    batch dim on every rank, and ``sizes`` each rank's row count."""
    group = link.group
    items = [
        Item(k, Rows(0, tuple(sizes)), dtype, shape, numel(shape) * dtype.itemsize)
        for k, (shape, dtype, _) in enumerate(kinds)
    ]
    cap = max(max(sizes), 1)
    offs, block = offsets(items, cap)
    recv = torch.empty(block, dtype=torch.uint8, device=link.device)
    blocks = None
    if full is not None:
        blocks = [torch.zeros(block, dtype=torch.uint8, device=link.device) for _ in range(group.size)]
        for r in range(group.size):
            pack_padded(items, [_rows_of(t, d, sizes, r) for t, (_, _, d) in zip(full, kinds)], cap, blocks[r])
    if block:
        comm.scatter_from(recv, blocks, src, group, link.call, link.timeout)
    mine = sizes[group.rank]
    rows = [
        typed(recv, off, it.dtype, (mine, *it.shape)).movedim(0, d) for it, off, (_, _, d) in zip(items, offs, kinds)
    ]
    stand_in = None
    if mine == 0 and sum(sizes) > 0:
        stand_in = [
            typed(recv, off, it.dtype, (1, *it.shape)).movedim(0, d).clone()
            for it, off, (_, _, d) in zip(items, offs, kinds)
        ]
    return Scattered(rows, stand_in)


def _rows_of(t: torch.Tensor, dim: int, sizes: Sequence[int], r: int) -> torch.Tensor:
    """Rank r's rows, batch dim first; the first example for an empty share (its stand-in)."""
    n, start = sizes[r], first_row(sizes, r)
    rows = t.narrow(dim, start, n) if n else t.narrow(dim, 0, min(1, t.shape[dim]))
    return rows.movedim(dim, 0)
