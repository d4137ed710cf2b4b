"""The mesh a ``shard_map`` runs over: its axis names and sizes, this rank's coordinates, and a group per axis.

Accepted: a torch ``DeviceMesh`` with ``mesh_dim_names`` (the ecosystem's named mesh), :class:`Mesh` (colossalai's
``ProcessGroupMesh`` with a name per axis), and a colossalai ``Booster`` or booster plugin that has a mesh. The
groups come from the mesh itself (it creates and caches them); the one group over the whole mesh, where the exit
round runs, is the world when the mesh covers it.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..axis.frame import Joint
from ..integration.plugins import plugin_mesh
from ..torch_internals import outside_transforms
from ..wire.group import Group, group_for, group_of
from ..wire.link import Link, link_for


class Mesh:
    """colossalai's ``ProcessGroupMesh`` with a name per axis, for ``shard_map``.

    Example:
        >>> from colossalai.cluster import ProcessGroupMesh
        >>> mesh = cm.Mesh(ProcessGroupMesh(2, 2), ("x", "y"))
    """

    def __init__(self, pg_mesh: Any, names: Sequence[str]) -> None:
        names = tuple(names)
        shape = tuple(pg_mesh.shape)
        if len(names) != len(shape) or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"Mesh: names {names!r} must be {len(shape)} distinct strings, one per mesh axis.")
        self.pg_mesh, self.axis_names, self.shape = pg_mesh, names, dict(zip(names, shape))

    def __repr__(self) -> str:
        return f"Mesh({', '.join(f'{n}={s}' for n, s in self.shape.items())})"


@dataclass(frozen=True)
class MeshView:
    """A mesh as one rank sees it.

    Attributes:
        names: the axis names, in mesh order.
        sizes: each axis's size.
        coords: this rank's coordinate along each axis (empty off the mesh).
        axes: each axis's group: the ranks that differ from this one along that axis only.
        whole: the group of every rank of the mesh (None off the mesh).
        grid: the global rank at each coordinate, in row-major order.
        within: for the view of one axis of a mesh (a ``smap`` nested in a map over the others), that mesh's view.
    """

    names: Tuple[str, ...]
    sizes: Dict[str, int]
    coords: Dict[str, int]
    axes: Dict[str, Group]
    whole: Optional[Group]
    grid: Tuple[int, ...]
    within: Optional["MeshView"] = None

    @property
    def member(self) -> bool:
        return self.whole is not None

    def whole_rank(self, coords: Dict[str, int]) -> int:
        """The rank in the whole mesh's group of the rank at ``coords``."""
        flat = 0
        for n in self.names:
            flat = flat * self.sizes[n] + coords[n]
        return self.whole.ranks.index(self.grid[flat])

    def row_major(self) -> bool:
        """Whether the whole mesh's group holds the ranks in the mesh's row-major order (the first axis major), as a
        gather over every axis in mesh order does."""
        return tuple(self.whole.ranks) == self.grid

    def describe(self) -> str:
        return f"a mesh of shape {tuple(self.sizes.values())} with axis names {self.names}"


_VIEWS: Dict[int, Tuple[Any, MeshView]] = {}  # id(mesh) -> (mesh, view): the mesh kept alive, so ids are not reused


def resolve_mesh(call: str, mesh: Any) -> MeshView:
    """This rank's view of ``mesh``, made on first use (collectively, on the mesh's ranks) and kept."""
    if isinstance(mesh, MeshView):  # one axis of a mesh, as a nested smap runs over it
        return mesh
    found = _VIEWS.get(id(mesh))
    if found is not None and found[0] is mesh:
        return found[1]
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{call}: shard_map needs torch.distributed initialised (colossalai.launch_from_torch()).")
    with outside_transforms():  # the mesh's own tensors, read on the host, even under torch.func transforms
        view = _resolve(call, mesh)
    _VIEWS[id(mesh)] = (mesh, view)
    return view


