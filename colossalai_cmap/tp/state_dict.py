"""Checkpoints of a model sharded with ``shard_model(model, plan=...)``: its full state dict, gathered, and a full
state dict loaded into it.

The sharded layers keep their parameters' names, so a sharded model's ``state_dict()`` has the unsharded model's
keys, each rank's holding its slices. :func:`full_state_dict` gathers the slices into the unsharded tensors (one
exchange per group of equally split tensors); :func:`load_full_state_dict` takes this rank's slices of a full state
dict, so a checkpoint saved from the unsharded model, or from a sharded one at any group size, loads at any other.
"""

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ..wire.comm import default_timeout
from ..wire.exchange import JoinSpec, join_values
from ..wire.group import Group
from ..wire.link import link_for
from ..wire.roles import Rows
from .layers import CALL, PARALLEL_LAYERS, Slice

__all__ = ["full_state_dict", "load_full_state_dict", "sharded_parameters"]


def sharded_parameters(model: nn.Module) -> Dict[str, Slice]:
    """How each tensor-parallel parameter of ``model`` is split, by its name in ``model.state_dict()``: a
    :class:`~colossalai_cmap.tp.layers.Slice` each, whose ``take(full)`` cuts this rank's slice out of a full tensor.

    Parameters that every rank holds whole (unsharded modules, a row-parallel layer's bias) are not listed.

    Example:
        >>> name = "model.layers.0.mlp.up_proj.weight"
        >>> piece = sharded_parameters(sharded)[name]
        >>> torch.testing.assert_close(sharded.get_parameter(name).grad, piece.take(full_model_weight.grad))
    """
    found: Dict[str, Slice] = {}
    for path, module in model.named_modules():
        if isinstance(module, PARALLEL_LAYERS):
            for name, piece in module.slices().items():
                found[f"{path}.{name}" if path else name] = piece
    return found


def full_state_dict(model: nn.Module, dst: int = -1) -> Optional[Dict[str, torch.Tensor]]:
    """The unsharded state dict of a tensor-parallel model, gathered over its group.

    Every rank of the group must call it. RegionInputs of unsharded modules are this rank's own (the same on every rank).

    Args:
        model: a model sharded with ``shard_model(model, plan=...)`` (or one with no sharded layer).
        dst: -1: every rank gets the full state dict; ``r``: only group rank ``r`` does, and the others get None.

    Returns:
        The state dict, with the keys and shapes of the unsharded model's, or None off ``dst``.
    """
    group = _group_of(model)
    state = model.state_dict()
    if group is None or group.size == 1:
        return state
    if not (isinstance(dst, int) and -1 <= dst < group.size):
        raise ValueError(f"full_state_dict: dst must be -1 or a group rank below {group.size}, got {dst!r}.")
    slices = sharded_parameters(model)
    batches: Dict[Tuple[Tuple[int, ...], torch.device], List[str]] = {}
    for name, piece in slices.items():  # one exchange per split and device: Join's rows share their counts
        batches.setdefault((piece.sizes, state[name].device), []).append(name)
    with torch.no_grad():
        for (sizes, device), names in batches.items():
            roles = tuple(Rows(slices[n].dim, sizes) for n in names)
            spec = JoinSpec(
                link_for(group, device, "full_state_dict", default_timeout()), roles, "the full state dict", dst=dst
            )
            for name, full in zip(names, join_values(spec, [state[n] for n in names])):
                state[name] = slices[name].assemble(full) if full is not None else full
    return state if dst in (-1, group.rank) else None


def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True) -> Any:
    """Load an unsharded state dict into a tensor-parallel model: each rank copies in its slices.

    No communication: every rank must hold the full state dict (for example ``torch.load`` of one file).

    Args:
        model: a model sharded with ``shard_model(model, plan=...)``.
        state: the unsharded model's state dict (for example from :func:`full_state_dict`).
        strict: as for ``nn.Module.load_state_dict``.

    Returns:
        ``load_state_dict``'s result: the missing and unexpected keys.

    Raises:
        ValueError: an entry of a sharded parameter does not have the unsharded shape.
    """
    local = dict(state)
    for name, piece in sharded_parameters(model).items():
        if name not in local:
            continue
        full = local[name]
        if tuple(full.shape) != piece.full_shape:
            raise ValueError(
                f"load_full_state_dict: {name!r} has shape {tuple(full.shape)}, but the sharded parameter is a slice "
                f"of shape {piece.full_shape}; pass the unsharded state dict."
            )
        local[name] = piece.take(full)
    return model.load_state_dict(local, strict=strict)


def _group_of(model: nn.Module) -> Optional[Group]:
    groups = {id(m.group.pg): m.group for m in model.modules() if isinstance(m, PARALLEL_LAYERS)}
    if len(groups) > 1:
        raise ValueError(
            f"{CALL}: the model's tensor-parallel layers are sharded over {len(groups)} different groups; gather "
            f"each sharded submodule separately."
        )
    return next(iter(groups.values()), None)
