"""A Jacobian from vector-Jacobian products, one row of ``I_N`` per example.

``get_vjp`` closes over ``x`` and ``y = f(x)`` and calls ``torch.autograd.grad(y, x, v, retain_graph=True)``.
That exact form works under ``torch.vmap`` (torch batches the ``v`` through the autograd engine), so cmap takes it
as written: each rank computes the rows of the Jacobian for its share of ``I_N`` and the rows are all-gathered.
``x`` and ``y`` are closure-captured, not arguments, so this cmap call is not itself differentiated.

Run with ``colossalai run --nproc_per_node 2 examples/vjp_jacobian.py``.
"""

import colossalai
import torch
import torch.distributed as dist
from colossalai import cmap


def main(N: int = 5) -> bool:
    """Returns True when the cmapped Jacobian equals ``torch.vmap``'s and the analytic ``diag(2x)``."""
    if not dist.is_initialized():
        colossalai.launch_from_torch(verbose=False)
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same x on every rank: each builds its own identical graph y = f(x)
    f = lambda x: x**2  # noqa: E731
    x = torch.randn(N, requires_grad=True)
    y = f(x)
    I_N = torch.eye(N)

    # vectorized gradient computation
    def get_vjp(v: torch.Tensor):
        return torch.autograd.grad(y, x, v, retain_graph=True)

    jacobian = cmap(get_vjp)(I_N)

    expected = torch.vmap(get_vjp)(I_N)
    assert isinstance(jacobian, tuple) and len(jacobian) == 1  # autograd.grad returns a tuple, and so does cmap
    if not torch.equal(jacobian[0], expected[0]):
        raise AssertionError(f"[rank {rank}] vjp_jacobian: cmap differs from torch.vmap:\n{jacobian}\n{expected}")
    torch.testing.assert_close(jacobian[0], torch.diag(2 * x.detach()))
    print(f"[rank {rank}] vjp_jacobian: OK, matches torch.vmap ({N}x{N} Jacobian = diag(2x))")
    return True


if __name__ == "__main__":
    main()
