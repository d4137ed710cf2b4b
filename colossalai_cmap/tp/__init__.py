"""Tensor parallelism: ``shard_model(model, plan=...)`` with parallel styles, its layers, the full state dict, and
the torch.fx form, ``shard_linears_fx``.

May import: ``call``, ``engine``, ``axis``, ``integration``, ``wire`` and the leaf modules (torch's internals only through
``torch_internals``).
"""

from .styles import Colwise, ColwiseGather, ParallelStyle, Rowwise, Vocab

__all__ = ["ParallelStyle", "Colwise", "Rowwise", "ColwiseGather", "Vocab"]
