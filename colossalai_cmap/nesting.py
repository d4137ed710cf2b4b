"""The maps now running in this process, which every layer that runs one reads and writes.

Which ranks each running cmap, compiled cmap or shard_map splits its batch over: a map nested inside one over ranks
it shares cannot split again (those ranks hold different rows of the outer batch), so it runs as plain
``torch.vmap`` over this rank's examples. Also torch's control-flow exceptions, which pass through every map as they
pass through ``torch.vmap``, and whether gradients are being tracked at all.

A leaf module: it imports only torch and the seam to torch's internals.
"""

import contextlib
from typing import Iterator, List, Sequence, Tuple

import torch

from .torch_internals import STOP_RECOMPUTATION, current_level

# Exceptions torch uses for control flow. Checkpoint's early stop is raised at the same point of the recomputation on
# every rank (every rank builds the same graph), so it passes through a map instead of being reported as a failure.
CONTROL_FLOW = (STOP_RECOMPUTATION,)

_SPLITTING: List[Tuple[int, ...]] = []  # the global ranks of each map now splitting a batch, outermost first


def start_splitting(ranks: Sequence[int]) -> None:
    """A map over ``ranks`` starts running its share (paired with :func:`stop_splitting`; dynamo traces these two,
    not a generator context manager)."""
    _SPLITTING.append(tuple(ranks))


def stop_splitting() -> None:
    _SPLITTING.pop()


@contextlib.contextmanager
def splitting(ranks: Sequence[int]) -> Iterator[None]:
    """While the block runs, a map over ``ranks`` is splitting its batch."""
    start_splitting(ranks)
    try:
        yield
    finally:
        stop_splitting()


def nested_in_split(ranks: Sequence[int]) -> bool:
    """Whether a map already splitting a batch shares more than one rank with ``ranks``: then a map over ``ranks``
    cannot split again and runs as plain ``torch.vmap``."""
    if not _SPLITTING:  # the common case: no map is running a share here
        return False
    mine = set(ranks)
    return any(len(mine.intersection(outer)) > 1 for outer in _SPLITTING)


def gradients_tracked() -> bool:
    """Whether gradients may be taken of what runs now: grad mode, or inside a ``torch.func`` transform."""
    return torch.is_grad_enabled() or current_level() is not None
