"""A few optimizer steps through a cmapped model: the loss curve equals single-process ``torch.vmap``'s to 1e-6.

Every rank holds the same model replica. ``cmap(model)`` runs each rank's share of the batch, all-gathers the
outputs, and every rank computes the same loss. In backward, cmap gives each rank's parameters the full-batch
gradient (each rank backpropagates its own rows; one all-reduce sums the parameter gradients), so every replica
takes the same step and no DDP wrapper is needed. Plain SGD is used on purpose: a gradient scaled by the number of
ranks would change the curve, whereas Adam would mostly hide it. The model runs in float64: the gradient sums the
batch's rows in another order (per rank, then over the ranks), which moves a sum of n terms by up to about
n * eps * sum|terms|: in float32 (eps 1.2e-7) that need not stay under 1e-6 over a few steps, in float64 (eps
2.2e-16) it stays far under.

Run with ``colossalai run --nproc_per_node 2 examples/train_step.py``.
"""

import copy
from typing import List

import colossalai
import torch
import torch.distributed as dist
from colossalai import cmap
from torch import nn


def train(forward: nn.Module, model: nn.Module, xs: torch.Tensor, ys: torch.Tensor, steps: int) -> List[float]:
    """``steps`` SGD steps on the mean squared error of ``forward(xs)``; returns the loss before each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(forward(xs), ys)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(steps: int = 5, batch: int = 37, tol: float = 1e-6) -> bool:
    """Returns True when the cmap run's losses and final parameters match the single-process ``torch.vmap`` run."""
    if not dist.is_initialized():
        colossalai.launch_from_torch(verbose=False)
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights and data on every rank
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).double()
    reference = copy.deepcopy(model)
    xs = torch.randn(batch, 8, dtype=torch.float64)
    ys = xs.sum(1, keepdim=True).sin()

    losses = train(cmap(model), model, xs, ys, steps)
    expected = train(torch.vmap(reference), reference, xs, ys, steps)

    worst = max(abs(a - b) for a, b in zip(losses, expected))
    if worst > tol:
        raise AssertionError(
            f"[rank {rank}] train_step: loss curve differs from torch.vmap by {worst:.2e}:\n"
            f"cmap {losses}\nvmap {expected}"
        )
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"parameter {name} after {steps} steps: {m}")
    curve = " -> ".join(f"{v:.4f}" for v in losses)
    print(f"[rank {rank}] train_step: OK, loss curve matches torch.vmap to {tol:g} (max diff {worst:.1e}): {curve}")
    return True


if __name__ == "__main__":
    main()
