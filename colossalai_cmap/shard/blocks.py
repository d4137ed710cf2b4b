"""Global values to this rank's blocks and back, one mesh axis at a time, with the two wire primitives.

Cutting a block is a ``Split`` per axis (this rank's rows along a split axis; along an axis the spec leaves out, the
value itself): no communication. Its transpose, in backward, is a ``Join`` per axis in the reverse order: the
block's gradients summed over the replicated axes, then gathered along the split ones, so each global input's
``.grad`` is the whole gradient, on every rank. A value split over every axis is cut by one ``Split`` over the
whole mesh instead, where the whole mesh's group holds its blocks in rank order (or, for its gradient, a copy in
tile order does, up to :data:`~colossalai_cmap.wire.link.FUSE_BYTES`), so that its transpose is one gather. So is a
value split over some axes and invariant along the others (with types), where every rank holds a copy of the block
at coordinate 0 of the others and only those send rows in the gather, while its empty slots cost little.

Assembling is a ``Join`` per axis: along an axis the spec leaves out, the value at coordinate 0 of that axis (jax
reads a replicated output from one device too: role ``EVEN``); then every block, gathered along the split axes. Its
transpose is a ``Split``: this rank's block of the output's cotangent, over the size of each replicated axis (jax
splits the cotangent of a replicated output evenly across its copies, so an output that in fact varies gets jax's
gradient; in double backward, that split's transpose is the mean over the axis).
Every rank holds the global output, and its cotangent counts once over the mesh: this is jax's transposition with
``check_vma=False``, where ``psum`` transposes to ``psum``.

With ``local=True`` nothing is cut or assembled, but the gradients are the same: along an axis the spec leaves out,
an argument enters through a ``Split(COPY)`` (its gradient summed over the axis, as a replicated global input's) and
an output leaves through a ``Join(ONCE)`` (each rank its cotangent over the axis size, so the ranks' copies of one
replicated value count once).
"""

import functools
import itertools
import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..errors import CmapError
from ..nesting import gradients_tracked
from ..torch_internals import current_level, outside_transforms
from ..wire.exchange import CallTag, JoinSpec, SplitSpec, join, requires_grad, split
from ..wire.link import FUSE_BYTES, Link
from ..wire.payload import costs_little
from ..wire.roles import COPY, EVEN, FIRST, ONCE, Rows, is_rows, tensor_split_sizes
from ..wire.rounds import Kind
from .specs import OffGrid, Placement, Step

WHOLE = ("the whole mesh",)  # the step key of a cut over the whole mesh's group (no axis name is a tuple)


def cut(
    values: Sequence[Any],
    places: Sequence[Placement],
    links: Dict[str, Link],
    view: Any,
    tag: CallTag,
    whole: Link,
) -> List[Any]:
    """Each global value's block on this rank (the tag marks the entry, as a cmap call's). A value split along one
    dim over every axis of a mesh of several, in mesh order, is cut by one ``Split`` over the whole mesh's group
    where that group holds the ranks row-major (the same blocks): its transpose, in backward, is one gather, not one
    per axis. So is a value split over every axis otherwise, into tiles of one shape, whose gradient is wanted: it is
    copied into tile order first (:meth:`Tiles.stack`), so that its backward is one gather, not one per axis."""
    tiles = [_tiles_to_stack(v, p, view) for v, p in zip(values, places)]
    values = [v if t is None else t.stack(v) for v, t in zip(values, tiles)]
    steps = [
        [Step(WHOLE, Rows(0, (1,) * len(view.whole.ranks)))] if t is not None else _cut_steps(v, p, view)
        for v, p, t in zip(values, places, tiles)
    ]
    out = _run(values, steps, _holding_splits({**links, WHOLE: whole}, tag))
    return [v if t is None else v.squeeze(0) for v, t in zip(out, tiles)]


