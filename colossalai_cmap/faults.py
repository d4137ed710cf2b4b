"""Fault injection, for testing that a failure on one rank reaches every rank (a public testing aid).

``with inject_fault("pack", ranks=[1]):`` makes every cmap call in the block raise :class:`InjectedFault` at that
phase on those group ranks. The phases are the places where a rank-local exception can happen in a call, each caught
and reported in the next round, so that every rank raises the same ``CmapError`` and the group stays usable:

- ``"args"``: argument checks and planning;
- ``"scatter"``: with ``src=r``, receiving this rank's shard;
- ``"func"``: running ``func`` on the shard;
- ``"layout"``: reading the outputs' structure against ``out_dims``;
- ``"record"``: recording what backward needs (the closure-captured tensors);
- ``"pack"``: packing the outputs and allocating the results, before the status round;
- ``"gather"``: preparing the data phase of a large output;
- ``"backward"``: any collective of backward (and of cmap's data movement outside func).

When no block is active, :func:`check` is one dictionary test.
"""

import contextlib
from typing import Dict, Iterable, Iterator, Set

__all__ = ["InjectedFault", "PHASES", "inject_fault"]

PHASES = ("args", "scatter", "func", "layout", "record", "pack", "gather", "backward")
ACTIVE: Dict[str, Set[int]] = {}  # empty unless a block is open: callers test it before calling check()


class InjectedFault(RuntimeError):
    """The exception :func:`inject_fault` raises."""


@contextlib.contextmanager
def inject_fault(phase: str, ranks: Iterable[int]) -> Iterator[None]:
    """Raise :class:`InjectedFault` at ``phase`` on these group ranks, in every cmap call inside the block."""
    if phase not in PHASES:
        raise ValueError(f"inject_fault: unknown phase {phase!r}; expected one of {', '.join(PHASES)}.")
    previous = ACTIVE.get(phase)
    ACTIVE[phase] = set(ranks)
    try:
        yield
    finally:
        if previous is None:
            ACTIVE.pop(phase, None)
        else:
            ACTIVE[phase] = previous


def check(phase: str, group) -> None:  # noqa: ANN001 (a Group; no import, to keep this module dependency-free)
    if ACTIVE and group.rank in ACTIVE.get(phase, ()):
        raise InjectedFault(f"injected fault at phase {phase!r} on group rank {group.rank}")
