"""The named mapped axes visible to collectives inside a cmapped function."""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from .groups import Group


@dataclass
class AxisFrame:
    """One active ``axis_name``: the group, the global batch size, and this rank's rows in it."""

    group: Optional[Group]
    size: int
    offset: int
    rows: int
    sizes: Optional[Sequence[int]] = None
    mode: str = "vmap"
    dummy: bool = False  # an empty shard running one stand-in example so it joins every collective
    device: torch.device = torch.device("cpu")
    call: str = "cmap"
    timeout: Optional[float] = None
    index: Any = None  # per-example global index, set inside the mapped function
    loop: Any = field(default=None, repr=False)  # the barrier shared by loop-mode example threads
    round_bytes: int = 256  # the payload size of this call's rounds: op rounds must match the status round


_FRAMES: Dict[str, List[AxisFrame]] = {}


@contextlib.contextmanager
def axis_scope(name: Optional[str], frame: AxisFrame) -> Iterator[None]:
    if name is None:
        yield
        return
    stack = _FRAMES.setdefault(name, [])
    stack.append(frame)
    try:
        yield
    finally:
        stack.pop()
        if not stack:
            del _FRAMES[name]


def lookup(name: str, op: str) -> AxisFrame:
    stack = _FRAMES.get(name)
    if not stack:
        active = sorted(_FRAMES)
        hint = f"active axis names: {active}" if active else "no cmap with an axis_name is running"
        raise NameError(f"{op}(..., {name!r}): unbound axis name {name!r}; {hint}. Pass axis_name={name!r} to cmap.")
    return stack[-1]