def _holding_splits(links: Dict[str, Link], tag: CallTag) -> Callable[[str, Tuple[Any, ...], List[Any]], Any]:
    """A step's ``Split`` on its axis, tagged as the call's entry; the call holds what it took and gave until the
    guard takes the entries (the tag holds them weakly, and a copy in tile order, a chain's block between two axes
    or a tile before its squeeze is held by nothing else): so the rank's backward is guarded."""

    def apply(axis: str, roles: Tuple[Any, ...], xs: List[Any]) -> Any:
        out = split(SplitSpec(links[axis], roles, tag), xs)
        if current_level() is None:  # where a guard may take them (never a transform's wrappers: torch warns)
            tag.held.extend(t for t in (*xs, *out) if isinstance(t, torch.Tensor))
        return out

    return apply


def _tiles_to_stack(value: Any, place: Placement, view: Any) -> Optional["Tiles"]:
    """The tiles of a global value worth a copy into tile order: its gradient is wanted, the whole mesh's group,
    holding the ranks row-major, does not cut it by one ``Split`` as it is, and it is no larger than a round carries
    (above that, a gather per axis costs about what one does, and the copy would be a second global value alive)."""
    if not isinstance(value, torch.Tensor) or len(view.names) < 2 or not view.row_major():
        return None
    if value.numel() * value.element_size() > FUSE_BYTES:
        return None
    if not (gradients_tracked() and requires_grad(value)) or place.dim_over(view.names) is not None:
        return None
    return Tiles.even_in(place, view, value)


def _cut_steps(value: Any, place: Placement, view: Any) -> List[Step]:
    if not isinstance(value, torch.Tensor):
        return []
    dim = place.dim_over(view.names) if len(view.names) > 1 and view.row_major() else None
    if dim is not None:
        return [Step(WHOLE, Rows(dim, tensor_split_sizes(value.shape[dim], len(view.whole.ranks))))]
    copies = _copied_rows(value, place, view)
    if copies is not None:
        return [Step(WHOLE, copies)]
    return place.cut_steps(value.shape, view.sizes, view.coords)


