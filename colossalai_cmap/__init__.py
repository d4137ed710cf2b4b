"""colossalai-cmap: ``jax.pmap`` for PyTorch on Colossal-AI.

``cmap(f)`` splits a batch across the processes of a ``torch.distributed`` group, runs ``torch.vmap(f)`` on each
process's share, and gathers the results; ``shard_map(f, mesh, in_specs, out_specs)`` runs ``f`` once per rank of a
named mesh on its blocks, as ``jax.shard_map`` does. Importing this package is cheap: torch is imported on first use of a
public name.
"""

from .integration import register as _register  # noqa: F401  (registers colossalai.cmap)

__version__ = "0.1.0"

_LAZY = {
    "cmap": "call.api",
    "CmapError": "errors",
    "psum": "axis.collectives",
    "pmean": "axis.collectives",
    "pmax": "axis.collectives",
    "pmin": "axis.collectives",
    "all_gather": "axis.collectives",
    "all_gather_invariant": "axis.collectives",
    "pcast": "axis.collectives",
    "pvary": "axis.collectives",
    "pbroadcast": "axis.collectives",
    "psum_scatter": "axis.collectives",
    "all_to_all": "axis.collectives",
    "ppermute": "axis.collectives",
    "axis_index": "axis.collectives",
    "axis_size": "axis.collectives",
    "typeof": "axis.vma",
    "shard_map": "shard.api",
    "smap": "shard.smap",
    "set_mesh": "shard.mesh",
    "P": "shard.specs",
    "Mesh": "shard.mesh",
    "shard_model": "tp.plan",
    "shard_linears_fx": "tp.fx",
    "ParallelStyle": "tp.styles",
    "Colwise": "tp.styles",
    "Rowwise": "tp.styles",
    "ColwiseGather": "tp.styles",
    "Vocab": "tp.styles",
    "full_state_dict": "tp.state_dict",
    "load_full_state_dict": "tp.state_dict",
    "sharded_parameters": "tp.state_dict",
    "record_collectives": "stats",
    "CallStats": "stats",
}

__all__ = list(_LAZY) + ["__version__"]


def __getattr__(name: str):  # PEP 562: the public names load torch on first use
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
