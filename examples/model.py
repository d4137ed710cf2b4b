"""The seed's second example: ``cmap(model)`` runs an ``nn.Module`` per example, spread over the ranks.

Run with ``colossalai run --nproc_per_node 2 examples/model.py``.
"""

import colossalai
import torch
import torch.distributed as dist
from colossalai import cmap
from torch import nn


class Model(nn.Module):
    """The seed's model: Linear(128, 128) then ReLU."""

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
    torch.testing.assert_close(out, expected)
    # The parameters require grad, so, as with vmap, the result is differentiable (see train_step.py).
    assert out.requires_grad == expected.requires_grad
    # mode="batched" calls the module once per rank on its whole shard, as a model's forward expects.
    torch.testing.assert_close(cmap(model, mode="batched")(input), expected)
    print(f"[rank {rank}] model: OK, matches torch.vmap ({out.shape[0]} rows, output {tuple(out.shape)})")
    return True


if __name__ == "__main__":
    main()
