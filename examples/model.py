"""An ``nn.Module`` as func: ``cmap(model)`` runs the model per example, spread over the ranks.

Run with ``colossalai run --nproc_per_node 2 examples/model.py``.
"""

import colossalai
import torch
import torch.distributed as dist
from colossalai import cmap
from torch import nn


class Model(nn.Module):
    """Linear(128, 128) then ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(128, 128)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        x = self.relu(x)
        return x


def main() -> bool:
    """Returns True when ``cmap(model)`` matches ``torch.vmap(model)`` (values, shape, and the autograd graph)."""
    if not dist.is_initialized():
        colossalai.launch_from_torch(verbose=False)
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights and inputs on every rank
    model = Model()
    batched_model = cmap(model)
    input = torch.randn(64, 128)
    out = batched_model(input)

    expected = torch.vmap(model)(input)
    # vmap runs the Linear as one addmm over the rows it gets (64 here, a shard per rank in cmap), which BLAS may
    # block otherwise: each output, a sum of n = 129 terms (128 products and the bias), is within
    # n u / (1 - n u) * sum|terms| of the exact value (u = eps / 2) either way. ReLU only shrinks a difference.
    n, u = 129, torch.finfo(input.dtype).eps / 2
    scale = input.abs() @ model.linear.weight.abs().T + model.linear.bias.abs()
    tol = dict(atol=2 * n * u / (1 - n * u) * float(scale.max()), rtol=0)
    torch.testing.assert_close(out, expected, **tol)
    # The parameters require grad, so, as with vmap, the result is differentiable (see train_step.py).
    assert out.requires_grad == expected.requires_grad
    # mode="batched" calls the module once per rank on its whole shard, as a model's forward expects.
    torch.testing.assert_close(cmap(model, mode="batched")(input), expected, **tol)
    print(f"[rank {rank}] model: OK, matches torch.vmap ({out.shape[0]} rows, output {tuple(out.shape)})")
    return True


if __name__ == "__main__":
    main()
