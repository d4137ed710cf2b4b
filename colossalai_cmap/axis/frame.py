"""The named axes now mapped: one :class:`AxisFrame` per active ``axis_name``, innermost last, where the
collectives inside func find their group, sizes and indices."""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch

from ..torch_internals import backward_running
from ..wire.link import Link
from .modes import AxisMode


class ExampleLoop(Protocol):
    """Loop mode's example threads, as the collectives see them (the call package runs the threads)."""

    def index(self) -> torch.Tensor:
        """The global index of the example whose thread calls."""

    def run(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A collective: every example's ``x`` stacked, ``fn`` once on the stack, each example gets the result."""


class Joint(NamedTuple):
    """Mesh axes taken together as one group (a tuple axis name), where its ops take their native collective.

    Attributes:
        link: the group of the ranks that differ from this one along those axes only.
        index: this rank's index along the axes taken together, the first name major.
        ranks: the group rank of the member at each index (the group's ranks are in global-rank order, which need
            not be the index order: ``("y", "x")``).
        mesh: the mesh the axes belong to, where sub-groups of the joint group are found (``axis_index_groups``).
    """

    link: Link
    index: int
    ranks: Tuple[int, ...]
    mesh: Optional["MeshAxes"] = None


class MeshAxes(Protocol):
    """The mesh of a ``shard_map`` as its axes' frames see it (the shard layer makes it)."""

    def joint(self, names: Tuple[str, ...]) -> Joint:
        """The group of these axes of the mesh taken together (made on first use, by its members alone)."""

    def group(self, ranks: Tuple[int, ...]) -> Link:
        """The link over these global ranks of the mesh: the whole mesh's group or an axis's where it holds just
        them, else one made once for them (by its members alone)."""


@dataclass
class AxisFrame:
    """One active ``axis_name``: where its collectives go, the axis's size, and this rank's rows in it.

    A cmap axis runs over the examples of the global batch; a ``shard_map`` mesh axis (mode "rank") over the ranks
    of one mesh dimension, each holding one row: its own block.

    Attributes:
        link: the group (None when the map runs in this process alone), device, call name and timeout.
        size: the global batch size B, or the mesh dimension's size.
        offset: the first global index of this rank's rows (its mesh coordinate).
        sizes: every rank's row count (all 1 along a mesh axis).
        mode: the cmap's mode, or :data:`~.modes.RANK` for a mesh axis (what the collectives ask of it).
        dummy: the shard is empty, and its one stand-in example contributes nothing to collectives.
        index: each example's global index, set while func runs (``axis_index``).
        level: the functorch level of this map's ``torch.vmap`` (mode "vmap"), set while func runs.
        loop: the barrier of loop-mode example threads.
        mesh: for a mesh axis, the mesh it belongs to, which gives the group of several of its axes together.
        members: the group rank holding each index, where indices do not follow rank order (mesh axes of a tuple
            name taken together: ``Joint.ranks``, each rank one index); None: consecutive, in rank order.
    """

    link: Optional[Link]
    size: int
    offset: int
    sizes: Sequence[int]
    mode: AxisMode
    dummy: bool = False
    index: Any = None
    level: Optional[int] = None
    loop: Optional[ExampleLoop] = field(default=None, repr=False)
    mesh: Optional[MeshAxes] = field(default=None, repr=False)
    members: Optional[Tuple[int, ...]] = None

    @property
    def device(self) -> torch.device:
        return self.link.device if self.link is not None else torch.device("cpu")


_FRAMES: Dict[str, List[AxisFrame]] = {}
# The frame of the last map that finished, per name: a backward that recomputes part of func (torch.utils.checkpoint
# inside func, as jax's remat) runs after the call returned, and its collectives must still find their axis.
_FINISHED: Dict[str, AxisFrame] = {}


def active() -> bool:
    """Whether any named axis is mapped now (a cmap or shard_map is running func)."""
    return bool(_FRAMES)


def push(name: str, frame: AxisFrame) -> None:
    """Open ``frame`` as the innermost of ``name``. A plain push and :func:`pop` (no generator) is what dynamo
    traces, so a compiled call opens its frame this way, in a ``try``/``finally``."""
    _FRAMES.setdefault(name, []).append(frame)


def pop(name: str, finished: bool = True) -> AxisFrame:
    """Close the innermost frame of ``name``; with ``finished``, keep it for a backward that recomputes func (a
    compiled call does not: its backward is in the graph, and dynamo would have to rebuild the frame)."""
    stack = _FRAMES[name]
    frame = stack.pop()
    if finished:
        _FINISHED[name] = frame
    if not stack:
        del _FRAMES[name]
    return frame


@contextlib.contextmanager
def axis_scope(name: Optional[str], frame: Optional[AxisFrame]) -> Iterator[None]:
    if name is None or frame is None:
        yield
        return
    push(name, frame)
    try:
        yield
    finally:
        pop(name)


def lookup(name: str, op: str) -> AxisFrame:
    """The innermost active frame of ``name``; inside a backward, the last finished one (its recomputation)."""
    stack = _FRAMES.get(name)
    if not stack and name in _FINISHED and backward_running():
        return _FINISHED[name]
    if not stack:
        active = sorted(_FRAMES)
        hint = f"active axis names: {active}" if active else "no cmap with an axis_name or shard_map is running"
        raise NameError(
            f"{op}(..., {name!r}): unbound axis name {name!r}; {hint}. Pass axis_name={name!r} to cmap, or use a "
            f"shard_map whose mesh has an axis named {name!r} (among its axis_names, if it names any). (jax: Found an "
            f"unbound axis name: {name}.)"
        )
    return stack[-1]


def joint_of(names: Sequence[str], op: str) -> Optional[Joint]:
    """The group of several mesh axes taken together (the first name major), where they are axes of one
    ``shard_map`` call's mesh; None otherwise (cmap axes, axes of different calls, one name, inside torch.compile)."""
    if len(names) < 2 or torch.compiler.is_compiling():
        return None
    frames = [lookup(name, op) for name in names]
    mesh = frames[0].mesh
    if mesh is None or any(not f.mode.per_rank or f.mesh is not mesh for f in frames):
        return None
    return mesh.joint(tuple(names))


# ------------------------------------------------------------- where a collective over named axes runs, and how
def names_of(axis_name: Any) -> Tuple[str, ...]:
    """The names of an axis name or a tuple of them."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def size_of(axis_name: Any) -> int:
    """The product of the named axes' sizes."""
    size = 1
    for name in names_of(axis_name):
        size *= lookup(name, "axis_size").size
    return size


def native_over(axis_name: Any) -> bool:
    """Whether the per-example ops take their native collective: over one axis name, eagerly, in a mode where each
    run holds its rows (vmap, batched, or a shard_map axis). Otherwise they are a psum or an all_gather and a
    selection (loop mode, tuple names, inside torch.compile)."""
    names = names_of(axis_name)
    if len(names) != 1 or torch.compiler.is_compiling():
        return False
    return lookup(names[0], "collective").mode.native


def joint_over(axis_name: Any, length: int = 1) -> Optional[Joint]:
    """Where a per-example op over ``shard_map`` mesh axes that ``native_over`` leaves out (a tuple of axes, uneven
    tiled chunks) still takes its native collective: the group of the axes taken together, with this rank's index in it.
    None (the op is a psum or an all_gather and a selection): inside torch.compile, off mesh axes, axes of different
    calls (a ``smap`` inside a ``shard_map``), or nothing to split (``length`` 0)."""
    names = names_of(axis_name)
    if torch.compiler.is_compiling() or not length or not on_ranks(axis_name):
        return None
    if len(names) == 1:
        frame = lookup(names[0], "collective")
        return Joint(frame.link, frame.offset, tuple(range(frame.size)), frame.mesh)
    return joint_of(names, "collective")


def on_ranks(axis_name: Any) -> bool:
    """Every name is a ``shard_map`` mesh axis, whose members are ranks."""
    return all(lookup(name, "collective").mode.per_rank for name in names_of(axis_name))


def own_chunk(axis_name: Any, length: int) -> Tuple[int, int]:
    """This rank's ``torch.tensor_split`` chunk of ``length`` over mesh axes: its start and length, as Python ints
    (from the mesh coordinates, not ``axis_index``: no device read)."""
    coord = 0
    for name in names_of(axis_name):  # the first name major, as axis_index
        frame = lookup(name, "collective")
        coord = coord * frame.size + frame.offset
    base, extra = divmod(length, size_of(axis_name))
    return coord * base + min(coord, extra), base + (1 if coord < extra else 0)
