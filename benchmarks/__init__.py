"""The colossalai-cmap benchmarks: what cmap costs against hand-written ``torch.distributed`` code and against
single-process ``torch.vmap``, measured side by side on gloo worlds that the benchmarks start themselves.

Run from the repository root (``make bench`` runs the first two)::

    python -m benchmarks.run [--quick]        # the suite: benchmarks/results.json and docs/performance.md
    python -m benchmarks.compile [--quick]    # torch.compile and cmap side by side
    python -m benchmarks.tp_side_by_side      # shard_model against parallelize_module and shardformer
    python -m benchmarks.render [RESULTS] [DOCS]  # re-render the report from a results file

Modules: ``cases`` (every case, declared once), ``baselines`` (the hand-written variants), ``timing`` and
``memory`` (what is measured per case), ``threshold`` (cmap's two ways of gathering around the size between
them), ``measure`` (the instruments), ``attribution`` (where cmap's time goes, by cProfile), ``suite`` (what each
rank of a world runs), ``world`` (spawning a gloo world), ``machine`` (what ran where, and what a collective costs
the host), ``run`` (the command line), ``render`` with ``plots``, ``scaling``, ``tables`` and
``performance.md.tmpl`` (the report). The benchmarks use only the package's public API and its public
introspection (``cmap(f).stats``, ``colossalai_cmap.record_collectives()``), and the tests' wire counter
(``tests/wire_tap.py``), with one exception: ``threshold`` sets the threshold itself
(``colossalai_cmap.wire.link.FUSE_BYTES``, alike on every rank) around a group's first call, to time both ways at
the same sizes in one world. The GPU
correctness check is not a benchmark: it lives in ``checks/gpu`` (``make gpu-check``).
"""
