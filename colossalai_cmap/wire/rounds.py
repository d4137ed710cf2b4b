"""A round of the status protocol: its header, its kinds, the rounds a call takes, and how their failures are
raised on every rank (:mod:`.data_phase` moves what did not fit a round's payload; :mod:`.payload` packs what fits).

Every collective a peer might be waiting in is a round of one fixed size.

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

A map call on a mesh says so (:func:`within_mesh`): inside its ``f``, the first round on part of the mesh is announced
in a round over the whole mesh, so that the call's exit knows, alike on every rank, whether it needs a round on each
axis's group to reach a rank waiting there.
"""

import contextlib
import functools
import threading
from enum import IntEnum
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import stats
from ..errors import CmapError, CollectiveAborted, RankFailure
from . import comm
from .group import state_of
from .link import Link

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

    On the wire it is six int64 (:func:`pack_header`): the signatures and checksums are 32-bit digests, so a round's
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
    flags: int = 0  # cmap: bit k, func changed the k-th mapped input in place; shard_map: shard/conclude.py's
    values: int = 0  # check_inputs: a checksum of the out_dims=None outputs (0 on an empty share)
    early: int = 0  # 1: this rank sent its data right behind this round (the data phase, of the agreed shape)


_M32 = 0xFFFFFFFF
_BLOCK_MAX = 1 << 40  # a block is compared with the payload's size (1 KiB at most): larger ones only need to read large


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


@functools.lru_cache(maxsize=256)  # a steady loop sends the same few headers
def pack_header(h: Header) -> Tuple[int, ...]:
    """A header as the six int64 of its row: the flags and small fields share one, the 32-bit digests pair up."""
    small = h.kind | h.status << 4 | h.inline << 8 | h.early << 9 | min(h.block, _BLOCK_MAX) << 10
    sigs = _signed((h.input_sig & _M32) | (h.values & _M32) << 32)
    layout = _signed((h.digest & _M32) | (h.graph_sig & _M32) << 32)
    return (small, h.rows, h.batch, sigs, layout, h.flags)


def unpack_header(row: Sequence[int]) -> Header:
    small, rows, batch, sigs, layout, flags = row
    return Header(
        kind=small & 15,
        status=(small >> 4) & 15,
        rows=rows,
        input_sig=sigs & _M32,
        digest=layout & _M32,
        batch=batch,
        block=small >> 10,
        inline=(small >> 8) & 1,
        graph_sig=(layout >> 32) & _M32,
        flags=flags,
        values=(sigs >> 32) & _M32,
        early=(small >> 9) & 1,
    )


class Round(NamedTuple):
    """A finished round: every rank's header and what the callers read of them, worked out once per distinct table
    (:func:`_read`), and the payloads (valid until the next round on this group)."""

    table: Tuple[Header, ...]
    failed: bool  # a rank posted a failure
    inline: bool  # every rank's data rode in its payload
    early: bool  # a rank sent its data right behind the round
    kind: int  # the kind of round every rank was at (0: they differed)
    name: Optional[Tuple[int, int, int]]  # rank 0's (kind, digest, input signature), the channel's record (None: the
    # ranks were at different kinds of round)
    need: int  # the largest block any rank asked for
    payloads: Optional[torch.Tensor] = None  # [P, payload bytes] uint8


# raw rows -> their reading (a Round without payloads): a steady loop repeats its tables
_READ: Dict[Tuple[Tuple[int, ...], ...], Round] = {}
_READ_MAX = 1024


def _read(rows: List[List[int]], payloads: torch.Tensor) -> Round:
    key = tuple(map(tuple, rows))
    found = _READ.get(key)
    if found is None:
        table = tuple(unpack_header(row) for row in rows)
        kind = table[0].kind if all(h.kind == table[0].kind for h in table) else 0
        found = Round(
            table=table,
            failed=any(h.status == Status.FAILED for h in table),
            inline=all(h.inline for h in table),
            early=any(h.early for h in table),
            kind=kind,
            name=(kind, table[0].digest, table[0].input_sig) if kind else None,
            need=max(h.block for h in table),
        )
        if len(_READ) >= _READ_MAX:
            _READ.clear()
        _READ[key] = found
    return Round._make(found[:-1] + (payloads,))


class Issued(NamedTuple):
    """A round in flight: its all-gather, and the data sent right behind it (None: none)."""

    work: Any
    early: Any


