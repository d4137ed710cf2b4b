"""Collectives over a named mapped axis, with jax.lax's names, arguments and meaning: ``psum(x, "i")`` inside
``cmap(f, axis_name="i")``.

The axis runs over every example of the global batch (the ones mapped on this rank and those on the other ranks),
as a jax axis runs over devices: ``axis_size("i")`` is the global batch size B and ``axis_index("i")`` an example's
global index. Inside ``shard_map`` the same ops run over the mesh's named axes, as in jax's shard_map: the axis
runs over the ranks of one mesh dimension, ``axis_size`` is its size and ``axis_index`` this rank's coordinate.
There a tiled ``psum_scatter`` or ``all_to_all`` also takes a dim the axis size does not divide: each rank's chunk
is its ``torch.tensor_split`` piece, as shard_map's blocks are (jax requires division).

Each op of the axis is one record of rules, registered together in ``RULES`` at the end of this module (as jax
registers a primitive's transpose, batcher and lowering): a reduction, the gather, and over one axis name the
per-example ops, each with its native collective. The public functions compose them with local tensor ops, so each
is differentiable (by jax's transpose rules), works under ``torch.vmap`` and ``torch.func`` transforms inside func, in
every mode, and inside nested cmaps for the inner or any outer axis name. ``axis_name`` may be a tuple of names, as
in ``psum(x, ("i", "j"))``: the axes of nested cmaps taken together, the first one major. Over a tuple of
``shard_map`` mesh axes, and for uneven tiled chunks, each op is one native collective on the group of those axes'
ranks (``joint_over``); over a tuple of cmap names it is a psum or an all_gather and a selection.
"""

import contextlib
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..wire.native import AllGather, AllToAll, ReduceScatter
from ..wire.roles import COPY, MAX, MIN
from . import grouped, lowering
from . import ops as axes
from . import vma
from .frame import AxisFrame, joint_over, lookup, names_of, native_over, on_ranks, own_chunk
from .modes import RANK
from .rules import AxisRule, RuleKind, Transpose, register

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "all_gather_invariant",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "axis_index",
    "axis_size",
    "pcast",
    "pvary",
    "pbroadcast",
]

AxisName = Union[str, Tuple[str, ...]]


def _over(x: torch.Tensor, axis_name: AxisName, op: str) -> torch.Tensor:
    """``op`` over every axis of a (tuple) name, innermost first, so that the first name is major; a reduction over
    mesh axes taken together, one on their group."""
    # is_compiling first: dynamo cannot index the rule table's mappingproxy (joint_over is None there anyway)
    several = len(names_of(axis_name)) > 1 and not torch.compiler.is_compiling()
    joint = joint_over(axis_name) if several and RULES[op].kind is RuleKind.REDUCE else None
    if joint is not None:
        size = axis_size(axis_name)
        frame = AxisFrame(link=joint.link, size=size, offset=joint.index, sizes=(1,) * size, mode=RANK)
        return lowering.reduce_rows(frame, x.unsqueeze(0), RULES[op], names_of(axis_name))
    for name in reversed(names_of(axis_name)):
        x = axes.apply(x, name, op)
    return x


