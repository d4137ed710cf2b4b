"""Quickstart: ``cmap(torch.dot)`` on every process of ``colossalai run``, checked against ``torch.vmap``.

Run with ``colossalai run --nproc_per_node 2 examples/quickstart.py`` (or ``make demo``).
"""

import colossalai
import torch
import torch.distributed as dist
from colossalai import cmap


def main() -> bool:
    """Each rank computes its share of 64 dot products; every rank gets all 64, equal to ``torch.vmap``'s."""
    if not dist.is_initialized():
        colossalai.launch_from_torch(verbose=False)
    torch.manual_seed(0)  # src=None (the default): every rank passes the same full inputs
    x, y = torch.randn(64, 128), torch.randn(64, 128)
    out = cmap(torch.dot)(x, y)  # split the 64 rows over the ranks, vmap each share, all-gather
    if not torch.equal(out, torch.vmap(torch.dot)(x, y)):
        raise AssertionError("quickstart: cmap(torch.dot) differs from torch.vmap(torch.dot)")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"[rank {rank}] quickstart: OK, matches torch.vmap ({len(out)} rows over {world} ranks)")
    return True


if __name__ == "__main__":
    main()