def run_round(
    link: Link, header: Header, also: Optional[Callable[[], Any]] = None, what: Optional[str] = None
) -> Round:
    """One round: every rank's header and payload (packed beforehand, through a :class:`Route`), in one all-gather.
    ``also`` issues the data phase right behind the round (its header says ``early``); it is waited for here. A rank
    that did not send early, in a round where a peer did, sends a stand-in of the agreed shape, whatever round it is
    in, so the collectives pair up in the same order on every rank. ``what`` names the collective an ``OP`` or
    ``SYNC`` round precedes, for a peer's error should this rank stop here."""
    return finish_round(link, issue_round(link, header, also, what))


def issue_round(
    link: Link, header: Header, also: Optional[Callable[[], Any]] = None, what: Optional[str] = None
) -> Issued:
    """:func:`run_round`'s first half: the round's all-gather issued (and ``also``'s data behind it), nothing waited
    for."""
    name = ROUND_NAMES[header.kind] if what is None else f"{ROUND_NAMES[header.kind]} ({what})"
    if getattr(_WITHIN, "meshes", ()):
        _announce_part(link, ROUND_NAMES[header.kind] if what is None else what)
    ch, group = link.channel(), link.round_group
    ch.write_header(pack_header(header))
    buffers = ch.buffers
    work = comm.issue_all_gather(buffers.recv_flat, buffers.send, group, link.call, name)
    return Issued(work, also() if also is not None else None)


def finish_round(link: Link, issued: Issued) -> Round:
    """:func:`run_round`'s second half: the round waited for and read, the early data waited for or met."""
    ch, group = link.channel(), link.round_group
    comm.wait_for(issued.work, group, link.call, link.timeout)
    if link.host is None:  # the table sits in the data's own buffers
        stats.host_read()
    rnd = _read(ch.read_rows(), ch.buffers.payloads)
    if issued.early is not None:
        comm.wait_for(issued.early, link.group, link.call, link.timeout, ch.expected_data().collective())
    elif rnd.early:
        _stand_in(ch.expected_data(), link)
    ch.agree(rnd.name, rnd.need)
    return rnd


def _stand_in(shape: comm.DataShape, link: Link) -> None:
    """The collective a peer's early data pairs with (its contents unused), waited for."""
    comm.wait_for(shape.stand_in(link.call), shape.group, link.call, link.timeout, shape.collective())


# ---- rounds on part of a mesh, while a call's f runs on the whole of it

PART_DIGEST = 0x6A2D0002  # the round that tells a mesh's ranks a round on part of it follows
_WITHIN = threading.local()  # .meshes: (whole mesh's link, the mesh's key, the groups its Splits noted: a list) of
# the calls whose f runs on this thread, outermost first


@contextlib.contextmanager
def within_mesh(whole: Link, axes: Sequence[Link]) -> Iterator[None]:
    """While a map call's ``f`` runs on a mesh (its whole group ``whole``'s, its axes' groups ``axes``'): the first
    round on any other group (an axis's, several axes', a nested call's) is announced first, in an ``OP`` round on
    the whole mesh's group that every rank must pass, and the group is noted with the mesh (in
    :attr:`~.group.GroupState.parts_in_func`, alike on every rank).

    A rank waiting in a round on part of the mesh is told of a peer's failure only by a round on that part. No rank
    can be waiting in a round on a part not noted yet (its announcement needs every rank), so the exit takes a round
    on the whole mesh's group and one on each noted part, no more: on a mesh where f took rounds over one axis only,
    none on the others'."""
    meshes = getattr(_WITHIN, "meshes", ())
    _WITHIN.meshes = meshes + ((whole, _mesh_key(axes), []),)
    try:
        yield
    finally:
        _WITHIN.meshes = meshes


def parts_in_func(whole: Link, axes: Sequence[Link]) -> Tuple[Link, ...]:
    """The parts of this mesh a call has taken a round on inside its ``f`` (:func:`within_mesh`): its axes' groups
    and others (this rank's link to each, named and timed as ``whole``), in the order first met, alike on every
    rank; none where no call did."""
    found = state_of(whole.round_group.pg).parts_in_func.get(_mesh_key(axes), ())
    return tuple(part._replace(call=whole.call, timeout=whole.timeout) for part in found)


def note_split(link: Link) -> None:
    """A ``Split`` on ``link``'s group while a map call's ``f`` runs on a mesh (a ``pcast`` to varying over several
    axes): its transpose takes a round there in backward, which no round in ``f`` announced. Where that group is not
    the mesh's whole group nor one of its axes', the call notes it (:func:`split_parts`)."""
    pg = link.round_group.pg
    for whole, key, noted in getattr(_WITHIN, "meshes", ()):
        if pg is not whole.round_group.pg and all(a is not pg for a in key):
            if all(p.round_group.pg is not pg for p in noted):
                noted.append(link._replace(call=whole.call, timeout=whole.timeout))


