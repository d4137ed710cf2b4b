"""Who is where: this process's count of cmap collectives on each process group, published to the c10d store, so
that a wait that fails can name the ranks that never arrived and say what each was last doing.

Every rank of a group issues cmap's collectives on it in the same order (that is what keeps gloo's sizes equal), so
a count of them is a place every rank shares: collective #13 on a group is the same round on every rank in step.
The hot path only counts and notes, in memory (:func:`note_issued`, :func:`note_returned`): no store round-trip. A
daemon thread publishes this process's notes to the default store, under ``colossalai_cmap/presence/<global rank>``,
once they settle (unchanged for one tick of :data:`TICK` seconds, which is what a stalled rank looks like) and at least
every :data:`MAX_AGE` seconds while they keep changing; it never blocks the caller. After a failed wait, :func:`absent`
reads the peers' notes, within :data:`READ_TIMEOUT` seconds of its own so that a dead store cannot hang the error
path, and names the ranks whose count on that group is behind this rank's, with their last note.

``COLOSSALAI_CMAP_PRESENCE=0`` turns the publishing (and the names in the error) off.
"""

import json
import os
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch.distributed as dist

from ..torch_internals import default_store

ENABLED = os.environ.get("COLOSSALAI_CMAP_PRESENCE", "1") != "0"
TICK = float(os.environ.get("COLOSSALAI_CMAP_PRESENCE_TICK", "0.25"))  # seconds between the publisher's looks
MAX_AGE = 5.0  # seconds: how stale a published record may get while this process keeps making collectives
READ_TIMEOUT = 2.0  # seconds the error path may spend on the store
KEY = "colossalai_cmap/presence/{}"
_NAMED = 8  # ranks described one by one in an error; the rest are listed


class Doing(NamedTuple):
    """One collective on one group, as the process that issued it noted it."""

    seq: int  # its number on the group, counted from 1: the same on every rank in step
    call: str  # the cmap call that issued it ("cmap(f, in_dims=0)", "shard_model", ...)
    what: str  # "exit round", "op round (psum('i'))", "sync round (...)", "broadcast", ...
    since: float  # time.time() when it was issued


class Track:
    """This process's count of cmap collectives on one process group, and the latest one.

    Attributes:
        name: the process group's name (the same on every rank).
        ranks: the global rank of each group rank.
        seq: how many collectives this process issued on the group.
        doing: the latest of them, or None before the first.
        finished: the number of the latest one whose wait returned.
        failed: why a wait on the group failed ("" while none did).
    """

    __slots__ = ("name", "ranks", "seq", "doing", "finished", "failed")

    def __init__(self, name: str, ranks: Tuple[int, ...]) -> None:
        self.name, self.ranks = name, ranks
        self.seq = self.finished = 0
        self.doing: Optional[Doing] = None
        self.failed = ""


class Note(NamedTuple):
    """A group's line in a published record: what the process last issued on it, and how that wait went."""

    ranks: Tuple[int, ...]
    doing: Doing
    finished: bool
    failed: str


class Record(NamedTuple):
    """What one process published: a note per group (by group name), and the group of its latest collective."""

    notes: Dict[str, Note]
    latest: str


_TRACKS: Dict[str, Track] = {}  # by group name; a new group of the same name (a new world) replaces the old one
_latest: Optional[Track] = None
_publisher: Optional[threading.Thread] = None


def track(name: str, ranks: Tuple[int, ...]) -> Track:
    """A new count for the process group called ``name`` (made once per group, with its state)."""
    found = _TRACKS[name] = Track(name, ranks)
    return found


def note_issued(tr: Track, call: str, what: str) -> Doing:
    """Note a collective just issued on ``tr``'s group; returns the note (its number there, ...)."""
    global _latest
    seq = tr.seq = tr.seq + 1
    doing = tr.doing = Doing(seq, call, what, time.time())
    _latest = tr
    if _publisher is None and ENABLED:
        _start()
    return doing


def note_returned(tr: Track, doing: Doing) -> None:
    """Note that the wait for the collective ``doing`` on ``tr``'s group returned."""
    tr.finished = doing.seq


def _start() -> None:
    global _publisher
    _publisher = threading.Thread(target=_publish_loop, name="colossalai_cmap presence", daemon=True)
    _publisher.start()


# ----------------------------------------------------------------------------------------------------- publishing
def _snapshot() -> Tuple[Dict[str, tuple], str]:
    """This process's record in plain types, for JSON (nothing a reader runs, whatever the store holds)."""
    notes = {}
    for name, tr in list(_TRACKS.items()):
        doing = tr.doing
        if doing is not None:
            notes[name] = (tr.ranks, tuple(doing), tr.finished >= doing.seq, tr.failed)
    latest = _latest
    return notes, latest.name if latest is not None else ""


def _store() -> Optional[Any]:
    try:
        return default_store() if dist.is_initialized() else None
    except (RuntimeError, ValueError):  # torch.distributed is being torn down
        return None


def _publish(store: Any, snap: Tuple[Dict[str, tuple], str]) -> None:
    store.set(KEY.format(dist.get_rank()), json.dumps(snap))


