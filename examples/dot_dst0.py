"""The decorator with options, ``@cmap(in_dims=(0, None), dst=0)``: only group rank 0 receives the result.

``b`` is not mapped (``in_dims`` None): every rank uses the whole vector. The other ranks get None back and never
allocate the full output. Run with ``colossalai run --nproc_per_node 2 examples/dot_dst0.py``.
"""

import colossalai
import torch
import torch.distributed as dist
from colossalai import cmap


@cmap(in_dims=(0, None), dst=0)
def batch_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.dot(x, y)


def main() -> bool:
    """Returns True when rank 0 holds ``torch.vmap``'s result and every other rank holds None."""
    if not dist.is_initialized():
        colossalai.launch_from_torch(verbose=False)
    rank = dist.get_rank()
    torch.manual_seed(0)
    a = torch.randn(64, 128)
    b = torch.randn(128)
    out = batch_dot(a, b)  # out = None on all processes except process 0

    if rank == 0:
        expected = torch.vmap(torch.dot, in_dims=(0, None))(a, b)
        # With b unmapped, vmap turns the dots into one matrix-vector product, whose rounding can depend on how
        # many rows it gets (64 here, 22 per rank on 3 ranks): not always bit for bit. A dot of n products added
        # in any order is within n u / (1 - n u) * sum|a_k b_k| of the exact value (u = eps / 2), so two orders
        # differ by at most twice that.
        n, u = a.shape[1], torch.finfo(a.dtype).eps / 2
        atol = 2 * n * u / (1 - n * u) * float((a.abs() @ b.abs()).max())
        torch.testing.assert_close(out, expected, atol=atol, rtol=0)
        print(f"[rank {rank}] dot_dst0: OK, matches torch.vmap ({out.shape[0]} rows)")
    else:
        if out is not None:
            raise AssertionError(f"[rank {rank}] dot_dst0: expected None off dst=0, got {type(out).__name__}")
        print(f"[rank {rank}] dot_dst0: OK, None as expected (dst=0)")
    return True


if __name__ == "__main__":
    main()