def split_parts(whole: Link, axes: Sequence[Link]) -> Tuple[Link, ...]:
    """The groups the innermost call on this mesh whose ``f`` runs on this thread took a ``Split`` on, that are not
    its whole group nor an axis's (:func:`note_split`): its backward takes a round on each. Alike on every rank that
    ran the same ``f`` to its end, as every rank whose backward runs did."""
    key = _mesh_key(axes)
    for mesh_whole, mesh_key, noted in reversed(getattr(_WITHIN, "meshes", ())):
        if mesh_key == key and mesh_whole.round_group.pg is whole.round_group.pg:
            return tuple(noted)
    return ()


def _mesh_key(axes: Sequence[Link]) -> Tuple[Any, ...]:
    """A mesh as this rank tells it from another on the same ranks: its axes' groups (each mesh makes its own)."""
    return tuple(link.round_group.pg for link in axes)


def _announce_part(link: Link, name: str) -> None:
    """Before a round on ``link``'s group: on each enclosing mesh of which it is a part that the mesh has not noted
    yet, the round that announces it (outermost first; a mesh's own announcement is announced on the meshes around
    it)."""
    meshes, pg = _WITHIN.meshes, link.round_group.pg
    for i, (whole, key, _) in enumerate(meshes):
        noted = state_of(whole.round_group.pg).parts_in_func
        if whole.round_group.pg is pg or any(p.round_group.pg is pg for p in noted.get(key, ())):
            continue
        _WITHIN.meshes = meshes[:i]
        try:
            header = Header(kind=Kind.OP, digest=PART_DIGEST, inline=1)
            raise_failures(
                checked_round(whole, header, f"{name}, announced on the whole mesh"), None, None, whole, True
            )
        finally:
            _WITHIN.meshes = meshes
        noted.setdefault(key, []).append(link)


def status_round(
    link: Link, header: Header, also: Optional[Callable[[], Any]] = None, along: Sequence[Link] = ()
) -> Round:
    """The round at the end of a call's forward pass; repeats while a peer is still in an ``OP`` or ``SYNC`` round
    (it gives that up). A repeat has the size of the round before it (the channel keeps it), so the payload packed
    for the first stays where it is; data sent early with the first was met by the peers' stand-ins, so a repeat
    sends none.

    ``along``: other groups (a mesh's axes) where a peer may be waiting, each given a status round of its own (this
    header's status, nothing else), repeated on its own as this one is. Every first round is issued, this one last,
    before any is waited for, so a peer waiting on one group is told while this rank waits on another, and the rounds
    cost about one round's time; they are waited for in the order issued. A failure's rounds carry right behind them
    a stand-in of the data an exchange at that point of each group's rounds sends early (:func:`_issue_standing_in`):
    this rank skipped the rest of its ``f``, so a peer may be in that exchange, waiting for this rank's data before
    it can reach the groups this rank waits on first. (A rank that finished ``f`` meets peers at the same point, at
    this exit, where none sends data on these groups.)"""
    if along:
        plain = Header(kind=Kind.STATUS, status=header.status, inline=1)
        issue = _issue_standing_in if header.status == Status.FAILED else issue_round
        issued = [(other, issue(other, plain)) for other in along]
        first = issue(link, header) if also is None else issue_round(link, header, also)
        for other, pending in issued:
            if finish_round(other, pending).kind != Kind.STATUS:
                status_round(other, plain)
        rnd = finish_round(link, first)
    else:
        rnd = run_round(link, header, also)
    while rnd.kind != Kind.STATUS:
        rnd = run_round(link, header._replace(early=0))
    return rnd


def checked_round(
    link: Link,
    header: Header,
    what: str,
    also: Optional[Callable[[], Any]] = None,
    along: Sequence[Tuple[Link, Header]] = (),
) -> Round:
    """An ``OP`` or ``SYNC`` round: every rank must be at the same collective (same ``digest``). A round where a
    rank posted a failure returns as it is, whatever the others were at: the caller raises it on every rank. ``also``:
    a backward exchange's data, sent right behind the round (as :func:`status_round`'s).

    ``along``: rounds on other groups, inside a guarded backward (a guarded mesh's closing round), issued before this
    one and waited for after it, so that they are in flight together; each carries its header, or where this rank
    fails here, the failure as any post of it goes (:func:`_issue_standing_in`). Their readings are kept for the guarded
    backward (:func:`taken_along`): a failure's fan-out posts nothing more there, and the guard checks them
    (:func:`check_round`)."""
    if not along:
        return check_round(link, header, what, run_round(link, header, also, what=what))
    failed = header.status != Status.OK
    issued = [(g, _issue_standing_in(g, FAILURE, what) if failed else issue_round(g, h, what=what)) for g, h in along]
    rnd = finish_round(link, issue_round(link, header, also, what))
    for g, pending in issued:
        _note_along(g, finish_round(g, pending))
    return check_round(link, header, what, rnd)


