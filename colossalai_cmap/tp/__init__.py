"""Tensor parallelism: ``shard_model(model, plan=...)`` with parallel styles, its layers, the full state dict, and
the torch.fx form.

May import: ``call``, ``axis``, ``integration``, ``wire`` and the leaf modules.
"""
