"""``shard_map``: jax's per-rank programming model over a named mesh, on the same primitives as cmap.

``shard_map(f, mesh, in_specs, out_specs)`` runs ``f`` once per rank of the mesh on plain tensors, this rank's
blocks of the global arguments, and assembles the global outputs. The partition specs (``P``) and their checks
(:mod:`.specs`), the mesh and its groups (:mod:`.mesh`), cutting blocks and assembling them, each the other's
transpose (:mod:`.blocks`), the exit that makes a failure on one rank a failure on every rank (:mod:`.conclude`),
DTensors in and out (:mod:`.dtensor`), the call lowered to traceable ops inside ``torch.compile`` (:mod:`.compiled`),
and the public function with shard_map's kind of map call, the steps the engine's driver runs (:mod:`.api`).

May import: ``engine`` (the drivers shard_map's kind runs on, the closure interception, the trainable-parameter
check, and the failure record a rank brings to the exit), ``axis``, ``integration``, ``wire`` and the leaf modules
(torch's internals only through ``torch_internals``); never ``call``. Nothing below imports it.
"""
