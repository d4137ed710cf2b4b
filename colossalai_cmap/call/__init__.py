"""One cmap call: one pipeline of steps, and two drivers that run them.

Imports go down, five levels at most:

1. leaves: ``randomness`` (the ``randomness=`` choices and the generators they own), ``dims`` (``in_dims``/``out_dims``
   against pytrees), ``layout``, ``module_params``, ``loop`` and ``records`` (the records the steps hand each other:
   ``Shares``, ``Inputs``, ``FastPath``, ``Outputs``, ``Failed``, ``LastCall``); above them ``execute`` (the run
   modes: how func runs on a share) and ``options``, which parses ``mode`` and ``randomness`` into their objects;
2. steps: ``shares``, ``entry``, ``losses`` and ``batchnorm`` (a mean loss and training BatchNorm over the whole
   batch), ``closures``, ``views``, ``checks``, ``site`` (what one cmap keeps) and ``keywords`` (mapped keyword arguments made
   positional; the batched mode's check of whole ones);
3. ``from_src`` (the shares with ``src=r``), ``rank`` (this rank's part: entry, stand-in, run, outputs) and
   ``conclude`` (the exit: the status round, the gather, in-place write-back, views of the caller's inputs);
4. the drivers: ``dispatch`` (eager, on any group, and alone: a group of one with nothing to communicate) and
   ``compiled`` (inside ``torch.compile``: each step's traced form, beside its eager form in the step's module);
5. ``api`` (``cmap``, ``Cmapped``), which picks the driver and hands ``compiled`` the eager one.

May import: ``axis``, ``integration``, ``wire`` and the leaf modules (torch's internals only through
``torch_internals``). Imported by the package's lazy public names (``cmap``), by ``tp`` (``tp/fx.py``: each traced
linear layer is a cmap) and by ``shard`` (``shard/api.py``: the closure interceptor and walk of ``closures``).
"""
