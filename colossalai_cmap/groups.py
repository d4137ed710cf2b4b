"""``group=`` to a process group, with this process's rank and the group size."""

import numbers
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """Where a cmap call runs: ``pg`` is None when running in this one process."""

    pg: Optional[dist.ProcessGroup]
    rank: int
    size: int
    ranks: Tuple[int, ...]  # global rank of each group rank

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    def backend(self) -> str:
        return "none" if self.pg is None else str(dist.get_backend(self.pg))


_SINGLE = Group(None, 0, 1, (0,))


_BY_PG: dict = {}


def _from_pg(pg: dist.ProcessGroup) -> Group:
    cached = _BY_PG.get(id(pg))
    if cached is not None and cached.pg is pg:
        return cached
    ranks = tuple(dist.get_process_group_ranks(pg))
    group = _BY_PG[id(pg)] = Group(pg, dist.get_rank(pg), dist.get_world_size(pg), ranks)
    return group


def _from_mesh(call: str, mesh: Any, axis: Any) -> Group:
    # numbers.Integral also takes numpy ints (ProcessGroupMesh computes with numpy); bool is rejected.
    axes = (axis,) if isinstance(axis, numbers.Integral) else tuple(axis) if isinstance(axis, (tuple, list)) else None
    if axes is None or not all(isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in axes):
        raise TypeError(
            f"{call}: group=(ProcessGroupMesh, axis) needs an int or a tuple of ints as axis, got {axis!r}."
        )
    ndim = len(mesh.shape)
    bad = [a for a in axes if not -ndim <= a < ndim]
    if bad:
        raise ValueError(
            f"{call}: group=(ProcessGroupMesh, {axis!r}): axis {bad[0]} is out of range for a mesh of shape {tuple(mesh.shape)}."
        )
    axes = tuple(sorted(int(a) % ndim for a in axes))
    if not axes or len(set(axes)) != len(axes):
        raise ValueError(f"{call}: group=(ProcessGroupMesh, {axis!r}) needs distinct mesh axes, at least one.")
    # The mesh caches its groups, so repeated calls reuse them instead of creating new ones (a collective).
    pg = mesh.get_group_along_axis(axes[0] if len(axes) == 1 else list(axes))
    return _from_pg(pg)


def _is_booster_like(group: Any) -> bool:
    names = {cls.__name__ for cls in type(group).__mro__}
    return "Booster" in names or "Plugin" in names


def resolve_group(call: str, group: Any) -> Group:
    """Resolve ``group`` to a :class:`Group`.

    Args:
        call: the call's name, for error messages.
        group: None (the world, or this process alone when torch.distributed is not initialised), a ProcessGroup,
            ``(ProcessGroupMesh, axis)``, or a colossalai Booster or booster Plugin (its data-parallel group).
    """
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return _SINGLE
        return _from_pg(dist.group.WORLD)
    if isinstance(group, tuple) and len(group) == 2 and hasattr(group[0], "get_group_along_axis"):
        return _from_mesh(call, group[0], group[1])
    if isinstance(group, dist.ProcessGroup):
        return _from_pg(group)
    if _is_booster_like(group):
        from .plugins import plugin_group

        return _from_pg(plugin_group(call, group))
    raise TypeError(
        f"{call}: group={group!r} is not supported; expected None, a torch.distributed ProcessGroup, "
        f"(ProcessGroupMesh, axis), or a colossalai Booster or booster Plugin."
    )


def group_device(group: Group, fallback: Optional[torch.device] = None) -> torch.device:
    """The device collectives on this group need: the inputs' own device, else the backend's device."""
    if fallback is not None:
        return fallback
    if group.pg is not None and "nccl" in group.backend():
        from colossalai.accelerator import get_accelerator

        return get_accelerator().get_current_device()
    return torch.device("cpu")