def _resolve(call: str, mesh: Any) -> MeshView:
    if isinstance(mesh, Mesh):
        return _from_pg_mesh(mesh.pg_mesh, mesh.axis_names)
    if type(mesh).__name__ == "DeviceMesh":
        return _from_device_mesh(call, mesh)
    found = plugin_mesh(mesh)
    if found is not None:
        return _from_pg_mesh(*found)
    raise TypeError(
        f"{call}: mesh={mesh!r} is not supported; expected a torch DeviceMesh with mesh_dim_names, "
        f"colossalai_cmap.Mesh(ProcessGroupMesh, names), or a colossalai Booster or HybridParallel/Gemini plugin."
    )


def _from_device_mesh(call: str, mesh: Any) -> MeshView:
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(
            f"{call}: the DeviceMesh has no mesh_dim_names; shard_map's specs name its axes, so create it with "
            f"init_device_mesh(device_type, shape, mesh_dim_names=(...))."
        )
    sizes = dict(zip(names, mesh.mesh.shape))
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not on the mesh: it takes no part
        return MeshView(tuple(names), sizes, {}, {}, None, ())
    axes = {n: group_of(mesh.get_group(n)) for n in names}
    grid = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    return MeshView(tuple(names), sizes, dict(zip(names, coordinate)), axes, _whole(axes, tuple(sorted(grid))), grid)


def _from_pg_mesh(pg_mesh: Any, names: Sequence[str]) -> MeshView:
    shape = tuple(int(s) for s in pg_mesh.shape)
    coords = tuple(int(c) for c in pg_mesh.coordinate())
    axes = {n: group_of(pg_mesh.get_group_along_axis(i)) for i, n in enumerate(names)}
    if len(names) == 1:
        whole = next(iter(axes.values()))
    else:
        whole = group_of(pg_mesh.get_group_along_axis(list(range(len(names)))))
    grid = tuple(range(math.prod(shape)))  # a ProcessGroupMesh spans the world, its ranks in row-major order
    return MeshView(tuple(names), dict(zip(names, shape)), dict(zip(names, coords)), axes, whole, grid)


def _whole(axes: Dict[str, Group], ranks: Tuple[int, ...]) -> Group:
    """The group of the whole mesh: its one axis's group, the world, or a group made once on the mesh's ranks."""
    if len(axes) == 1:
        return next(iter(axes.values()))
    if len(ranks) == dist.get_world_size():
        return group_of(dist.group.WORLD)
    return group_for(ranks)  # only the mesh's ranks take part in making it


def mesh_size(view: MeshView) -> int:
    return math.prod(view.sizes.values())


def manual_ranks(view: MeshView, manual: Sequence[str]) -> Tuple[int, ...]:
    """The global ranks that differ from this one along the ``manual`` axes only: they hold different blocks, while
    ranks that differ along the others compute alike."""
    others = [n for n in view.names if n not in manual]
    out = []
    for flat, rank in enumerate(view.grid):
        coords, rest = {}, flat
        for n in reversed(view.names):
            rest, coords[n] = divmod(rest, view.sizes[n])
        if all(coords[n] == view.coords[n] for n in others):
            out.append(rank)
    return tuple(sorted(out))


def joint_ranks(view: MeshView, names: Sequence[str]) -> Tuple[int, ...]:
    """The global rank at each index along ``names`` taken together (the first name major), the other axes at this
    rank's coordinates."""
    out = []
    for index in range(math.prod(view.sizes[n] for n in names)):
        coords, rest = dict(view.coords), index
        for n in reversed(names):
            rest, coords[n] = divmod(rest, view.sizes[n])
        flat = 0
        for n in view.names:
            flat = flat * view.sizes[n] + coords[n]
        out.append(view.grid[flat])
    return tuple(out)


def group_over(view: MeshView, ranks: Sequence[int]) -> Group:
    """The group of these global ranks of the mesh: the whole mesh's or an axis's where it holds them (axes of size
    one taken with another), else one made once (by its members alone). A guarded backward's failure reaches a peer
    waiting in a round on the whole mesh's group or an axis's (:func:`~colossalai_cmap.wire.rounds.fan_out`)."""
    key = tuple(sorted(ranks))
    for group in (view.whole, *view.axes.values()):
        if key == tuple(sorted(group.ranks)):
            return group
    return group_for(key)


