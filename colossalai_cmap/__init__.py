"""colossalai-cmap: ``jax.pmap`` for PyTorch on Colossal-AI.

``cmap(f)`` splits a batch across the processes of a ``torch.distributed`` group, runs ``torch.vmap(f)`` on each
process's share, and gathers the results. Importing this package is cheap: torch is imported on first use of a
public name.
"""

from . import _register  # noqa: F401  (registers colossalai.cmap)

__version__ = "0.1.0"

_LAZY = {
    "cmap": "api",
    "CmapError": "errors",
    "psum": "collectives",
    "pmean": "collectives",
    "pmax": "collectives",
    "pmin": "collectives",
    "all_gather": "collectives",
    "psum_scatter": "collectives",
    "all_to_all": "collectives",
    "ppermute": "collectives",
    "axis_index": "collectives",
    "axis_size": "collectives",
    "shard_model": "tensor_parallel",
    "full_state_dict": "checkpoint",
    "load_full_state_dict": "checkpoint",
    "sharded_parameters": "checkpoint",
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
