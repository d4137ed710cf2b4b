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


@lru_cache(maxsize=1024)
def block_plan(batch_size: int, world: int) -> ShardPlan:
    """The split ``torch.chunk(x, world)`` makes: blocks of ``ceil(B / P)`` rows in rank order, the last nonempty
    block shorter. Used when the outputs are gathered: every rank's block padded to ``ceil(B / P)`` rows, laid
    end to end, holds the result as its first B rows, so the gather buffer is the result (no cut, no copy). The
    largest shard, hence the time, is the same as with :func:`plan`."""
    cap = -(-batch_size // world)
    return ShardPlan(tuple(max(0, min(cap, batch_size - r * cap)) for r in range(world)))


def split_for(dst: Any) -> Any:
    """The split a call uses: ``torch.tensor_split``'s where the caller sees its own rows (``dst="local"``), else
    :func:`block_plan`'s, which gathers without a copy."""
    return plan if dst == "local" else block_plan


def is_prefix(sizes: Sequence[int]) -> bool:
    """Whether blocks of ``max(sizes)`` rows laid end to end hold the rows as one prefix (only the last nonempty
    shard may be short)."""
    cap = max(sizes) if sizes else 0
    last = max((r for r, n in enumerate(sizes) if n), default=-1)
    return all(n == cap for n in sizes[:last])


def take_local(leaves: Sequence[Any], dims: Sequence[Any], offset: int, size: int) -> List[Any]:
    """This rank's rows of every mapped leaf, as zero-copy views."""
    return [leaf if d is None else leaf.narrow(d, offset, size) for leaf, d in zip(leaves, dims)]


def rows_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with its batch dim moved to the front (a view)."""
    return t if dim == 0 else t.movedim(dim, 0)