def psum(x: torch.Tensor, axis_name: AxisName, *, axis_index_groups: Optional[Sequence[Sequence[int]]] = None) -> Any:
    """Sum of ``x`` over every example of the axis (all ranks); every example gets the same value.

    With ``axis_index_groups`` (a partition of the axis's indices into groups of one size), the sum over each
    member's group only, as a collective over the ranks that hold the group's members (one per set of such ranks),
    never over the whole axis. Inside a ``shard_map`` with ``check_vma=True`` the result is invariant within its
    group only, so its type still varies over the axis (jax 0.10 raises NotImplementedError there), and the
    transpose is the same grouped sum.

    Inside a ``shard_map`` with ``check_vma=True`` the result is invariant over the axis, and the sum of a value
    varying over it transposes to nothing (jax's ``psum_invariant``); a value invariant over it is first cast to
    varying (its transpose is the psum), so its sum is ``axis_size`` times it, as in jax.

    Example:
        >>> cmap(lambda x: x / psum(x.sum(), "i"), axis_name="i")(torch.rand(10, 3))  # normalise by the total
    """
    if axis_index_groups is not None:
        groups = _grouping("psum", axis_name, axis_index_groups)
        return vma.typed(names_of(axis_name), x, True, lambda v: _grouped(v, axis_name, "psum_grouped", groups))
    tracker = vma.typed_axes(names_of(axis_name))
    if tracker is None:
        return vma.untyped(names_of(axis_name), x, lambda v: _over(v, axis_name, "psum"))
    joint = joint_over(axis_name) if len(names_of(axis_name)) > 1 else None
    return vma.joined(tracker, x, names_of(axis_name), "psum", COPY, joint)


def pmean(x: torch.Tensor, axis_name: AxisName, *, axis_index_groups: Optional[Sequence[Sequence[int]]] = None) -> Any:
    """Mean of ``x`` over every example of the axis (with ``axis_index_groups``, over each member's group)."""
    if axis_index_groups is not None:
        size = len(_grouping("pmean", axis_name, axis_index_groups)[0])
        return psum(x, axis_name, axis_index_groups=axis_index_groups) / size
    return psum(x, axis_name) / axis_size(axis_name)


def _grouping(op: str, axis_name: AxisName, groups: Any) -> grouped.Groups:
    """The checked groups of an ``axis_index_groups`` call: of the axis's indices, or for a tuple name of the
    index in the axes taken together (the first name major), as jax's."""
    for name in names_of(axis_name):
        if lookup(name, op).mode.in_turns:  # its examples meet at one stacked value: no per-example results
            raise NotImplementedError(
                f"{op}(x, {axis_name!r}, axis_index_groups=...): not in mode='loop'; use mode='vmap' or 'batched'."
            )
    return grouped.check_groups(op, axis_name, groups, axis_size(axis_name))


# a grouped reduction over a tuple of cmap names: the group's gathered values reduced
_WITHIN_GROUP = {
    "psum_grouped": lowering.local_sum,
    "pmax_grouped": lowering.local_max,
    "pmin_grouped": lowering.local_min,
}