@dataclass(frozen=True)
class MeshJoints:
    """A call's mesh as its axes' frames see it (:class:`~colossalai_cmap.axis.frame.MeshAxes`): the group of
    several axes taken together, on the call's device, with its name and timeout."""

    view: MeshView
    device: torch.device
    call: str
    timeout: Optional[float]

    def joint(self, names: Tuple[str, ...]) -> Joint:
        ranks = joint_ranks(self.view, names)
        group = group_over(self.view, ranks)
        index = ranks.index(group.global_rank)
        return Joint(
            link_for(group, self.device, self.call, self.timeout),
            index,
            tuple(group.ranks.index(r) for r in ranks),
            self,
        )

    def group(self, ranks: Tuple[int, ...]) -> Link:
        return link_for(group_over(self.view, ranks), self.device, self.call, self.timeout)


_AXIS_VIEWS: Dict[Tuple[int, str], Tuple[MeshView, MeshView]] = {}


def axis_view(view: MeshView, name: str) -> MeshView:
    """One axis of ``view`` as a mesh of its own (its group the whole), for a map over that axis alone nested in a
    map over the others: the ranks along it are this rank's peers that differ from it along ``name`` only."""
    found = _AXIS_VIEWS.get((id(view), name))
    if found is not None and found[0] is view:
        return found[1]
    grid = []
    for j in range(view.sizes[name]):
        flat = 0
        for n in view.names:
            flat = flat * view.sizes[n] + (j if n == name else view.coords[n])
        grid.append(view.grid[flat])
    group = view.axes[name]
    sub = MeshView(
        (name,), {name: view.sizes[name]}, {name: view.coords[name]}, {name: group}, group, tuple(grid), view
    )
    _AXIS_VIEWS[(id(view), name)] = (view, sub)
    return sub


# ------------------------------------------------------------------------------------------- the mesh in context
class InContext(NamedTuple):
    """The mesh a ``smap`` maps over: the whole mesh's view (None: not resolved yet), the mesh object as given, and
    the axes already manual here (those of the ``shard_map`` and ``smap`` calls now running ``f``)."""

    view: Optional[MeshView]
    mesh: Any
    manual: FrozenSet[str]


_SET: List[Any] = []  # the meshes set by set_mesh, innermost last
_RUNNING: List[InContext] = []  # the shard_map and smap calls now running f, innermost last


class set_mesh:  # noqa: N801 (jax's name: a setter that is also a context manager)
    """jax's ``set_mesh``: the mesh a ``smap`` outside any ``shard_map`` maps over.

    As a call it sets the mesh for the process; as a context manager (``with cm.set_mesh(mesh): ...``) for the block
    only. ``mesh`` is any mesh ``shard_map`` accepts, or None to clear it.
    """

    def __init__(self, mesh: Any) -> None:
        self.previous = list(_SET)
        _SET[:] = [mesh] if mesh is not None else []

    def __enter__(self) -> Any:
        return _SET[-1] if _SET else None

    def __exit__(self, *exc: Any) -> None:
        _SET[:] = self.previous


def in_context() -> Optional[InContext]:
    """The mesh in context: the innermost ``shard_map`` running ``f`` (with its manual axes), else the mesh of
    :class:`set_mesh` (none manual), else None."""
    if _RUNNING:
        return _RUNNING[-1]
    if _SET:
        return InContext(None, _SET[-1], frozenset())
    return None


@contextlib.contextmanager
def running(view: MeshView, manual: Sequence[str]) -> Iterator[None]:
    """While the block runs, ``f`` of a map over ``manual`` of ``view`` runs: a ``smap`` inside maps over the mesh
    (the whole one, for the view of one of its axes), with these axes and those of the maps around it manual."""
    root = view.within or view
    outer = _RUNNING[-1].manual if _RUNNING and _RUNNING[-1].view is root else frozenset()
    _RUNNING.append(InContext(root, root, outer | frozenset(manual)))
    try:
        yield
    finally:
        _RUNNING.pop()
