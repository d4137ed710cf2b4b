"""The output layout of a cmapped function: what one example's outputs look like.

A rank with an empty shard never calls ``func``; it learns the layout from a rank that has data (or from its cache),
so it can still take part in the gather and return correctly shaped empty outputs.
"""

import zlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import TreeSpec, tree_unflatten

from .comm import digest

BATCHED, REPLICATED, CONSTANT = "batched", "replicated", "constant"
_ALIGN = 16  # bytes; every leaf's segment starts aligned for any dtype


@dataclass(frozen=True)
class LeafLayout:
    """One output leaf: a batched tensor, a replicated tensor (``out_dims=None``), or a non-tensor constant."""

    kind: str
    shape: Tuple[int, ...]  # per-example shape for batched leaves, the full shape for replicated ones
    dtype: Optional[torch.dtype]
    out_dim: Optional[int]
    value: Any = None

    @property
    def row_bytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * (self.dtype.itemsize if self.dtype is not None else 0)


@dataclass(frozen=True)
class OutLayout:
    spec: TreeSpec
    leaves: Tuple[LeafLayout, ...]

    @cached_property
    def digest(self) -> int:
        return digest((self.spec, self.leaves))

    @property
    def batched(self) -> List[int]:
        return [i for i, leaf in enumerate(self.leaves) if leaf.kind == BATCHED]

    def segments(self, rows: int) -> Tuple[List[int], int]:
        """Byte offset of each tensor leaf in one rank's packed row block of ``rows`` examples, and the block size."""
        cache = self.__dict__.setdefault("_segment_cache", {})
        found = cache.get(rows)
        if found is None:
            found = cache[rows] = self._segments(rows)
        return found

    def matches(self, flat_out: Sequence[Any], spec: TreeSpec) -> bool:
        """Whether outputs just computed have this layout (a cheap check before reusing a cached layout)."""
        if len(flat_out) != len(self.leaves):
            return False
        for value, leaf in zip(flat_out, self.leaves):
            if leaf.kind == CONSTANT:
                if isinstance(value, torch.Tensor) or value != leaf.value:
                    return False
            elif not isinstance(value, torch.Tensor) or value.dtype != leaf.dtype:
                return False
            elif leaf.kind == REPLICATED:
                if tuple(value.shape) != leaf.shape:
                    return False
            else:
                shape = value.shape
                d = leaf.out_dim
                if len(shape) != len(leaf.shape) + 1 or tuple(shape[:d]) + tuple(shape[d + 1 :]) != leaf.shape:
                    return False
        return spec == self.spec

    def _segments(self, rows: int) -> Tuple[List[int], int]:
        offsets, acc = [], 0
        for leaf in self.leaves:
            offsets.append(acc)
            if leaf.kind == BATCHED:
                acc += _aligned(rows * leaf.row_bytes)
            elif leaf.kind == REPLICATED:
                acc += _aligned(leaf.row_bytes)
        return offsets, acc

    def empty_outputs(self, device: torch.device) -> Any:
        """Outputs of an empty shard: size-0 batched leaves; replicated leaves are filled in by the gather."""
        leaves = []
        for leaf in self.leaves:
            if leaf.kind == BATCHED:
                shape = list(leaf.shape)
                shape.insert(leaf.out_dim, 0)
                leaves.append(torch.empty(shape, dtype=leaf.dtype, device=device))
            elif leaf.kind == REPLICATED:
                leaves.append(None)
            else:
                leaves.append(leaf.value)
        return tree_unflatten(leaves, self.spec)


def replicated_checksums(flat_out: Sequence[Any], layout: OutLayout) -> Tuple[Tuple[int, int], ...]:
    """``(leaf index, crc32 of its bytes)`` for each replicated (``out_dims=None``) output leaf; () when none.

    ``check_inputs=True`` folds these into the layout digest that ranks compare, so that an output declared
    replicated but different across ranks is caught instead of silently taking one rank's value.
    """
    sums = []
    for i, (value, leaf) in enumerate(zip(flat_out, layout.leaves)):
        if leaf.kind == REPLICATED:
            flat = value.detach().contiguous().cpu().reshape(-1)
            sums.append((i, zlib.crc32(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")))
    return tuple(sums)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def infer_layout(flat_out: Sequence[Any], out_dims: Sequence[Optional[int]], spec: TreeSpec) -> OutLayout:
    """The layout of local outputs whose batch dims already sit at ``out_dims``."""
    leaves = []
    for value, dim in zip(flat_out, out_dims):
        if not isinstance(value, torch.Tensor):
            leaves.append(LeafLayout(CONSTANT, (), None, None, value))
        elif dim is None:
            leaves.append(LeafLayout(REPLICATED, tuple(value.shape), value.dtype, None))
        else:
            shape = list(value.shape)
            del shape[dim]
            leaves.append(LeafLayout(BATCHED, tuple(shape), value.dtype, dim))
    return OutLayout(spec, tuple(leaves))
