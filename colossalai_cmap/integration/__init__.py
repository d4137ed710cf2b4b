"""Where cmap meets Colossal-AI: ``group=`` resolution (process groups, ``ProcessGroupMesh`` axes, booster plugins)
and the ``from colossalai import cmap`` registration.

May import: ``wire`` (for the ``Group`` record) and the leaf modules (torch's internals only through
``torch_internals``). This ``__init__`` imports nothing, and ``register`` imports neither torch nor colossalai: the
installed ``.pth`` line runs it at every interpreter start.
"""
