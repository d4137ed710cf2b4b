"""The exception every rank raises when a cmap call fails somewhere in its group."""

import traceback
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank, in a form that pickles across processes."""

    group_rank: int
    global_rank: int
    exc_type: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException, group_rank: int, global_rank: int) -> "RankFailure":
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(group_rank, global_rank, type(exc).__qualname__, str(exc), text)

    def describe(self) -> str:
        return f"group rank {self.group_rank} (global rank {self.global_rank}) raised {self.exc_type}: {self.message}"


class CmapError(RuntimeError):
    """Raised on every rank of the group when a cmap call fails on any of them.

    Attributes:
        failures: one :class:`RankFailure` per failing rank, in group-rank order. Empty for failures that are
            not tied to one rank (for example inputs that differ across ranks, or a timeout).
    """

    def __init__(self, message: str, failures: Sequence[RankFailure] = ()) -> None:
        super().__init__(message)
        self.failures = tuple(failures)

    @classmethod
    def from_failures(cls, call: str, failures: Sequence[RankFailure], my_group_rank: int) -> "CmapError":
        lines = [f"{call} failed on {len(failures)} rank(s):"]
        lines += [f"  {f.describe()}" for f in failures]
        remote = [f for f in failures if f.group_rank != my_group_rank and f.traceback]
        if remote:
            lines.append(f"Remote traceback (group rank {remote[0].group_rank}):")
            lines.append(remote[0].traceback.rstrip())
        return cls("\n".join(lines), failures)
