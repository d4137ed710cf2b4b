"""The wire: everything that talks to ``torch.distributed``.

One module per concept, imports going down:

1. :mod:`.group` (process groups and their per-process state), :mod:`.roles` (what each tensor of an exchange is),
   :mod:`.presence` (this process's count of collectives, read when a peer does not arrive);
2. :mod:`.comm` (bounded waits, whose errors name the ranks that did not arrive; the shape of a data phase's
   collective, as a group notes it to send the next one right behind its round, and its stand-in),
   :mod:`.link` (where an exchange communicates: the ``Link``, and the group's round buffers), :mod:`.traced`
   (``Split`` and ``Join`` inside ``torch.compile``);
3. :mod:`.payload` (the route of what rides in a round's payload), :mod:`.rounds` (a round of the status protocol:
   its header, its kinds, and how its failures are raised on every rank);
4. :mod:`.data_phase` (what did not fit a round: its collectives, sent after the round or right behind it);
5. :mod:`.exchange` (``Split`` and ``Join``, the two primitives every layer above uses, and their plain sides);
6. :mod:`.native` (collectives at their native algorithm's cost, one autograd Function) and :mod:`.guard` (the
   guarded backward).

May import: torch, and the package's leaf modules (``errors``, ``faults``, ``stats``, ``digests``, ``nesting``,
``torch_internals``); torch's internals only through ``torch_internals``. Never the layers above it (``call``, ``axis``,
``tp``, ``integration``): a round returns what it learned, and its caller decides.
"""