def _grouped(x: torch.Tensor, axis_name: AxisName, op: str, groups: grouped.Groups) -> torch.Tensor:
    """A grouped op (``psum_grouped``, ``pmax_grouped``, ``pmin_grouped`` or ``all_gather_grouped``) over one axis
    name, or over a tuple of them: along mesh axes of one ``shard_map`` the same sub-group collectives on the group
    of the axes taken together, each index at its rank (``Joint.ranks``); elsewhere (cmap names, axes of different
    calls) the gather over the tuple and each example's group picked from it."""
    names = names_of(axis_name)
    if len(names) == 1:
        return axes.apply(x, names[0], op, groups)
    joint = joint_over(axis_name)
    if joint is not None:
        size = axis_size(axis_name)
        frame = AxisFrame(
            link=joint.link,
            size=size,
            offset=joint.index,
            sizes=(1,) * size,
            mode=RANK,
            mesh=joint.mesh,
            members=joint.ranks,
        )
        return lowering.lower_rows(frame, x.unsqueeze(0), RULES[op], names, groups).squeeze(0)
    members = lowering.index_table(
        tuple(next(g for g in groups if i in g) for i in range(axis_size(axis_name))), x.device
    )

    def pick(everyone: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        rows = everyone.index_select(0, members.index_select(0, i.reshape(1)).squeeze(0))
        return _WITHIN_GROUP[op](rows) if op in _WITHIN_GROUP else rows

    return _per_example(axis_name, pick, _all_gather(x, axis_name, 0, False), axis_index(axis_name))


def pmax(x: torch.Tensor, axis_name: AxisName, *, axis_index_groups: Optional[Sequence[Sequence[int]]] = None) -> Any:
    """Elementwise maximum over every example of the axis (with ``axis_index_groups``, over each member's group).
    Not differentiable."""
    return _extreme(x, axis_name, "pmax", axis_index_groups)


def pmin(x: torch.Tensor, axis_name: AxisName, *, axis_index_groups: Optional[Sequence[Sequence[int]]] = None) -> Any:
    """Elementwise minimum over every example of the axis (with ``axis_index_groups``, over each member's group).
    Not differentiable."""
    return _extreme(x, axis_name, "pmin", axis_index_groups)


def _extreme(x: torch.Tensor, axis_name: AxisName, op: str, axis_index_groups: Any) -> torch.Tensor:
    if axis_index_groups is None:
        return vma.typed(names_of(axis_name), x, False, lambda v: _over(v, axis_name, op))
    groups = _grouping(op, axis_name, axis_index_groups)
    return vma.typed(names_of(axis_name), x, True, lambda v: _grouped(v, axis_name, f"{op}_grouped", groups))


def all_gather(
    x: torch.Tensor,
    axis_name: AxisName,
    *,
    axis_index_groups: Optional[Sequence[Sequence[int]]] = None,
    axis: int = 0,
    tiled: bool = False,
    to: str = "varying",
) -> torch.Tensor:
    """Every example's ``x``, in global order, stacked along a new dim ``axis`` (size B), or with ``tiled``
    concatenated along the existing dim ``axis``. The transpose of :func:`psum_scatter`. The result varies over
    the axis; ``to="invarying"`` is :func:`all_gather_invariant` (jax 0.10's spelling).

    With ``axis_index_groups``, the values of each member's group only, in the group's order (the new dim has the
    group's size), as a collective over the ranks that hold the group's members; its transpose is the grouped sum
    of the cotangents, each member its own slice."""
    if axis_index_groups is not None:
        if to != "varying":
            raise NotImplementedError(
                f"all_gather(x, {axis_name!r}, axis_index_groups=..., to={to!r}): grouped gathers vary (as in jax)."
            )
        groups = _grouping("all_gather", axis_name, axis_index_groups)
        return vma.typed(names_of(axis_name), x, True, lambda v: _all_gather(v, axis_name, axis, tiled, groups))
    if to == "invarying":
        return all_gather_invariant(x, axis_name, axis=axis, tiled=tiled)
    if to != "varying":
        raise ValueError(f"all_gather(x, {axis_name!r}, to={to!r}): to must be 'varying' or 'invarying'.")
    return vma.typed(names_of(axis_name), x, True, lambda v: _all_gather(v, axis_name, axis, tiled))


def all_gather_invariant(x: torch.Tensor, axis_name: AxisName, *, axis: int = 0, tiled: bool = False) -> torch.Tensor:
    """:func:`all_gather` whose result is invariant over the axis: inside a ``shard_map`` with ``check_vma=True``
    its transpose is this rank's slice of the cotangent, with no communication (jax's ``all_gather_invariant``).
    Elsewhere (``check_vma=False``, a cmap axis) it is :func:`all_gather`, as in jax."""
    tracker = vma.typed_axes(names_of(axis_name))
    if tracker is None:
        return vma.untyped(names_of(axis_name), x, lambda v: _all_gather(v, axis_name, axis, tiled))
    shape = _example_shape(axis_name, x)
    axis = _dim(axis, len(shape) + (0 if tiled else 1), "all_gather_invariant", "axis")
    full = vma.joined(tracker, x, names_of(axis_name), "all_gather_invariant", None)
    with tracker.pause():
        full = full.reshape(-1, *shape)  # the axes of a tuple name, the first one major
        full = full.movedim(0, axis).flatten(axis, axis + 1) if tiled else full.movedim(0, axis)
    return tracker.mark(full, tracker.of(x) - set(names_of(axis_name)))


def _all_gather(
    x: torch.Tensor, axis_name: AxisName, axis: int, tiled: bool, groups: Optional[grouped.Groups] = None
) -> torch.Tensor:
    """The gather over the axis, or with ``groups`` over this example's group, then arranged."""
    if groups is None:
        out, size = _over(x, axis_name, "all_gather"), axis_size(axis_name)
    else:
        out, size = _grouped(x, axis_name, "all_gather_grouped", groups), len(groups[0])
    shape = _example_shape(axis_name, x)
    axis = _dim(axis, len(shape) + (0 if tiled else 1), "all_gather", "axis")

    def arrange(full: torch.Tensor) -> torch.Tensor:
        full = full.reshape(size, *shape)  # the axes of a tuple name, the first one major
        return full.movedim(0, axis).flatten(axis, axis + 1) if tiled else full.movedim(0, axis)

    return _per_example(axis_name, arrange, out)


def pcast(x: torch.Tensor, axis_name: AxisName, *, to: str) -> torch.Tensor:
    """jax's ``pcast(x, axis_name, to="varying")``: ``x``, now typed as varying over the axis, whose transpose is a
    psum over it. Inside a ``shard_map`` with ``check_vma=True`` ``x`` must be invariant over the axis (jax 0.10
    refuses a cast from varying); elsewhere (``check_vma=False``, a cmap axis) it is the identity, as in jax."""
    names = names_of(axis_name)
    if to != "varying":
        raise ValueError(f"pcast(x, {axis_name!r}, to={to!r}): only to='varying' is supported.")
    for name in names:
        lookup(name, "pcast")
    return vma.cast_to_varying(x, names, f"pcast(x, {axis_name!r}, to='varying')")


def pvary(x: torch.Tensor, axis_names: AxisName) -> torch.Tensor:
    """``pcast(x, axis_names, to="varying")``, by its name in jax 0.8 and 0.9 (removed in jax 0.10)."""
    return pcast(x, axis_names, to="varying")


def pbroadcast(x: torch.Tensor, axis_name: AxisName, source: int) -> torch.Tensor:
    """The value of the member at index ``source`` of the axis, on every member: jax's
    ``psum(where(axis_index(axis_name) == source, x, 0), axis_name)``. Inside a ``shard_map`` with
    ``check_vma=True`` the result varies over the axis, as jax's ``pbroadcast``; its transpose sums the cotangents
    onto ``source``."""
    size = axis_size(axis_name)
    if not 0 <= source < size:
        raise ValueError(f"pbroadcast(x, {axis_name!r}, source={source}): source must be in [0, {size}).")
    here = axis_index(axis_name) == source
    here = here.reshape(here.shape + (1,) * (x.dim() - here.dim()))
    total = psum(torch.where(here, x, torch.zeros_like(x)), axis_name)
    tracker = vma.typed_axes(names_of(axis_name))
    return total if tracker is None else tracker.vary(total, names_of(axis_name))


def psum_scatter(
    x: torch.Tensor, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = False
) -> torch.Tensor:
    """The sum over the axis, scattered: example ``i`` gets the sum's ``i``-th slice along ``scatter_dimension``
    (whose size must be B), or with ``tiled`` its ``i``-th of B equal chunks. The transpose of :func:`all_gather`.
    Over one axis name it is a reduce-scatter: each rank receives only its examples' chunks.

    Along ``shard_map`` mesh axes a tiled dim need not divide by the axis size: rank ``i`` gets the ``i``-th
    ``torch.tensor_split`` chunk (the first ``length % size`` one longer), where jax requires division.
    """
    return vma.typed(names_of(axis_name), x, True, lambda v: _psum_scatter(v, axis_name, scatter_dimension, tiled))


def _psum_scatter(x: torch.Tensor, axis_name: AxisName, scatter_dimension: int, tiled: bool) -> torch.Tensor:
    shape = _example_shape(axis_name, x)
    d = _dim(scatter_dimension, len(shape), "psum_scatter", "scatter_dimension")
    chunk = _chunk("psum_scatter", axis_name, shape[d], tiled, "scatter_dimension")
    if chunk is not None and native_over(axis_name):
        out = axes.apply(x, names_of(axis_name)[0], "psum_scatter", d)
        return out if tiled else out.squeeze(d + _lead(axis_name))
    joint = joint_over(axis_name, shape[d])
    if joint is not None:
        lengths = lowering.split_lengths(shape[d], axis_size(axis_name))
        out = lowering.scatter_on_ranks(joint, x, d, lengths, f"psum_scatter({axis_name!r})")
        return out if tiled else out.squeeze(d)
    total = psum(x, axis_name)
    if chunk is None:
        return total.narrow(d, *own_chunk(axis_name, shape[d]))
    return _per_example(axis_name, lambda t, i: _slice(t, d, i, chunk, tiled), total, axis_index(axis_name))


def all_to_all(
    x: torch.Tensor, axis_name: AxisName, split_axis: int, concat_axis: int, *, tiled: bool = False
) -> torch.Tensor:
    """Example ``i`` gets every example's ``i``-th slice of ``split_axis`` (whose size must be B), stacked in global
    order along a new dim ``concat_axis``; with ``tiled``, the ``i``-th of B equal chunks, concatenated along the
    existing ``concat_axis``. Its transpose is itself with the axes swapped. Over one axis name it is an
    all-to-all: each chunk travels once, to the rank of the example that gets it.

    Along ``shard_map`` mesh axes a tiled ``split_axis`` need not divide by the axis size: rank ``i`` gets the
    ``i``-th ``torch.tensor_split`` chunk of every rank's value (the first ``length % size`` one longer), where jax
    requires division. Every rank's ``x`` has the same shape, as in jax.
    """
    return vma.typed(names_of(axis_name), x, True, lambda v: _all_to_all(v, axis_name, split_axis, concat_axis, tiled))


def _all_to_all(x: torch.Tensor, axis_name: AxisName, split_axis: int, concat_axis: int, tiled: bool) -> torch.Tensor:
    shape = _example_shape(axis_name, x)
    s = _dim(split_axis, len(shape), "all_to_all", "split_axis")
    c = _dim(concat_axis, len(shape), "all_to_all", "concat_axis")
    chunk = _chunk("all_to_all", axis_name, shape[s], tiled, "split_axis")
    if chunk is not None and native_over(axis_name):
        B = axis_size(axis_name)
        front = _per_example(axis_name, lambda v: v.movedim(s, 0), x)  # the chunks to send along dim 0
        got = axes.apply(front, names_of(axis_name)[0], "all_to_all", 0)  # (B sources * chunk, ...) per example

        def arrange(z: torch.Tensor) -> torch.Tensor:
            parts = z.unflatten(0, (B, chunk))  # [source, chunk, the other dims]
            if not tiled:
                return parts.squeeze(1).movedim(0, c)
            return parts.movedim(1, s + 1).movedim(0, c).flatten(c, c + 1)

        return _per_example(axis_name, arrange, got)
    joint = joint_over(axis_name, shape[s])
    if joint is not None:
        lengths = lowering.split_lengths(shape[s], axis_size(axis_name))
        return lowering.a2a_on_ranks(joint, x, s, c, lengths, tiled=tiled, what=f"all_to_all({axis_name!r})")
    everyone = all_gather(x, axis_name)  # per example: (B, *shape)
    if chunk is None:  # this rank's uneven chunk: the same Python-int range of every rank's value
        part = everyone.narrow(s + 1, *own_chunk(axis_name, shape[s]))
        return part.movedim(0, c).flatten(c, c + 1)

    def piece(full: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        part = _slice(full, s + 1, i, chunk, tiled)  # (B, ...): the split dim taken, or its chunk kept
        return part.movedim(0, c).flatten(c, c + 1) if tiled else part.movedim(0, c)

    return _per_example(axis_name, piece, everyone, axis_index(axis_name))


def ppermute(x: torch.Tensor, axis_name: AxisName, perm: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """Example ``dst`` gets example ``src``'s ``x`` for each ``(src, dst)`` in ``perm``; examples that no pair names
    as a destination get zeros. Its transpose is the inverse permutation. Over one axis name only the pairs' values
    move, each once."""
    return vma.typed(names_of(axis_name), x, True, lambda v: _ppermute(v, axis_name, perm))


def _ppermute(x: torch.Tensor, axis_name: AxisName, perm: Sequence[Tuple[int, int]]) -> torch.Tensor:
    sources = _sources(perm, axis_size(axis_name))
    if native_over(axis_name):
        return axes.apply(x, names_of(axis_name)[0], "ppermute", tuple(sources))
    joint = joint_over(axis_name)
    if joint is not None:
        return lowering.permute_on_ranks(joint, x, tuple(sources), f"ppermute({axis_name!r})")
    table = lowering.index_table(tuple(sources), x.device)
    everyone = all_gather(x, axis_name)

    def pick(full: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        src = table.index_select(0, i.reshape(1))
        got = full.index_select(0, src.clamp(min=0)).squeeze(0)
        return got * (src >= 0).to(got.dtype).reshape([1] * got.dim())

    return _per_example(axis_name, pick, everyone, axis_index(axis_name))


def axis_index(axis_name: AxisName) -> torch.Tensor:
    """The global index of the current example along the axis (an int64 scalar tensor per example), or inside
    ``shard_map`` this rank's coordinate along the mesh axis; for a tuple of names, the index in the axes taken
    together, the first one major."""
    tracker = vma.typed_axes(names_of(axis_name))
    with tracker.pause() if tracker is not None else contextlib.nullcontext():
        index = None
        for name in names_of(axis_name):
            mine = axes.index(name)
            index = mine if index is None else index * lookup(name, "axis_index").size + mine
    return index if tracker is None else tracker.mark(index, names_of(axis_name))


def axis_size(axis_name: AxisName) -> int:
    """The global batch size B along a cmap axis (not the number of ranks), or the size of a ``shard_map`` mesh
    axis; for a tuple of names, the product."""
    size = 1
    for name in names_of(axis_name):
        size *= lookup(name, "axis_size").size
    return size


# ------------------------------------------------------------------------------------------------------- helpers
def _lead(axis_name: AxisName) -> int:
    """Dims before an example's own: the rows in batched mode."""
    return 1 if _batched_mode(axis_name) else 0


def _batched_mode(axis_name: AxisName) -> bool:
    return lookup(names_of(axis_name)[0], "collective").mode.holds_rows


def _example_shape(axis_name: AxisName, x: torch.Tensor) -> Tuple[int, ...]:
    """One example's shape: in batched mode func holds the rows of its share along dim 0."""
    return tuple(x.shape[1:]) if _batched_mode(axis_name) else tuple(x.shape)


def _per_example(axis_name: AxisName, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` on each example's tensors: as they are under vmap or in a loop, mapped over the rows in batched mode."""
    return torch.vmap(fn)(*tensors) if _batched_mode(axis_name) else fn(*tensors)


def _slice(t: torch.Tensor, dim: int, i: torch.Tensor, chunk: int, tiled: bool) -> torch.Tensor:
    """Slice ``i`` of ``t`` along ``dim`` (the dim removed), or with ``tiled`` its ``i``-th chunk of ``chunk``."""
    if not tiled:
        return t.index_select(dim, i.reshape(1)).squeeze(dim)
    return t.index_select(dim, i * chunk + torch.arange(chunk, device=t.device))


def _dim(dim: int, ndim: int, op: str, what: str) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise ValueError(f"{op}: {what}={dim} is out of range for a value of {ndim} dims.")
    return dim % max(ndim, 1)


def _chunk(op: str, axis_name: AxisName, length: int, tiled: bool, what: str) -> Optional[int]:
    """The chunk each example gets: the axis size must equal the dim's length, or divide it when tiled. None: the
    chunks are uneven ``torch.tensor_split`` chunks, which only ``shard_map`` mesh axes allow (there each member is
    a rank, and its chunk's length a plain int; a cmap axis's examples share one vmapped shape)."""
    size = axis_size(axis_name)
    if tiled and length % size and on_ranks(axis_name):
        return None
    if not tiled and length != size:
        raise ValueError(
            f"{op}: the {what} has size {length}, but the axis has {size} examples; it must equal the axis size "
            f"(or pass tiled=True to split it into {size} equal chunks)."
        )
    if tiled and length % size:
        raise ValueError(
            f"{op}: the {what} has size {length}, which the axis's {size} examples do not divide: each example's "
            f"chunk is undefined (jax's meaning needs equal chunks); pad it to a multiple of {size}."
        )
    return length // size if tiled else 1


def _sources(perm: Sequence[Tuple[int, int]], size: int) -> list:
    """For each destination, its source in ``perm`` (-1: none), after checking ``perm`` as jax does."""
    source = [-1] * size
    seen = set()
    for pair in perm:
        src, dst = pair
        if not (0 <= src < size and 0 <= dst < size):
            raise ValueError(f"ppermute: pair {pair} is out of range for an axis of {size} examples.")
        if src in seen or source[dst] != -1:
            raise ValueError(f"ppermute: perm {list(perm)} names a source or a destination twice.")
        seen.add(src)
        source[dst] = src
    return source


# --------------------------------------------------------------------------------------------------- the rules
def _times_size(x: torch.Tensor, size: int) -> torch.Tensor:
    return x * size


def _copied(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.clone()


def _stacked(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.unsqueeze(0).expand(size, *x.shape).clone()


def _lead_in_front(arg: Any) -> Tuple[Any, int]:
    """Another map's dim leads the rows and leads the result; the argument names no example dim."""
    return arg, 0


def _lead_after_gathered(arg: Any) -> Tuple[Any, int]:
    """Another map's dim leads the rows; in the result it comes after the gathered dim."""
    return arg, 1


def _lead_before_example_dim(d: int) -> Tuple[int, int]:
    """Another map's dim leads the rows, so the example dim the op splits moves one on."""
    return d + 1, 0


def _no_arg(arg: Any) -> None:
    return None


def _first_row(arg: Any) -> int:
    return 0


def _own_row(cotangent: torch.Tensor, arg: Any) -> torch.Tensor:
    return cotangent.squeeze(0)


def _chunks_in_order(full: torch.Tensor, d: int) -> torch.Tensor:
    """Every example's chunk (gathered along dim 0), in order along the scattered dim ``d``."""
    return full.movedim(0, d).flatten(d, d + 1)


def _inverse(sources: Tuple[int, ...]) -> Tuple[int, ...]:
    """The inverse permutation of ``sources`` (each destination's source, -1: none)."""
    inverse = [-1] * len(sources)
    for j, s in enumerate(sources):
        if s >= 0:
            inverse[s] = j
    return tuple(inverse)


def _grouped_extreme(name: str, collective: Any) -> AxisRule:
    """A grouped max or min: each member its group's, not differentiable."""
    return AxisRule(
        name,
        RuleKind.PER_EXAMPLE,
        rows=grouped.reduce_rows_grouped,
        traced=None,
        traced_vmap=None,
        unbatched=_copied,
        batching=_lead_in_front,
        transpose=None,
        collective=collective,
    )


# Each op's rules, by jax.lax's name: what AxisOp follows. A transpose names another op of this table; an op with
# no traced rule is composed of psum and all_gather inside torch.compile (see native_over).
RULES: Mapping[str, AxisRule] = register(
    AxisRule(
        "psum",
        RuleKind.REDUCE,
        rows=lowering.reduce_rows,
        traced=lowering.reduce_rows_traced,
        traced_vmap=lowering.sum_rows_traced_vmap,
        unbatched=_times_size,
        batching=_lead_in_front,
        transpose=Transpose("psum"),
        collective=COPY,
        local=lowering.local_sum,
        reduce_op="sum",
    ),
    AxisRule(
        "pmax",
        RuleKind.REDUCE,
        rows=lowering.reduce_rows,
        traced=lowering.reduce_rows_traced,
        traced_vmap=lowering.extreme_rows_traced_vmap,
        unbatched=_copied,
        batching=_lead_in_front,
        transpose=None,
        collective=MAX,
        local=lowering.local_max,
        reduce_op="max",
    ),
    AxisRule(
        "pmin",
        RuleKind.REDUCE,
        rows=lowering.reduce_rows,
        traced=lowering.reduce_rows_traced,
        traced_vmap=lowering.extreme_rows_traced_vmap,
        unbatched=_copied,
        batching=_lead_in_front,
        transpose=None,
        collective=MIN,
        local=lowering.local_min,
        reduce_op="min",
    ),
    AxisRule(
        "all_gather",
        RuleKind.GATHER,
        rows=lowering.gather_rows,
        traced=lowering.gather_rows_traced,
        traced_vmap=lowering.gather_rows_traced_vmap,
        unbatched=_stacked,
        batching=_lead_after_gathered,
        transpose=Transpose("psum_scatter", arg=_first_row, arrange=_own_row),  # this example's row of the sum
        collective=AllGather,
    ),
    AxisRule(
        "psum_scatter",
        RuleKind.PER_EXAMPLE,
        rows=lowering.scatter_rows,
        traced=None,
        traced_vmap=None,
        unbatched=_copied,
        batching=_lead_before_example_dim,
        transpose=Transpose("all_gather", arg=_no_arg, arrange=_chunks_in_order),
        collective=ReduceScatter,
    ),
    AxisRule(
        "all_to_all",
        RuleKind.PER_EXAMPLE,
        rows=lowering.a2a_rows,
        traced=None,
        traced_vmap=None,
        unbatched=_copied,
        batching=_lead_before_example_dim,
        transpose=Transpose("all_to_all"),  # its own transpose
        collective=AllToAll,
    ),
    AxisRule(
        "ppermute",
        RuleKind.PER_EXAMPLE,
        rows=lowering.permute_rows,
        traced=None,
        traced_vmap=None,
        unbatched=_copied,
        batching=_lead_in_front,
        transpose=Transpose("ppermute", arg=_inverse),  # the inverse permutation
        collective=AllToAll,
    ),
    # axis_index_groups: each member gets its own group's result, so these are per-example ops (grouped.py)
    AxisRule(
        "psum_grouped",
        RuleKind.PER_EXAMPLE,
        rows=grouped.reduce_rows_grouped,
        traced=None,
        traced_vmap=None,
        unbatched=_copied,
        batching=_lead_in_front,
        transpose=Transpose("psum_grouped"),
        collective=COPY,
    ),
    _grouped_extreme("pmax_grouped", MAX),
    _grouped_extreme("pmin_grouped", MIN),
    AxisRule(
        "all_gather_grouped",
        RuleKind.PER_EXAMPLE,
        rows=grouped.gather_rows_grouped,
        traced=None,
        traced_vmap=None,
        unbatched=_copied,
        batching=_lead_after_gathered,
        transpose=Transpose("psum_scatter_grouped", arg=grouped.groups_at_dim_0),
        collective=AllGather,
    ),
    AxisRule(
        "psum_scatter_grouped",
        RuleKind.PER_EXAMPLE,
        rows=grouped.scatter_rows_grouped,
        traced=None,
        traced_vmap=None,
        unbatched=_copied,
        batching=grouped.lead_before_grouped_dim,
        transpose=Transpose("all_gather_grouped", arg=grouped.groups_of, arrange=grouped.gathered_to_dim),
        collective=COPY,
    ),
)
