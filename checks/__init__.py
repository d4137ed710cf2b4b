"""Correctness checks that need hardware the suite does not have: ``python -m checks.gpu`` (``make gpu-check``) runs
cmap, shard_map and shard_model on CUDA over nccl. Not benchmarks: each check passes or fails against an oracle."""