def check_round(link: Link, header: Header, what: str, rnd: Round) -> Round:
    """:func:`checked_round`'s checks of a finished round this rank took with ``header``: ``rnd`` if a rank posted a
    failure or every rank was at the same collective; else, on every rank, the error saying who was elsewhere."""
    if rnd.failed:
        return rnd
    away = [] if rnd.kind == header.kind else [r for r, h in enumerate(rnd.table) if h.kind != header.kind]
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
    rnd = checked_round(link, Header(kind=Kind.OP, rows=rows, input_sig=0, digest=1), what)
    return tuple(h.rows for h in rnd.table)


def gather_objects(link: Link, obj: Any) -> List[Any]:
    """Every rank's picklable ``obj``, over the group the rounds take (an error path's details, never data)."""
    return comm.all_gather_object(obj, link.round_group, link.call, link.timeout, link.round_device)


GUARD_DIGEST = 0x6A2D0001  # a guarded backward's failure (:mod:`.guard`): its round names the call's backward
_GUARDED = threading.local()  # .meshes: one _Guarded per guarded backward (:mod:`.guard`) running on this thread,
# innermost last


class _Guarded(NamedTuple):
    """A guarded backward running on this thread: its call's whole group's link, its mesh axes' links (empty for a
    call on one group, or one axis), and the rounds it took along an exchange (:func:`checked_round`'s ``along``),
    by process group."""

    whole: Link
    axes: Tuple[Link, ...]
    along: Dict[Any, Round]


@contextlib.contextmanager
def guarding(whole: Link, axes: Sequence[Link] = ()) -> Iterator[None]:
    """Inside a guarded backward (:mod:`.guard`) of a call on ``whole``'s group: a failure met in an ``OP`` round
    there is raised on every rank as a backward's is (no call's exit follows to report it). On a mesh of several axes
    (``axes``, their groups other than the whole's), a failure met in a round on one of its groups is posted on each
    of the others before it is raised (:func:`fan_out`), since a peer may be waiting in any of them."""
    meshes = getattr(_GUARDED, "meshes", ())
    parts = tuple(a for a in axes if a.round_group.pg is not whole.round_group.pg)
    _GUARDED.meshes = meshes + (_Guarded(whole, parts if len(parts) > 1 else (), {}),)
    try:
        yield
    finally:
        _GUARDED.meshes = meshes


def _guarded_mesh(link: Link) -> Optional[_Guarded]:
    """The innermost guarded backward, where it has several axes and ``link``'s round group is one of its groups;
    else None."""
    meshes = getattr(_GUARDED, "meshes", ())
    if not meshes or not meshes[-1].axes:
        return None
    found = meshes[-1]
    pg = link.round_group.pg
    return found if any(g.round_group.pg is pg for g in (found.whole, *found.axes)) else None


def _note_along(link: Link, rnd: Round) -> None:
    meshes = getattr(_GUARDED, "meshes", ())
    if not meshes:
        raise AssertionError("a round along an exchange outside a guarded backward")  # pragma: no cover
    meshes[-1].along[link.round_group.pg] = rnd


def taken_along(link: Link) -> Optional[Round]:
    """The round the innermost guarded backward took on ``link``'s group along an exchange (None: none)."""
    meshes = getattr(_GUARDED, "meshes", ())
    return meshes[-1].along.get(link.round_group.pg) if meshes else None


def in_func_on_mesh() -> bool:
    """Whether this thread runs inside a map call's ``f`` on a mesh (a round on part of it is announced first)."""
    return bool(getattr(_WITHIN, "meshes", ()))


FAILURE = Header(kind=Kind.SYNC, status=Status.FAILED, digest=GUARD_DIGEST)


def failure_round(link: Link, what: str) -> Round:
    """The round a guarded backward posts its own failure in, on ``link``'s group (the call's): on a mesh of
    several axes, posted on each axis's group too (:func:`fan_out`), so that a peer waiting in a round on any of them
    is told. The whole group's round is returned."""
    mesh = _guarded_mesh(link)
    if mesh is None:
        return checked_round(link, FAILURE, what)
    return fan_out(mesh, None, what)


