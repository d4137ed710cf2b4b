"""Named axes: jax.lax's collectives (``psum``, ``all_gather``, ...) over the axes of the maps now running.

The frame of each active axis (:mod:`.frame`), the reduction and gather every op is made of, with their autograd,
forward-mode and vmap rules (:mod:`.ops`), and the user-facing ops with jax.lax's signatures (:mod:`.collectives`).

May import: ``wire`` and the leaf modules. The call layer opens the frames; this layer never calls back into it.
"""
