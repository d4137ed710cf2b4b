"""Named axes: jax.lax's collectives (``psum``, ``all_gather``, ...) over the axes of the maps now running.

What the ops read of a map's mode (:mod:`.modes`: the call layer's run modes extend it; shard_map's is ``RANK``);
the frame of each active axis (:mod:`.frame`); the record of one op's rules and their registry (:mod:`.rules`);
the exchanges the rules lower to, eager and traced (:mod:`.lowering`); the one autograd Function every op runs as,
following its rule (:mod:`.ops`); the user-facing ops with jax.lax's signatures, next to the table of their rules,
``RULES`` (:mod:`.collectives`); and the varying-axis types they keep inside a ``shard_map`` with ``check_vma=True``
(:mod:`.vma`).

May import: ``wire`` and the leaf modules (torch's internals only through ``torch_internals``). The call layer opens the
frames (and runs loop mode's example threads, which a frame holds as an ``ExampleLoop``); this layer never calls back
into it.
"""