def fan_out(mesh: _Guarded, met: Optional[Link], what: str) -> Optional[Round]:
    """A failure posted once on each group of a guarded mesh (its axes', then the whole's), but ``met``'s, where
    this rank already met it, and those it took a round on along an exchange (their rounds pair with the peers' posts
    there): every round is issued before any is waited for, so a peer waiting in one is told while this rank waits in
    another, and a peer waiting in a round this rank does not post is told by a peer that does.

    Each rank makes one such round per group: the failing rank posts on all of them, a rank that meets the failure in
    a round on one group (a backward round of f's, the boundary's, or a peer's post) on the others. Every rank then
    gathers the details over the whole group (:func:`raise_failures`). The whole group's round is returned (None if
    ``met`` is the whole group)."""
    skip = None if met is None else met.round_group.pg
    issued = [
        (g, _issue_standing_in(g, FAILURE, what))
        for g in (*mesh.axes, mesh.whole)
        if g.round_group.pg is not skip and g.round_group.pg not in mesh.along
    ]
    found = None
    for g, pending in issued:
        rnd = finish_round(g, pending)
        found = rnd if g is mesh.whole else found
    if found is None and skip is not mesh.whole.round_group.pg:
        found = mesh.along.get(mesh.whole.round_group.pg)
    return found


def _issue_standing_in(link: Link, header: Header, what: Optional[str] = None) -> Issued:
    """A round on ``link``'s group, issued (a failure's, where this rank waits for it only after rounds on other
    groups); where an exchange at this point of the group's rounds is expected to send a data phase
    (:meth:`~.link.Channel.expected_data`), a stand-in of it goes right behind (the header says ``early``): a peer in
    a Join there may have sent its data behind its round, and waits for this rank's before it can post the failure on
    the mesh's other groups, which this rank may be waiting in first."""
    shape = link.channel().expected_data()
    if shape is None:
        return issue_round(link, header, what=what)
    return issue_round(link, header._replace(early=1), lambda: shape.stand_in(link.call), what)


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
    if table.count(table[0]) == len(table):  # every rank sent the same header (a steady call)
        return
    for field in agree:
        if len({getattr(h, field) for h in table}) > 1:
            raise Disagreement(field, table)
    for field in agree_nonempty:
        if len({getattr(h, field) for h in table if h.status == Status.OK}) > 1:
            raise Disagreement(field, table)


def raise_failures(
    rnd: Round,
    failure: Optional[RankFailure],
    cause: Optional[BaseException],
    link: Link,
    in_func: bool = False,
    posted: bool = False,
) -> None:
    """If any rank reported a failure, every rank learns the details and raises the same ``CmapError``. ``in_func``
    (a collective inside func, whose call's exit tells every rank): the failing rank raises its own error and the
    others ``CollectiveAborted``, so that the exit reports the failure once, as it is. In a guarded backward on a
    mesh of several axes, a rank that met the failure in ``rnd`` posts it on the mesh's other groups first
    (:func:`fan_out`; ``posted``: this rank posted on all of them already, :func:`failure_round`), and the details
    are gathered over the whole mesh."""
    if not rnd.failed:
        return
    if in_func and not getattr(_GUARDED, "meshes", ()):
        if cause is not None:
            raise cause
        failed = [r for r, h in enumerate(rnd.table) if h.status == Status.FAILED]
        raise CollectiveAborted(f"{link.call}: group rank(s) {failed} failed as they entered it.")
    mesh = _guarded_mesh(link)
    if mesh is not None and not posted:  # met here: on to the mesh's other groups, the details over the whole's
        rnd, link = fan_out(mesh, link, "a failure in the backward") or rnd, mesh[0]
    mine = rnd.table[link.round_group.rank].kind
    away = [r for r, h in enumerate(rnd.table) if h.kind != mine]
    if away:  # ranks at another kind of round (a later call's exit, which repeats its round) send no details here
        message = _away_in_backward(_call_of(link.call), "a backward collective", away)
        raise told(CmapError(message), link) from cause
    found = comm.all_gather_object(failure, link.round_group, link.call, link.timeout, link.round_device)
    failures = [f for f in found if f]
    real = [f for f in failures if f.exc_type != CollectiveAborted.__qualname__]
    call = link.call
    if any(h.status == Status.FAILED and h.digest == GUARD_DIGEST for h in rnd.table):  # one name on every rank
        call = f"{_call_of(call)} (backward)"
    raise told(CmapError.from_failures(call, real or failures, link.group.rank), link) from cause


def _call_of(name: str) -> str:
    """The call's name from a round's (``shard_map(f): psum('y')``): the call, not the round."""
    return name[: name.index("): ") + 1] if "): " in name else name


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
