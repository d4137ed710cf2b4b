"""The engine: what every kind of map call runs, below ``call`` (cmap) and ``shard`` (shard_map).

A map call runs from its arguments to its result in one of two drivers (:mod:`.driver`): ``run_eager``, on any
group (a group of one included: the same steps on an unwired link), and ``run_compiled``, inside ``torch.compile``.
Each is a template whose steps a kind of map implements (``EagerKind``, ``TracedKind``): where it communicates, how
the arguments become this rank's inputs, the body, how the outputs are read, and how the exit concludes. cmap's
kind adds shares, run modes, views and the fast path; shard_map's adds specs, blocks, types and DTensors.

The engine owns what both kinds run: this rank's part (:mod:`.part`: the call's tag, the autograd sequence start,
the body, torch's control flow passed through and any other exception made a ``Failed`` outcome; the closure walk
and the guarded backward), the exit's shared parts (:mod:`.exit`: the failure report, the agreement of the ranks'
tables, and the wording of outputs that differ), the compiled driver's shared parts (the eager call out of the graph
per reason, the frames pushed and popped), tensors read from closures and module parameters (:mod:`.closures`,
:mod:`.module_params`), and the record a failed rank brings to the exit (:mod:`.records`).

May import: ``axis``, ``integration``, ``wire`` and the leaf modules (torch's internals only through
``torch_internals``). Never ``call`` or ``shard``: they implement its steps and import it.
"""