def _publish_loop() -> None:
    """Publish this process's record when it settles, or at least every :data:`MAX_AGE` seconds while it changes."""
    published: Any = None
    seen: Any = None
    where: Any = None
    at = 0.0
    while True:
        time.sleep(TICK)
        try:
            store = _store()
            if store is None:
                continue
            if store is not where:  # a new world: its store has nothing of ours yet
                where, published = store, None
            snap = _snapshot()
            now = time.monotonic()
            if snap != published and (snap == seen or now - at >= MAX_AGE):
                _publish(store, snap)
                published, at = snap, now
            seen = snap
        except Exception:  # a store that went away: the error path says the records were unreadable
            time.sleep(1.0)


# -------------------------------------------------------------------------------------------------- the error path
def _bounded(fn: Callable[[], Any], timeout: float) -> Tuple[Any, str]:
    """``fn()`` on a helper thread, given up after ``timeout`` (a store can block far longer): (result, why not)."""
    box: List[Any] = []

    def run() -> None:
        try:
            box.append((fn(), ""))
        except Exception as exc:
            box.append((None, f"{type(exc).__name__}: {exc}"))

    helper = threading.Thread(target=run, name="colossalai_cmap presence read", daemon=True)
    helper.start()
    helper.join(timeout)
    return box[0] if box else (None, f"the store did not answer within {timeout:g} s")


def _decode(raw: bytes) -> Optional[Record]:
    """A peer's record; None for one this code cannot read (written by another version, say)."""
    try:
        notes, latest = json.loads(raw)
        notes = {
            name: Note(tuple(ranks), Doing._make(doing), finished, failed)
            for name, (ranks, doing, finished, failed) in notes.items()
        }
    except (ValueError, TypeError):
        return None
    return Record(notes, latest)


def _exchange(ranks: Sequence[int]) -> Dict[int, Optional[Record]]:
    """Publish this process's record now (it just failed a wait), then read each of ``ranks``' records."""
    store = _store()
    if store is None:
        raise RuntimeError("torch.distributed has no default store")
    _publish(store, _snapshot())
    found: Dict[int, Optional[Record]] = {}
    for g in ranks:
        key = KEY.format(g)
        found[g] = _decode(store.get(key)) if store.check([key]) else None
    return found


def _where(doing: Doing, now: float, ranks: Optional[Tuple[int, ...]] = None) -> str:
    on = f", on the group of global ranks {list(ranks)}" if ranks is not None else ""
    return (
        f"{doing.call} collective #{doing.seq}, {doing.what}{on}, {max(now - doing.since, 0.0):.1f} s before this error"
    )


def _missing(rec: Optional[Record], tr: Track, now: float) -> str:
    """What a rank that did not arrive was last doing, by its record."""
    if rec is None:
        return "it has published no record (it made no cmap collective yet, or died before its record was published)"
    note, other = rec.notes.get(tr.name), rec.notes.get(rec.latest)
    if rec.latest == tr.name or other is None or (note is not None and other.doing.since < note.doing.since):
        other = None  # nothing newer elsewhere
    state = "" if other is None else ", and is still waiting in it" if not other.finished else ", which it finished"
    if note is None:
        text = "it made no cmap collective on this group"
        return text if other is None else f"{text}; its latest was in {_where(other.doing, now, other.ranks)}{state}"
    text = f"it was last in {_where(note.doing, now)}"
    if note.failed:
        text += f", and gave up waiting in it ({note.failed})"
    return text if other is None else f"{text}; after it, it entered {_where(other.doing, now, other.ranks)}{state}"


def absent(tr: Track, waited: Doing, rank: int, why: str) -> str:
    """The sentences a failed wait adds to its error: this rank's place on the group, the ranks that did not arrive
    (behind ``seq`` on the group, or no record there) with what each was last doing, and the ranks that arrived and
    gave up too.

    Args:
        tr: the group's count in this process.
        waited: the collective whose wait failed, as :func:`note_issued` noted it.
        rank: this process's group rank.
        why: why the wait failed, noted for the peers to read.
    """
    if not ENABLED:
        return ""
    tr.failed, seq = why, waited.seq
    text = f" This rank was waiting in collective #{seq} on this group ({waited.call}, {waited.what})."
    peers = [(r, g) for r, g in enumerate(tr.ranks) if r != rank]
    records, trouble = _bounded(lambda: _exchange([g for _, g in peers]), READ_TIMEOUT)
    if records is None:
        return f"{text} The peers' presence records could not be read ({trouble})."
    now, missing, gave_up = time.time(), [], []
    for r, g in peers:
        rec = records.get(g)
        note = rec.notes.get(tr.name) if rec is not None else None
        if note is None or note.doing.seq < seq:
            missing.append((r, g, rec))
        elif note.failed and note.doing.seq == seq:
            gave_up.append(f"group rank {r} (global rank {g})")
    for r, g, rec in missing[:_NAMED]:
        text += f" group rank {r} (global rank {g}) did not arrive; {_missing(rec, tr, now)}."
    if len(missing) > _NAMED:
        text += f" Group ranks {[r for r, _, _ in missing[_NAMED:]]} did not arrive either."
    if gave_up:
        text += f" Reached it and gave up waiting too: {', '.join(gave_up)}."
    if not missing:
        text += " Every peer's record shows it reached this collective (one may have died in it)."
    return text
