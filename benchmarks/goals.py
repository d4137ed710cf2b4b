"""The performance goals, and the byte formatting that the runner's summary and the report share (no torch here)."""

from typing import Optional

MiB = 1 << 20
GOAL_LARGE, GOAL_TINY, LARGE_BYTES = 1.05, 1.3, MiB


def goal_for(small_goal: Optional[float], world: int, out_bytes: int) -> Optional[float]:
    """The goal for one (case, P) timing, judged at P >= 2: 1.05x from 1 MiB of output, else the case's own goal
    (1.3x for the tiny case). P = 1 rows (cmap's software overhead alone) and cases without a small-output goal
    (the medium case) are reported without a goal.

    Args:
        small_goal: the case's goal below 1 MiB of output (``Case.small_goal``), or None.
        world: P.
        out_bytes: the whole batch's output bytes.
    """
    if world < 2:
        return None
    if out_bytes >= LARGE_BYTES:
        return GOAL_LARGE
    return small_goal


def fmt_bytes(n: Optional[float]) -> str:
    """``n`` bytes as B, KiB or MiB with four significant digits; ``-`` for None."""
    if n is None:
        return "-"
    for unit, size in (("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"
