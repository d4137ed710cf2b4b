"""Partition specs and their checks, as their own layer: nothing here communicates or runs ``f``.

``P("x", None)`` says how a global value maps to per-rank blocks, one entry per leading dim: ``None`` (not split),
a mesh axis name, or a tuple of names (split over their product, the first major). Specs are pytree prefixes of the
arguments and outputs, as in jax. Each leaf's spec becomes a :class:`Placement`, and a placement gives the steps
that cut a block out of the global value or assemble it back (:class:`Step`), one mesh axis at a time.

Blocks are ``torch.tensor_split`` blocks, so a dim need not divide by its axes' size (jax requires it to): over a
tuple of axes the dim is split into as many blocks as the axes have ranks together, numbered with the first axis
major, as jax numbers them.
"""

import math
from dataclasses import dataclass
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..torch_internals import broadcast_to_and_flatten, keystr, tree_flatten_with_path, tree_structure
from ..wire.roles import COPY, FIRST, Role, Rows, tensor_split_sizes


class P(tuple):
    """jax's ``PartitionSpec``: how a global value maps to blocks, one entry per leading dim.

    Each entry is ``None`` (the dim is not split), a mesh axis name, or a tuple of names (the dim is split over
    their product, the first major). Dims after the last entry are not split. Mesh axes that no entry names are
    replicated: every rank along them holds the same block.

    Example:
        >>> P("x", None)       # dim 0 split over mesh axis "x", dim 1 whole
        >>> P(("x", "y"))      # dim 0 split over "x" and "y" together, "x" major
        >>> P()                # replicated over the whole mesh
    """

    entries: Tuple[Union[None, str, Tuple[str, ...]], ...]

    def __new__(cls, *entries: Union[None, str, Tuple[str, ...]]) -> "P":
        entries = tuple(tuple(e) if isinstance(e, list) else e for e in entries)
        spec = super().__new__(cls, entries)
        spec.entries = entries  # a plain tuple: what dynamo reads (it iterates no tuple subclass)
        return spec

    def __repr__(self) -> str:
        return f"P({', '.join(map(repr, self))})"

    def axes(self) -> Tuple[str, ...]:
        """Every mesh axis the spec names, in order."""
        return tuple(a for e in self.entries if e is not None for a in (e if isinstance(e, tuple) else (e,)))


def _entry_axes(entry: Union[None, str, Tuple[str, ...]]) -> Tuple[str, ...]:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


class Step(NamedTuple):
    """One mesh axis of a cut or an assembly: the axis, and the role of the value on that axis's group."""

    axis: str
    role: Role


class OffGrid(NamedTuple):
    """Where a leaf's blocks do not tile one global value: the split dim, and two coordinates (a dict of axis to
    index each) whose blocks along it differ in length though only axes that do not split it tell them apart."""

    dim: int
    first: dict
    at: dict


@dataclass(frozen=True)
class Placement:
    """How one leaf maps to blocks.

    Attributes:
        path: the leaf's pytree path, for messages (``args[1]['w']``, ``f(*args)[0]``).
        spec: its spec (``P()`` for a leaf that is not a tensor).
        split: for each split dim, the dim and the axes it is split over (first major).
        replicated: the mesh axes the spec leaves out, in mesh order.
    """

    path: str
    spec: P
    split: Tuple[Tuple[int, Tuple[str, ...]], ...]
    replicated: Tuple[str, ...]

    def dim_over(self, names: Sequence[str]) -> Optional[int]:
        """The one dim this leaf is split along, where it is split over exactly ``names`` in that order and replicated
        over nothing (the blocks of one gather over those axes' joint group, first major); else None."""
        if self.replicated or len(self.split) != 1 or tuple(self.split[0][1]) != tuple(names):
            return None
        return self.split[0][0]

    def cut_steps(self, shape: Sequence[int], sizes: dict, coords: dict) -> List[Step]:
        """Global value to this rank's block: each split dim's axes, major first, then the replicated axes (so the
        transpose sums blocks before it gathers them)."""
        steps = [Step(a, r) for d, axes in self.split for a, r in zip(axes, _rows(d, shape[d], axes, sizes, coords))]
        return steps + [Step(a, COPY) for a in self.replicated]

    def off_grid(self, sizes: dict, length: Callable[[dict, int], int]) -> Optional["OffGrid"]:
        """Where the blocks of a leaf do not tile one global value: the first split dim, and two coordinates whose
        blocks along it differ in length though only axes that do not split it tell them apart (axes that split other
        dims, or axes the leaf is replicated or invariant along, whose blocks are copies of one value). None where
        they tile."""
        for d, axes in self.split:
            others = tuple(a for a in sizes if a not in axes)  # every mesh axis: with types, none is "replicated"
            for c in _grid(tuple(axes) + others, sizes):
                at = dict(zip(tuple(axes) + others, c))
                first = {**at, **{a: 0 for a in others}}
                if length(at, d) != length(first, d):
                    return OffGrid(d, first, at)
        return None

    def assemble_steps(self, sizes: dict, coords: dict, length: Callable[[dict, int], int]) -> List[Step]:
        """This rank's block to the global value: the replicated axes first (the value at coordinate 0 of each),
        then each split dim's axes, minor first. ``length(coords, d)`` is the block length along dim ``d`` on the
        rank at ``coords`` (blocks of a split dim need not be equal)."""
        steps = [Step(a, FIRST) for a in self.replicated]
        at = {**coords, **{a: 0 for a in self.replicated}}
        for d, axes in self.split:
            for i in reversed(range(len(axes))):
                inner = axes[i + 1 :]
                chunks = tuple(
                    sum(length({**at, axes[i]: j, **dict(zip(inner, c))}, d) for c in _grid(inner, sizes))
                    for j in range(sizes[axes[i]])
                )
                steps.append(Step(axes[i], Rows(d, chunks)))
        return steps


