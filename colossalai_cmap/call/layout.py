"""The output layout of a cmapped function: what one example's outputs look like.

Every rank computes it from its own outputs (an empty share from its stand-in example) and the status round compares
the digests, so ranks whose outputs differ in structure, per-example shape or dtype raise together.
"""

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Collection, FrozenSet, NamedTuple, Optional, Sequence, Tuple

import torch

from ..digests import digest
from ..torch_internals import TreeSpec
from ..wire import comm
from .dims import leaf_paths

BATCHED, REPLICATED, CONSTANT = "batched", "replicated", "constant"
WHOLE_BATCH = "a loss over the whole batch"  # a replicated leaf's value: out_dims asked rows, the mode made it whole


@dataclass(frozen=True)
class LeafLayout:
    """One output leaf: a batched tensor, a replicated tensor (``out_dims=None``), or a non-tensor constant."""

    kind: str
    shape: Tuple[int, ...]  # per-example shape for batched leaves, the full shape for replicated ones
    dtype: Optional[torch.dtype]
    out_dim: Optional[int]
    value: Any = None


@dataclass(frozen=True)
class OutLayout:
    spec: TreeSpec
    leaves: Tuple[LeafLayout, ...]

    @cached_property
    def digest(self) -> int:
        return digest((self.spec, self.leaves))

    @cached_property
    def whole(self) -> FrozenSet[int]:
        """The positions of the losses over the whole batch (:mod:`.losses`), replicated whatever ``out_dims``."""
        return frozenset(i for i, leaf in enumerate(self.leaves) if leaf.kind == REPLICATED and leaf.value is not None)

    @cached_property
    def tensors(self) -> Tuple[int, ...]:
        """The positions of the tensor leaves (the ones that can move)."""
        return tuple(i for i, leaf in enumerate(self.leaves) if leaf.kind != CONSTANT)

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


def replicated_checksums(flat_out: Sequence[Any], layout: OutLayout) -> Tuple[Tuple[int, int], ...]:
    """``(leaf index, crc32 of its bytes)`` for each replicated (``out_dims=None``) output leaf; () when none.

    ``check_inputs=True`` folds these into the layout digest that ranks compare, so that an output declared
    replicated but different across ranks is caught instead of silently taking one rank's value.
    """
    sums = []
    for i, (value, leaf) in enumerate(zip(flat_out, layout.leaves)):
        if leaf.kind == REPLICATED:
            sums.append((i, comm.checksum([value])))
    return tuple(sums)


def infer_layout(
    flat_out: Sequence[Any], out_dims: Sequence[Optional[int]], spec: TreeSpec, whole: Collection[int] = ()
) -> OutLayout:
    """The layout of local outputs whose batch dims already sit at ``out_dims``; ``whole``: the positions of losses
    over the whole batch (their out_dims None)."""
    leaves = []
    for i, (value, dim) in enumerate(zip(flat_out, out_dims)):
        if not isinstance(value, torch.Tensor):
            leaves.append(LeafLayout(CONSTANT, (), None, None, value))
        elif dim is None:
            leaves.append(
                LeafLayout(REPLICATED, tuple(value.shape), value.dtype, None, WHOLE_BATCH if i in whole else None)
            )
        else:
            shape = list(value.shape)
            del shape[dim]
            leaves.append(LeafLayout(BATCHED, tuple(shape), value.dtype, dim))
    return OutLayout(spec, tuple(leaves))


class LeafSeen(NamedTuple):
    """One output leaf as a rank returned it, for the error that says how ranks' outputs differ (the error path)."""

    path: str  # its pytree path in func's output ("" for a lone tensor)
    kind: str
    shape: Tuple[int, ...]  # per example (batched), whole (replicated); () for a constant
    dtype: str  # a constant: its type and value
    out_dim: Optional[int]
    shown: str  # what this rank returned: dtype and shape, its rows included

    def agrees(self, other: "LeafSeen", but: str = "") -> bool:
        """Whether every rank may return the two, but for field ``but``."""
        return all(
            getattr(self, f) == getattr(other, f) for f in ("path", "kind", "shape", "dtype", "out_dim") if f != but
        )


def seen_outputs(flat_out: Sequence[Any], layout: OutLayout) -> Tuple[LeafSeen, ...]:
    """Each output leaf of this rank, described (:class:`LeafSeen`)."""
    seen = []
    for path, value, leaf in zip(leaf_paths(layout.spec), flat_out, layout.leaves):
        if leaf.kind == CONSTANT:
            shown = f"{type(value).__name__} {value!r}"[:80]
            seen.append(LeafSeen(path, leaf.kind, (), shown, None, shown))
            continue
        dtype = str(leaf.dtype).replace("torch.", "")
        shown = f"{dtype} {tuple(value.shape)}"
        if leaf.kind == REPLICATED:
            shown += " (out_dims=None)"
        elif leaf.out_dim:
            shown += f" (rows along dim {leaf.out_dim})"
        seen.append(LeafSeen(path, leaf.kind, leaf.shape, dtype, leaf.out_dim, shown))
    return tuple(seen)
