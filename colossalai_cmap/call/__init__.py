"""One cmap call: cmap's kind of map call, whose steps the engine's two drivers run.

Imports go down, five levels at most from ``api``:

1. leaves: ``options`` (the ``Options`` record; it parses ``mode`` and ``randomness`` into the objects ``cmap()``
   hands it, importing neither), ``randomness`` (the ``randomness=`` choices and the generators they own), ``dims``
   (``in_dims``/``out_dims`` against pytrees), ``layout``, ``loop`` and ``records`` (the records the steps hand each
   other: ``Shares``, ``Inputs``, ``FastPath``, ``Outputs``, ``LastCall``); above them ``execute`` (the run modes:
   how func runs on a share);
2. steps: ``shares``, ``entry``, ``losses`` and ``batchnorm`` (a mean loss and training BatchNorm over the whole
   batch), ``views``, ``checks``, ``site`` (what one cmap keeps) and ``keywords`` (mapped keyword arguments made
   positional; the batched mode's check of whole ones);
3. ``from_src`` (the shares with ``src=r``), ``rank`` (this rank's part: entry, stand-in, run, outputs) and
   ``conclude`` (the exit: the status round, the gather, in-place write-back, views of the caller's inputs);
4. cmap's steps around this rank's part: ``dispatch`` (the group, alone or not: a group of one with nothing to
   communicate; the shares and the fast path; what the call leaves) and ``compiled`` (inside ``torch.compile``: each
   step's traced form, beside its eager form in the step's module);
5. ``api`` (``cmap``, ``Cmapped``, and cmap's kinds: the steps of 3 and 4 for the engine's ``run_eager`` and
   ``run_compiled``).

May import: ``engine`` (the drivers, this rank's part, the exit's shared parts, closures, module parameters and the
``Failed`` record), ``axis``, ``integration``, ``wire`` and the leaf modules (torch's internals only through
``torch_internals``). Imported by the package's lazy public names (``cmap``) and by ``tp`` (``tp/fx.py``: each traced
linear layer is a cmap); never by ``shard`` or ``engine``.
"""