def _grid(axes: Sequence[str], sizes: dict) -> List[Tuple[int, ...]]:
    """Every coordinate tuple along ``axes``."""
    out: List[Tuple[int, ...]] = [()]
    for a in axes:
        out = [c + (j,) for c in out for j in range(sizes[a])]
    return out


def _rows(dim: int, length: int, axes: Sequence[str], sizes: dict, coords: dict) -> List[Rows]:
    """For each axis of a split dim, the rows each member of this rank's group along it holds: the dim's
    ``tensor_split`` blocks over all the axes (first major), summed over the axes after it."""
    blocks = tensor_split_sizes(length, math.prod(sizes[a] for a in axes))
    out, base = [], 0
    for i, a in enumerate(axes):
        inner = math.prod(sizes[b] for b in axes[i + 1 :])
        chunks = tuple(sum(blocks[base + j * inner : base + (j + 1) * inner]) for j in range(sizes[a]))
        out.append(Rows(dim, chunks))
        base += coords[a] * inner
    return out


# ------------------------------------------------------------------------------------------------------ checks
def check_spec(call: str, kind: str, path: str, spec: Any, names: Sequence[str]) -> P:
    """``spec`` checked against the mesh's axis names."""
    if not isinstance(spec, P):
        raise TypeError(
            f"{call}: {kind}_specs{path} is {spec!r} of type {type(spec).__name__}; shard_map {kind}_specs argument "
            f"must be a pytree of P (colossalai_cmap.P, jax's PartitionSpec) instances."
        )
    seen = set()
    for entry in spec.entries:
        if not (entry is None or isinstance(entry, str) or (isinstance(entry, tuple) and entry)):
            raise TypeError(f"{call}: {kind}_specs{path} is {spec!r}: each entry is None, an axis name or a tuple.")
        for a in _entry_axes(entry):
            if a not in names:
                raise ValueError(
                    f"{call}: {kind}_specs{path} is {spec!r}, which refers to {a!r}, not an axis of the mesh "
                    f"(axis names {tuple(names)})."
                )
            if a in seen:
                raise ValueError(f"{call}: {kind}_specs{path} is {spec!r}, which names mesh axis {a!r} twice.")
            seen.add(a)
    return spec


class Leaf(NamedTuple):
    """Where a spec applies, for messages: the call, "in" or "out", the spec's path, and the value's name."""

    call: str
    kind: str
    path: str
    where: str


def placement(leaf: Leaf, spec: P, value: Any, names: Sequence[str]) -> Placement:
    """The placement of one leaf, after checking its spec against the value's rank (jax's wording)."""
    call, kind, path, where = leaf
    if not isinstance(value, torch.Tensor):
        if len(spec.axes()):
            raise TypeError(
                f"{call}: {kind}_specs{path} is {spec!r}, but {where} is a {type(value).__name__}, not a tensor; "
                f"only tensors are split (use P() for other values)."
            )
        return Placement(path, spec, (), tuple(names))
    if len(spec.entries) > value.dim():
        raise ValueError(
            f"{call}: shard_map was given an {kind}_specs entry which is too long to be compatible with the "
            f"corresponding {kind}put value: {kind}_specs{path} is {spec!r} which has length {len(spec.entries)}, but {where} "
            f"has shape {tuple(value.shape)}, which has rank {value.dim()} (and {value.dim()} < {len(spec.entries)}). "
            f"Entries in {kind}_specs must be of length no greater than the number of axes in the corresponding "
            f"{kind}put value." + (" For scalar values (rank 0), consider using P()." if value.dim() == 0 else "")
        )
    split = tuple((d, _entry_axes(e)) for d, e in enumerate(spec.entries) if e is not None)
    named = set(spec.axes())
    return Placement(path, spec, split, tuple(a for a in names if a not in named))


def broadcast_specs(
    call: str, kind: str, specs: Any, tree: Any, what: str, none_is_leaf: bool = False
) -> List[Tuple[str, Any, Any]]:
    """Each leaf of ``tree`` as (path, leaf, spec), the spec given by the prefix ``specs`` (jax's tree-prefix rule).
    ``what`` names ``tree`` in the message when ``specs`` is not a prefix of it. With ``none_is_leaf``, a None in
    ``specs`` is an entry (left out), not an empty subtree."""
    leaves = tree_flatten_with_path(tree)[0]

    def is_leaf(s: Any) -> bool:
        return isinstance(s, P) or (none_is_leaf and s is None)

    found = broadcast_to_and_flatten(specs, tree_structure(tree), is_leaf=is_leaf)
    if found is None:
        raise ValueError(
            f"{call}: shard_map {kind}_specs must be a tree prefix of {what}: {kind}_specs has structure "
            f"{tree_structure(specs, is_leaf=is_leaf)}, which is not a prefix of "
            f"{tree_structure(tree)}."
        )
    return [(keystr(path), leaf, spec) for (path, leaf), spec in zip(leaves, found)]
