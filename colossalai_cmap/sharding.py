"""The sharding helper: plan a batch of B over P ranks and take, scatter or accept each rank's shard."""

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, List, Sequence, Tuple

import torch


@dataclass(frozen=True)
class ShardPlan:
    """Rows per group rank; rank r's rows start at ``sum(sizes[:r])`` in the global batch."""

    sizes: Tuple[int, ...]


@lru_cache(maxsize=1024)
def plan(batch_size: int, world: int) -> ShardPlan:
    """The split ``torch.tensor_split(x, world)`` makes: the first ``B % P`` ranks get one extra row."""
    q, r = divmod(batch_size, world)
    return ShardPlan(tuple(q + (1 if i < r else 0) for i in range(world)))


def take_local(leaves: Sequence[Any], dims: Sequence[Any], offset: int, size: int) -> List[Any]:
    """This rank's rows of every mapped leaf, as zero-copy views."""
    return [leaf if d is None else leaf.narrow(d, offset, size) for leaf, d in zip(leaves, dims)]


def rows_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with its batch dim moved to the front (a view)."""
    return t if dim == 0 else t.movedim(dim, 0)
