"""PASS / FAIL / SKIP lines that every rank agrees on, and the comparisons the checks make.

Every check runs on every rank; the verdict is gathered over a separate gloo group (``ctl``) with its own timeout,
so the bookkeeping never queues behind nccl work, and a rank stuck in a collective turns into a clear message from
its peers instead of a silent hang.
"""

import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist


class PeerTimeout(RuntimeError):
    """A peer did not report a check within the control group's timeout: the run cannot go on in step."""


@dataclass
class Verdict:
    """One check's outcome over the whole world."""

    section: str
    name: str
    status: str  # "PASS", "FAIL" or "SKIP"
    detail: str
    seconds: float


class Reporter:
    """Runs checks on every rank and prints one agreed line per check on rank 0."""

    def __init__(self, ctl: Any, rank: int, size: int) -> None:
        self.ctl, self.rank, self.size = ctl, rank, size
        self.verdicts: List[Verdict] = []

    def say(self, text: str = "") -> None:
        """A line from rank 0 (every rank's stdout goes to the same terminal under torchrun)."""
        if self.rank == 0:
            print(text, flush=True)

    def gather(self, obj: Any, what: str) -> List[Any]:
        """Every rank's ``obj`` over the control group; :class:`PeerTimeout` when a peer does not arrive."""
        out: List[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self.ctl)
        except RuntimeError as exc:  # gloo's timeout: a peer is stuck (most likely in an nccl collective)
            raise PeerTimeout(f"{what}: a peer rank did not report in time ({exc})") from exc
        return out

    def check(self, section: str, name: str, fn: Callable[[], Optional[str]], needs: int = 1) -> bool:
        """Run ``fn`` on every rank: it returns a detail line or raises. Returns True when every rank passed."""
        if self.size < needs:
            return self.skip(section, name, f"needs {needs}+ ranks (one GPU each); this world has {self.size}")
        start = time.perf_counter()
        try:
            mine: Any = ("ok", fn() or "")
        except Exception as exc:  # reported as this rank's failure; the other ranks learn of it below
            mine = ("err", _describe(exc))
        seconds = time.perf_counter() - start
        everyone = self.gather(mine, f"{section}: {name}")
        failed = [(r, text) for r, (status, text) in enumerate(everyone) if status == "err"]
        if failed:
            detail = "; ".join(f"rank {r}: {text}" for r, text in _dedupe(failed))
            return self._record(Verdict(section, name, "FAIL", detail, seconds))
        return self._record(Verdict(section, name, "PASS", everyone[0][1], seconds))

    def skip(self, section: str, name: str, why: str) -> bool:
        """A check that cannot run in this world, and why."""
        return self._record(Verdict(section, name, "SKIP", why, 0.0))

    def _record(self, verdict: Verdict) -> bool:
        self.verdicts.append(verdict)
        self.say(
            f"{verdict.status} {verdict.section}: {verdict.name}" + (f": {verdict.detail}" if verdict.detail else "")
        )
        return verdict.status != "FAIL"

    @property
    def failed(self) -> List[Verdict]:
        return [v for v in self.verdicts if v.status == "FAIL"]

    def as_json(self) -> List[dict]:
        return [asdict(v) for v in self.verdicts]

    def counts(self) -> str:
        n = {s: sum(1 for v in self.verdicts if v.status == s) for s in ("PASS", "FAIL", "SKIP")}
        return f"{n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} skipped"


def _describe(exc: BaseException) -> str:
    """The exception in a few lines: its type and message, and where it was raised (the last frame)."""
    message = str(exc).strip().splitlines()
    head = f"{type(exc).__name__}: {message[0] if message else ''}"
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" [{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}]" if frames else ""
    return head[:400] + where


def _dedupe(failed: List[tuple]) -> List[tuple]:
    """Ranks that failed alike are listed once, as "rank 0,1,2: text"."""
    by_text: dict = {}
    for rank, text in failed:
        by_text.setdefault(text, []).append(rank)
    return [(",".join(map(str, ranks)), text) for text, ranks in by_text.items()]


def compare(what: str, got: Any, want: Any, exact: bool = False, atol: float = 1e-9, rtol: float = 1e-9) -> str:
    """Raises AssertionError unless ``got`` matches ``want`` (a tensor, or a pytree of them); returns a note.

    ``exact`` asks for bitwise equality. Otherwise values must be close (the default tolerance is for float64: the
    checks compute in float64), and the note says whether they were bitwise equal too: a shard's kernels may sum in
    another order than the whole batch's, on a GPU especially.
    """
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    want_leaves, want_spec = torch.utils._pytree.tree_flatten(want)
    if got_spec != want_spec:
        raise AssertionError(f"{what}: structure {got_spec} != {want_spec}")
    worst, bitwise = 0.0, True
    for g, w in zip(got_leaves, want_leaves):
        if not isinstance(w, torch.Tensor):
            if g != w:
                raise AssertionError(f"{what}: {g!r} != {w!r}")
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype or g.device != w.device:
            desc = (g.shape, g.dtype, g.device) if isinstance(g, torch.Tensor) else type(g).__name__
            raise AssertionError(f"{what}: got {desc}, want {(w.shape, w.dtype, w.device)}")
        if torch.equal(g, w):
            continue
        bitwise = False
        diff = float((g.double() - w.double()).abs().max()) if g.numel() else 0.0
        worst = max(worst, diff)
        if exact or not torch.allclose(g, w, atol=atol, rtol=rtol):
            raise AssertionError(
                f"{what}: values differ (max |diff| {diff:.3g}{', bitwise expected' if exact else ''})"
            )
    return "bitwise" if bitwise else f"max |diff| {worst:.2g}"


def flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
