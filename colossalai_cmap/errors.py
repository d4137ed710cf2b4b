"""The exception every rank raises when a cmap call fails somewhere in its group."""

import builtins
import traceback
from dataclasses import dataclass
from typing import Dict, List, Sequence, Type


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

    When every failing rank raised the same built-in exception type (say ``ValueError`` for a bad argument), the
    error is also an instance of that type, so ``except ValueError`` catches it on every rank as it would in one
    process.

    Attributes:
        failures: one :class:`RankFailure` per failing rank, in group-rank order. Empty for failures that are
            not tied to one rank (for example inputs that differ across ranks, or a timeout).
    """

    def __init__(self, message: str, failures: Sequence[RankFailure] = ()) -> None:
        super().__init__(message)
        self.failures = tuple(failures)

    def __str__(self) -> str:  # not a built-in base's (KeyError quotes its message)
        return BaseException.__str__(self)

    @classmethod
    def from_failures(cls, call: str, failures: Sequence[RankFailure], my_group_rank: int) -> "CmapError":
        lines = [f"{call} failed on {len(failures)} rank(s):"]
        lines += [f"  {f.describe()}" for f in failures]
        remote = [f for f in failures if f.group_rank != my_group_rank and f.traceback]
        if remote:
            lines.append(f"Remote traceback (group rank {remote[0].group_rank}):")
            lines.append(remote[0].traceback.rstrip())
        kinds = {f.exc_type for f in failures}
        error_type = _with_builtin(kinds.pop()) if len(kinds) == 1 else cls
        return error_type("\n".join(lines), failures)


_DUAL: Dict[str, Type[CmapError]] = {}


def _with_builtin(name: str) -> Type[CmapError]:
    """``CmapError`` that is also the built-in exception ``name`` (plain ``CmapError`` for any other type). A nested
    cmap's ``CmapError[ValueError]`` keeps its built-in type through the outer cmap."""
    if name.startswith("CmapError[") and name.endswith("]"):
        name = name[len("CmapError[") : -1]
    base = getattr(builtins, name, None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or issubclass(CmapError, base):
        return CmapError
    if name not in _DUAL:
        try:
            _DUAL[name] = type(f"CmapError[{name}]", (CmapError, base), {"__module__": __name__})
        except TypeError:  # an incompatible layout (e.g. OSError's): plain CmapError
            _DUAL[name] = CmapError
    return _DUAL[name]


def output_name(path: str) -> str:
    """An output leaf by its pytree path in func's output, for messages: ``output ['b']``, or ``the output``."""
    return f"output {path}" if path else "the output"


_LISTED = 8  # distinct values an error names; the rest are counted


def by_rank(shown: Sequence[str], sep: str = ", ") -> str:
    """``group rank 0: a, group ranks 1, 2: b``: each value once, with the ranks that returned it."""
    ranks: Dict[str, List[int]] = {}
    for r, value in enumerate(shown):
        ranks.setdefault(value, []).append(r)
    named = [f"group rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}" for v, rs in ranks.items()]
    more = f", and {len(named) - _LISTED} more" if len(named) > _LISTED else ""
    return sep.join(named[:_LISTED]) + more


class CollectiveAborted(RuntimeError):
    """Raised inside func when peers are not at the same collective (they finished, failed, or called another)."""