def _copied_rows(value: torch.Tensor, place: Placement, view: Any) -> Optional[Rows]:
    """The rows of a value split along one dim over some axes of a mesh, in mesh order, and invariant along the
    others (with types: no axis is replicated): cut by one ``Split`` over the whole mesh's group, each rank holding
    a copy of the block at coordinate 0 of the other axes (:class:`~colossalai_cmap.wire.roles.Rows`' ``source``).
    Its transpose is one gather over the whole mesh, the ranks at coordinate 0 sending their rows (in whole-group
    order, the split axes' order, row-major) and the others none, as the exit gathers :class:`Copies`: one round,
    where a gather along the split axes leaves ranks that share no group with a failing rank (so the guard ends it
    with a round over the whole mesh). Only while the others' empty slots in that gather cost little
    (:func:`~colossalai_cmap.wire.payload.costs_little`): small blocks, or few copies."""
    if len(view.names) < 2 or place.replicated or len(place.split) != 1 or not view.row_major():
        return None
    dim, axes = place.split[0]
    others = [a for a in view.names if a not in axes]
    if not others or list(axes) != [a for a in view.names if a in axes]:
        return None
    shape = tuple(view.sizes[a] for a in view.names)
    blocks = tensor_split_sizes(value.shape[dim], math.prod(view.sizes[a] for a in axes))
    slot = max(blocks) * (value.numel() // max(value.shape[dim], 1)) * value.element_size()  # one rank's rows' bytes
    if not costs_little((math.prod(shape) - 1) * slot, (len(blocks) - 1) * slot):  # the copies' empty slots
        return None
    sizes, source = _copies_layout(shape, tuple(a in axes for a in view.names), blocks)
    return Rows(dim, sizes, source)


@functools.lru_cache(maxsize=256)  # a steady loop cuts the same values
def _copies_layout(
    shape: Tuple[int, ...], split: Tuple[bool, ...], blocks: Tuple[int, ...]
) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """For each rank of a mesh of ``shape`` in row-major order (the whole group's, :meth:`MeshView.row_major`): the
    rows it sends (its block of ``blocks``, numbered over the ``split`` axes, at coordinate 0 of the others; else
    none), and the rank whose block it holds (the one at coordinate 0 of the other axes beside it)."""
    sizes, source = [], []
    for coords in itertools.product(*(range(n) for n in shape)):
        index = held = 0
        for c, n, s in zip(coords, shape, split):
            index = index * n + c if s else index
            held = held * n + (c if s else 0)
        sizes.append(blocks[index] if all(c == 0 for c, s in zip(coords, split) if not s) else 0)
        source.append(held)
    return tuple(sizes), tuple(source)


def cut_local(values: Sequence[Any], places: Sequence[Placement], links: Dict[str, Link], tag: CallTag) -> List[Any]:
    """``local=True``: each block as given, through a ``Split(COPY)`` on every axis its spec leaves out (no
    communication; backward sums the gradient over those axes)."""
    steps = [
        [Step(a, COPY) for a in p.replicated] if isinstance(v, torch.Tensor) else [] for v, p in zip(values, places)
    ]
    return _run(list(values), steps, _holding_splits(links, tag))


def assemble_local(values: Sequence[Any], places: Sequence[Placement], links: Dict[str, Link], what: str) -> List[Any]:
    """``local=True``: each output block as it is, through a ``Join(ONCE)`` on every axis its spec leaves out (no
    communication; backward gives each rank its cotangent over the axis size, so the replicated value counts once)."""
    steps = [
        [Step(a, ONCE) for a in p.replicated] if isinstance(v, torch.Tensor) else [] for v, p in zip(values, places)
    ]
    return _run(list(values), steps, lambda axis, roles, xs: join(JoinSpec(links[axis], roles, what, Kind.SYNC), xs))


class Tiles(NamedTuple):
    """How to assemble an output split over every mesh axis, along several dims or along one in another order than
    the mesh's, from one gather over the whole mesh's group: each rank sends its block as one flat run, the runs
    come back in group-rank order (row-major over the mesh), and one permutation puts every block in its place.
    This holds where every rank's block has this rank's shape; the exit's round checks that first.

    Attributes:
        mesh: the mesh's axis sizes, in mesh order.
        block: this rank's block shape.
        order: the permutation of the gathered ``(*mesh, *block)`` that puts each dim's axes (major first) before it.
        shape: the global shape.
    """

    mesh: Tuple[int, ...]
    block: Tuple[int, ...]
    order: Tuple[int, ...]
    shape: Tuple[int, ...]

    @staticmethod
    def of(place: Placement, view: Any, block: Sequence[int]) -> Optional["Tiles"]:
        """The tiles of blocks of shape ``block``, where ``place`` splits them over every axis of ``view`` and
        replicates them over none; else None."""
        split = dict(place.split)
        if place.replicated or sorted(a for axes in split.values() for a in axes) != sorted(view.names):
            return None
        at = {a: k for k, a in enumerate(view.names)}
        order = [k for d in range(len(block)) for k in [at[a] for a in split.get(d, ())] + [len(at) + d]]
        shape = [n * math.prod(view.sizes[a] for a in split.get(d, ())) for d, n in enumerate(block)]
        return Tiles(tuple(view.sizes[a] for a in view.names), tuple(block), tuple(order), tuple(shape))

    @staticmethod
    def even_in(place: Placement, view: Any, value: torch.Tensor) -> Optional["Tiles"]:
        """The tiles of global ``value`` cut as ``place`` says, where each is the same shape (every split dim
        divides by its axes' sizes); else None."""
        split = dict(place.split)
        ways = [math.prod(view.sizes[a] for a in split.get(d, ())) for d in range(value.dim())]
        if any(n % k for n, k in zip(value.shape, ways)):
            return None
        return Tiles.of(place, view, tuple(n // k for n, k in zip(value.shape, ways)))

    def assemble(self, gathered: torch.Tensor) -> torch.Tensor:
        """The global value from every rank's flat run, gathered in group-rank order (differentiable)."""
        return gathered.view(*self.mesh, *self.block).permute(self.order).reshape(self.shape)

    def stack(self, value: torch.Tensor) -> torch.Tensor:
        """:meth:`assemble`'s inverse: global ``value`` as ``[P, *block]``, rank r's tile at r (a copy, differentiable:
        its backward is :meth:`assemble`'s permutation)."""
        inverse = sorted(range(len(self.order)), key=self.order.__getitem__)
        permuted = [self.mesh[k] if k < len(self.mesh) else self.block[k - len(self.mesh)] for k in self.order]
        return value.reshape(permuted).permute(inverse).reshape(math.prod(self.mesh), *self.block)


class Copies(NamedTuple):
    """An output of a mesh of two axes split along ``dim`` over ``axis`` and equal along ``over`` (replicated there,
    or invariant with types): the exit's round over the whole mesh gathers it from the ranks at coordinate 0 of
    ``over``, which the whole mesh's group holds in ``axis`` order (row-major); the others send no rows.
    ``replicated``: untyped, the assembly takes the value at coordinate 0 of ``over`` (with types there is no step
    along it)."""

    dim: int
    axis: str
    over: str
    replicated: bool

    @staticmethod
    def of(place: Placement, view: Any) -> Optional["Copies"]:
        """The copies of an output ``place`` splits along one dim over one axis of a two-axis ``view``; else None."""
        if len(view.names) != 2 or len(place.split) != 1 or len(place.split[0][1]) != 1:
            return None
        (dim, (axis,)), (over,) = place.split[0], [a for a in view.names if a != place.split[0][1][0]]
        return Copies(dim, axis, over, over in place.replicated) if set(place.replicated) <= {over} else None

    def sends(self, view: Any) -> bool:
        """Whether this rank's block travels: it is the copy at coordinate 0."""
        return view.coords[self.over] == 0

    def differ(self, shapes: Sequence[int], view: Any) -> bool:
        """Whether some rank's ``shapes`` (each rank's, in whole-group order) differ from those of the copy at
        coordinate 0 of ``over`` beside it: the copies along ``over`` are one value, of one shape."""
        grid = [
            {self.axis: j, self.over: k} for j in range(view.sizes[self.axis]) for k in range(view.sizes[self.over])
        ]
        return any(shapes[view.whole_rank(c)] != shapes[view.whole_rank({**c, self.over: 0})] for c in grid)

    def assemble(
        self,
        block: torch.Tensor,
        gathered: torch.Tensor,
        rows: Sequence[int],
        *,
        links: Dict[str, Link],
        view: Any,
        what: str,
    ) -> torch.Tensor:
        """The global value the exit's round gathered (``rows``: every rank's rows sent, in whole-group order), through
        the Joins :func:`assemble` would run, their results given: nothing moves, and backward and forward-mode AD
        are :func:`assemble`'s."""
        chunks = tuple(rows[view.whole_rank({self.axis: j, self.over: 0})] for j in range(view.sizes[self.axis]))
        value = block
        if self.replicated:  # the value at coordinate 0 of the copies' axis
            j = view.coords[self.axis]
            mine = gathered.narrow(self.dim, sum(chunks[:j]), chunks[j]).clone()
            (value,) = join(JoinSpec(links[self.over], (EVEN,), what, Kind.SYNC, known=(mine,)), [value])
        spec = JoinSpec(links[self.axis], (Rows(self.dim, chunks),), what, Kind.SYNC, known=(gathered,))
        (value,) = join(spec, [value])
        return value


def block_lengths(values: Sequence[Any], places: Sequence[Placement]) -> Optional[torch.Tensor]:
    """This rank's block length along every split dim of every output, as one row ``[1, k]`` on the host (None:
    nothing is split). Blocks need not be equal, so every rank's row travels in the exit's round over the whole
    mesh, as host-side metadata."""
    lengths = [v.shape[d] for v, p in zip(values, places) if isinstance(v, torch.Tensor) for d, _ in p.split]
    if not lengths:
        return None
    with outside_transforms():  # plain ints, whatever function transform is around the call
        return torch.tensor([lengths], dtype=torch.int64)


def assemble(
    values: Sequence[Any], places: Sequence[Placement], links: Dict[str, Link], view: Any, table: Any, what: str
) -> list:
    """Each block assembled into its global value, on every rank. ``table`` holds every rank's
    :func:`block_lengths` row, in the whole mesh's group-rank order."""
    keys = [(i, d) for i, (v, p) in enumerate(zip(values, places)) if isinstance(v, torch.Tensor) for d, _ in p.split]
    column = {key: k for k, key in enumerate(keys)}

    def length(i: int) -> Any:
        return lambda coords, d: table[view.whole_rank(coords)][column[(i, d)]]

    for i, (v, p) in enumerate(zip(values, places)):  # every rank read the same table: every rank raises alike
        found = p.off_grid(view.sizes, length(i)) if isinstance(v, torch.Tensor) else None
        if found is not None:
            raise _blocks_off_grid(what, p, view, length(i), found)
    steps = [
        p.assemble_steps(view.sizes, view.coords, length(i)) if isinstance(v, torch.Tensor) else []
        for i, (v, p) in enumerate(zip(values, places))
    ]

    def apply(axis: str, roles: Sequence[Any], xs: List[Any]) -> List[Any]:
        return join(JoinSpec(links[axis], tuple(EVEN if r == FIRST else r for r in roles), what, Kind.SYNC), xs)

    return _run(list(values), steps, apply)


def _blocks_off_grid(what: str, place: Placement, view: Any, length: Any, found: OffGrid) -> CmapError:
    """Blocks whose lengths along a split dim differ where only axes that do not split it differ: axes that split
    other dims, or axes along which the blocks are copies of one value."""
    dim, axes = found.dim, dict(place.split)[found.dim]

    def rank(coords: dict) -> str:
        shown = ", ".join(f"{a}={coords[a]}" for a in view.names if a in coords)
        return f"group rank {view.whole_rank(coords)} ({shown}) has {length(coords, dim)}"

    return CmapError(
        f"{what}: the blocks of the output at out_specs{place.path} ({place.spec!r}) do not tile "
        f"one global value: along dim {dim}, split over {{{', '.join(axes)}}}, {rank(found.first)} and "
        f"{rank(found.at)}. A block's length along a split dim may differ only with the axes that split that dim; "
        f"make every rank's block along dim {dim} the same length where those coordinates are the same."
    )


def _run(values: List[Any], steps: List[List[Step]], apply: Any) -> List[Any]:
    """Every leaf's steps, in order per leaf: one primitive per axis for all leaves whose next step is on it, and
    whose blocks along it have the same lengths (an exchange carries one row count per rank: a batch's blocks
    and a weight's columns make two)."""
    pending = [list(s) for s in steps]
    while any(pending):
        axis = next(s[0].axis for s in pending if s)
        lengths = next((_lengths_of(s[0]) for s in pending if s and s[0].axis == axis and _lengths_of(s[0])), None)
        picked = [i for i, s in enumerate(pending) if s and s[0].axis == axis and _lengths_of(s[0]) in (None, lengths)]
        roles = tuple(pending[i][0].role for i in picked)
        out = apply(axis, roles, [values[i] for i in picked])
        for i, v in zip(picked, out):
            values[i] = v
            pending[i].pop(0)
    return values


def _lengths_of(step: Step) -> Any:
    """Every rank's block length along the step's axis (and whose copy each rank holds); None for a value that is
    not split along it."""
    return (step.role.sizes, step.role.source) if is_rows(step.role) else None
