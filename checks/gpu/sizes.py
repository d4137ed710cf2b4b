"""Sizes per rank for the nccl rows: ``--sizes`` as text ("1KiB,64KiB,1MiB", plain numbers in MiB) and back.

No torch here: the launcher checks ``--sizes`` before it starts any rank.
"""

import re
from typing import List

UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
DEFAULT_SIZES = "1KiB,64KiB,1MiB,16MiB,64MiB"
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_sizes(text: str) -> List[int]:
    """Bytes per rank for each comma-separated size: a number with a unit (B, KiB, MiB, GiB, any case), or a plain
    number in MiB (the option's older form, "1,16,64"). Raises ValueError naming the size and the fix."""
    sizes = []
    for item in text.split(","):
        match = _SIZE.match(item)
        unit = match.group(2).lower() if match else ""
        if not match or (unit and unit not in UNITS):
            raise ValueError(
                f"--sizes: {item.strip()!r} is not a size: write a number with B, KiB, MiB or GiB "
                f"(powers of 1024; a plain number is MiB), e.g. {DEFAULT_SIZES!r}"
            )
        nbytes = float(match.group(1)) * UNITS[unit or "mib"]
        if nbytes != int(nbytes) or nbytes <= 0:
            raise ValueError(
                f"--sizes: {item.strip()!r} is {nbytes:g} bytes: a size is a positive whole number of bytes"
            )
        sizes.append(int(nbytes))
    return sizes


def size_label(nbytes: int) -> str:
    """The size in the largest unit that writes it in at most 4 digits: "1 KiB", "64 MiB", "768 B", "1.5 MiB"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"
