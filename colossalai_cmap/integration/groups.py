"""``group=`` to a :class:`~colossalai_cmap.wire.group.Group`: None, a ProcessGroup, a mesh axis, or a booster; and
the device a call's collectives on it use."""

import numbers
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..wire.group import SINGLE, Group, group_of


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
    return group_of(pg)


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
            return SINGLE
        return group_of(dist.group.WORLD)
    if isinstance(group, tuple) and len(group) == 2 and hasattr(group[0], "get_group_along_axis"):
        return _from_mesh(call, group[0], group[1])
    if isinstance(group, dist.ProcessGroup):
        return group_of(group)
    if _is_booster_like(group):
        from .plugins import plugin_group

        return group_of(plugin_group(call, group))
    raise TypeError(
        f"{call}: group={group!r} is not supported; expected None, a torch.distributed ProcessGroup, "
        f"(ProcessGroupMesh, axis), or a colossalai Booster or booster Plugin."
    )


def collective_device(group: Group, values: Sequence[Any]) -> torch.device:
    """The device a call's collectives on ``group`` use: the first tensor's among ``values``, else the backend's
    (the current accelerator on nccl, which refuses CPU tensors; the CPU otherwise)."""
    found = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
    if found is not None:
        return found
    if group.pg is not None and "nccl" in group.backend():
        from colossalai.accelerator import get_accelerator

        return get_accelerator().get_current_device()
    return torch.device("cpu")
