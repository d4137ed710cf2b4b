"""Named axes: jax.lax's collectives (``psum``, ``all_gather``, ...) over the axes of the maps now running.

The frame of each active axis (:mod:`.frame`), the reduction and gather every op is made of, with their autograd,
forward-mode and vmap rules (:mod:`.ops`), the user-facing ops with jax.lax's signatures (:mod:`.collectives`), and
the varying-axis types they keep inside a ``shard_map`` with ``check_vma=True`` (:mod:`.vma`).

May import: ``wire`` and the leaf modules. The call layer opens the frames; this layer never calls back into it.
"""
