"""Batched dot products: ``cmap(torch.dot)`` over 64 pairs of vectors, checked against ``torch.vmap``.

Run with ``colossalai run --nproc_per_node 2 examples/batch_dot.py``.
"""

import colossalai
import torch
import torch.distributed as dist
from colossalai import cmap


def main() -> bool:
    """Returns True when ``cmap(torch.dot)`` equals ``torch.vmap(torch.dot)`` bit for bit on this rank."""
    if not dist.is_initialized():
        colossalai.launch_from_torch(verbose=False)
    rank = dist.get_rank()
    torch.manual_seed(0)  # src=None: every rank must pass the same x and y
    x = torch.randn(64, 128)
    y = torch.randn(64, 128)

    batch_dot = cmap(torch.dot)
    out = batch_dot(x, y)

    expected = torch.vmap(torch.dot)(x, y)
    if not torch.equal(out, expected):
        raise AssertionError(f"[rank {rank}] batch_dot: cmap differs from torch.vmap:\n{out}\n{expected}")
    print(f"[rank {rank}] batch_dot: OK, matches torch.vmap ({out.shape[0]} rows)")
    return True


if __name__ == "__main__":
    main()
