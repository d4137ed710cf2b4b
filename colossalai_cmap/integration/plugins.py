"""``group=booster`` or ``group=plugin``: the data-parallel group of a colossalai booster plugin.

cmap splits the batch over the ranks that hold *different data* under the plugin, which is exactly the set of ranks
the plugin's own ``prepare_dataloader`` shards a dataset over. Ranks that hold the same data (tensor- or
pipeline-parallel peers of one replica) get the same shard, so collectives inside ``func`` over their tp group match.

Nothing here imports ``colossalai.booster`` (it pulls in transformers and peft, seconds of start-up): the plugin is
recognised by the names of the classes in its MRO, and its groups are read from attributes the plugin already set.
"""

from typing import Any, Callable, Dict

import torch.distributed as dist

__all__ = ["plugin_group", "SUPPORTED_PLUGINS"]


def _world(plugin: Any) -> dist.ProcessGroup:
    # These plugins shard data over the whole world (DPPluginBase.prepare_dataloader uses the world rank and size).
    return dist.group.WORLD


def _hybrid(plugin: Any) -> dist.ProcessGroup:
    # prepare_dataloader shards over dp_group; sequence- and tensor-parallel peers share one batch.
    return plugin.dp_group


def _gemini(plugin: Any) -> dist.ProcessGroup:
    """The zero axis x extra-dp axis of the plugin's (zero, extra_dp, tp) mesh, as its prepare_dataloader uses it."""
    if plugin.dp_size == dist.get_world_size():
        # No tensor parallelism: data parallel is the world. The mesh has no world-sized group (zero_group is then
        # the default group), and asking it for one would create a duplicate of the world.
        return dist.group.WORLD
    # ProcessGroupMesh caches groups by their rank tuple, so this creates the combined group on the first call only
    # (collectively, on every rank of the world) and returns the cached one after that. With extra_dp_size == 1 or
    # zero_size == 1 the rank tuple is that of zero_group or extra_dp_group, and the mesh returns that very group.
    zero_axis, dp_axis = 0, 1  # gemini_plugin.ZERO_AXIS, DP_AXIS
    return plugin.pg_mesh.get_group_along_axis([zero_axis, dp_axis])


# Most specific first does not matter: the MRO is walked from the plugin's own class upwards.
_HANDLERS: Dict[str, Callable[[Any], dist.ProcessGroup]] = {
    "HybridParallelPlugin": _hybrid,
    "MoeHybridParallelPlugin": _hybrid,
    "GeminiPlugin": _gemini,
    "LowLevelZeroPlugin": _world,
    "TorchDDPPlugin": _world,
    "TorchFSDPPlugin": _world,
}

SUPPORTED_PLUGINS = tuple(_HANDLERS)


def _names(obj: Any) -> list:
    # __qualname__, not __name__: LowLevelZeroPlugin renames its class to "LowLevelZeroPlugin_ZeRO-<stage>".
    return [cls.__qualname__ for cls in type(obj).__mro__]


def plugin_group(call: str, obj: Any) -> dist.ProcessGroup:
    """The process group cmap maps over for ``group=obj``, a colossalai ``Booster`` or booster ``Plugin``.

    Args:
        call: the call's name, for error messages.
        obj: a ``Booster`` (its ``.plugin`` is used) or a booster ``Plugin`` instance.

    Returns:
        The plugin's data-parallel group: ``dp_group`` for HybridParallelPlugin and MoeHybridParallelPlugin, the zero
        group x extra dp group for GeminiPlugin, and the world for LowLevelZeroPlugin, TorchDDPPlugin and
        TorchFSDPPlugin.

    Raises:
        TypeError: for a Booster without a plugin, or a plugin that is not one of the supported ones (subclasses of
            a supported plugin are supported), naming the supported plugins.
    """
    supported = ", ".join(SUPPORTED_PLUGINS)
    plugin = obj
    if "Booster" in _names(obj):
        plugin = getattr(obj, "plugin", None)
        if plugin is None:
            raise TypeError(
                f"{call}: group=<Booster without a plugin> has no data-parallel group; boost with one of {supported}, "
                f"or pass group=None for the world."
            )
    for name in _names(plugin):
        handler = _HANDLERS.get(name)
        if handler is not None:
            if not dist.is_initialized():
                raise RuntimeError(f"{call}: group={type(plugin).__name__} needs torch.distributed initialised.")
            return handler(plugin)
    raise TypeError(
        f"{call}: group={type(plugin).__name__} is not a supported booster plugin; cmap knows the data-parallel "
        f"group of {supported} (and their subclasses). Pass its data-parallel ProcessGroup as group= instead."
    )


def plugin_mesh(obj: Any) -> Any:
    """``(ProcessGroupMesh, axis names)`` of a colossalai ``Booster`` or booster plugin that has a mesh (the hybrid
    and Gemini plugins), for ``shard_map``; None for any other object."""
    plugin = getattr(obj, "plugin", obj) if "Booster" in _names(obj) else obj
    names = _names(plugin)
    if "HybridParallelPlugin" in names or "MoeHybridParallelPlugin" in names:
        axes = {plugin.dp_axis: "dp", plugin.pp_axis: "pp", plugin.tp_axis: "tp", plugin.sp_axis: "sp"}
        return plugin.pg_mesh, tuple(axes[i] for i in range(len(axes)))
    if "GeminiPlugin" in names:
        return plugin.pg_mesh, ("zero", "dp", "tp")  # gemini_plugin's ZERO_AXIS, DP_AXIS, TP_AXIS
    return None
