"""``make gpu-check``: cmap, its collectives, ``shard_map`` and ``shard_model`` on CUDA over nccl, in one command.

    python -m checks.gpu                      # all GPUs up to 8: torchrun --nproc_per_node=min(8, GPUs)
    python -m checks.gpu --nproc 2            # a world of 2
    python -m checks.gpu --no-bench           # the checks only
    python -m checks.gpu --sizes 4KiB,256MiB  # the nccl rows at these sizes per rank (a plain number is MiB)
    python -m checks.gpu --cpu                # the same checks over gloo on CPU tensors (to test the script)

Without CUDA it prints that it needs a GPU and exits 0. With CUDA it launches itself under ``torchrun`` from the
same interpreter; every rank calls ``colossalai.launch_from_torch()`` (nccl, its own device) and runs, in order:

* checks (``core``, ``sharded``): cmap against ``torch.vmap`` for every ``dst`` and ``src``, uneven batches,
  gradients, the collectives inside func against single-process oracles, ``shard_map`` on a ``DeviceMesh`` from
  ``init_device_mesh("cuda", ...)``, ``shard_model`` on a small transformers Llama, and a failure on one rank
  arriving as ``CmapError`` on every rank. Each prints one PASS, FAIL or SKIP line (rank 0 prints, after every rank
  reported over a separate gloo group);
* the nccl rows (``bandwidth``): cmap's all_gather and all_reduce against ``torch.distributed``'s own on the same
  bytes, from 1 KiB to 64 MiB per rank (``--sizes``), as a table of bus bandwidths, ratios and the microseconds cmap
  adds per call;
* last, host syncs (``syncs``): which steady-state calls synchronize the host, under
  ``torch.cuda.set_sync_debug_mode``. Informational: a "yes" is reported, never failed.

Everything is also written to ``checks/gpu_results.json`` (``--json``).

The exit status is non-zero when a value or gradient check failed, or the run did not finish in time.
"""
