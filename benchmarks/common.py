"""What the benchmark runner and the renderer share: the performance goals and byte formatting."""

from typing import Optional

MiB = 1 << 20
GOAL_LARGE, GOAL_TINY, LARGE_BYTES = 1.05, 1.3, MiB


def goal_for(name: str, world: int, out_bytes: int) -> Optional[float]:
    """The goal for one (case, P) timing, judged at P = 2 and 4: 1.05x from 1 MiB of output, 1.3x for the tiny
    case. P = 1 rows (cmap's software overhead alone) and the medium case are reported without a goal."""
    if world < 2:
        return None
    if out_bytes >= LARGE_BYTES:
        return GOAL_LARGE
    return GOAL_TINY if name == "tiny" else None


def fmt_bytes(n: Optional[float]) -> str:
    """``n`` bytes as B, KiB or MiB with four significant digits; ``-`` for None."""
    if n is None:
        return "-"
    for unit, size in (("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"
