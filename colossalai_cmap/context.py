"""What is running now: the named mapped axes visible to collectives, and the groups that split a batch.

A cmap whose group shares ranks (other than this one) with a cmap already splitting a batch cannot split again:
those ranks hold different rows of the outer batch. It runs as plain ``torch.vmap`` instead (:func:`inside`).
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .groups import Group
from .protocol import Link


@dataclass
class AxisFrame:
    """One active ``axis_name``: where its collectives go, the global batch size, and this rank's rows in it.

    Attributes:
        link: the group (None when the map runs in this process alone), device, call name and timeout.
        size: the global batch size B.
        offset: the first global index of this rank's rows.
        rows: this rank's row count.
        sizes: every rank's row count.
        mode: the cmap's mode.
        dummy: the shard is empty, and its one stand-in example contributes nothing to collectives.
        index: each example's global index, set while func runs (``axis_index``).
        level: the functorch level of this map's ``torch.vmap`` (mode "vmap"), set while func runs.
        loop: the barrier of loop-mode example threads.
    """

    link: Optional[Link]
    size: int
    offset: int
    rows: int
    sizes: Sequence[int]
    mode: str = "vmap"
    dummy: bool = False
    index: Any = None
    level: Optional[int] = None
    loop: Any = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        return self.link.device if self.link is not None else torch.device("cpu")


_FRAMES: Dict[str, List[AxisFrame]] = {}
SPLITTING: List[Tuple[int, ...]] = []  # the ranks of each cmap now running its shard with P > 1, outermost first


@contextlib.contextmanager
def axis_scope(name: Optional[str], frame: Optional[AxisFrame]) -> Iterator[None]:
    if name is None or frame is None:
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


def inside(group: Group) -> bool:
    """Whether a cmap already splitting a batch shares another rank with ``group`` (so this one runs locally)."""
    mine = set(group.ranks)
    return any(len(mine.intersection(ranks)) > 1 for ranks in SPLITTING)
