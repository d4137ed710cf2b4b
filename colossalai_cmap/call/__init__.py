"""One cmap call: the public function and ``Cmapped``, options, argument specs, the plan, the orchestrator, this
rank's shard, and the exit.

``api`` -> ``dispatch`` (the one orchestrator) -> ``plan`` / ``from_src`` (planning) -> ``rank`` (this rank's part:
``entry``, ``execute``, ``layout``, ``closures``, ``module_params``, ``views``) -> ``exit`` (the status round,
``checks``, the gather, in-place write-back and the outputs that are views of the caller's inputs).

May import: ``axis``, ``integration``, ``wire`` and the leaf modules. Nothing imports it but ``tp`` and the package's
lazy public names.
"""
