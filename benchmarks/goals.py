"""The performance goals, and the byte formatting that the runner's summary and the report share (no torch here)."""

from typing import Optional

MiB = 1 << 20
# cmap / baseline: below MID_BYTES of output each case's own goal (GOAL_SMALL for the tiny and medium cases), from
# MID_BYTES GOAL_MID, from LARGE_BYTES GOAL_LARGE
GOAL_SMALL, GOAL_MID, GOAL_LARGE = 1.3, 1.1, 1.05
MID_BYTES, LARGE_BYTES = MiB, 4 * MiB


def goal_for(small_goal: Optional[float], world: int, out_bytes: int) -> Optional[float]:
    """The goal for one (case, P) timing, judged at P >= 2, by the whole batch's output bytes: 1.05x from 4 MiB,
    1.1x from 1 MiB, else the case's own goal (1.3x for the tiny and the medium, 256 KiB, cases). P = 1 rows
    (cmap's software overhead alone) and small cases without a goal of their own are reported without a goal.

    Args:
        small_goal: the case's goal below 1 MiB of output (``Case.small_goal``), or None.
        world: P.
        out_bytes: the whole batch's output bytes.
    """
    if world < 2:
        return None
    if out_bytes >= LARGE_BYTES:
        return GOAL_LARGE
    if out_bytes >= MID_BYTES:
        return GOAL_MID
    return small_goal


def fmt_bytes(n: Optional[float]) -> str:
    """``n`` bytes as B, KiB or MiB with four significant digits; ``-`` for None."""
    if n is None:
        return "-"
    for unit, size in (("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"
