"""The wire: everything that talks to ``torch.distributed``.

Process groups and their per-process state (:mod:`.group`), bounded waits (:mod:`.comm`) whose errors name the ranks
that did not arrive (:mod:`.presence`), the status protocol's rounds (:mod:`.protocol`, :mod:`.channel`,
:mod:`.route`), the data phase (:mod:`.transfer`), and the two communication primitives every layer above uses,
``Split`` and ``Join`` (:mod:`.roles`, :mod:`.exchange`, :mod:`.primitives`).

May import: torch, and the package's leaf modules (``errors``, ``faults``, ``stats``, ``digests``). Never the layers
above it (``call``, ``axis``, ``tp``, ``integration``): a round returns what it learned, and its caller decides.
"""
