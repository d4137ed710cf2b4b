"""Per-example gradients, their norms and clipping for a small MLP, DP-SGD style, spread over the ranks.

``cmap(torch.func.grad(loss_fn), in_dims=(None, 0, 0))(params, xs, ys)`` computes one gradient per example: the
parameters are shared (``None``), the examples and labels are mapped (``0``). Each rank computes the gradients of
its share of the batch, and every rank receives all of them, so every rank then clips, sums and adds the same noise
and takes the same step with no further communication. The result is checked against single-process ``torch.vmap``,
in float64: vmap runs each layer as one matmul over the rows it gets, which BLAS may block otherwise for a rank's
share, and the update sums the examples in another order; in float32 those roundings can exceed float32's default
tolerance, in float64 they stay far under float64's.

Run with ``colossalai run --nproc_per_node 2 examples/per_sample_grads.py``.
"""

from typing import Dict

import colossalai
import torch
import torch.distributed as dist
from colossalai import cmap
from torch import nn
from torch.func import functional_call, grad

Params = Dict[str, torch.Tensor]


class MLP(nn.Module):
    def __init__(self, features: int = 10, hidden: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def dp_sgd_gradient(per_example: Params, clip: float, noise: Params, batch: int) -> Params:
    """Clip each example's whole gradient to norm ``clip``, sum, add the noise, and average."""
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_example.values()))
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {k: (torch.einsum("b,b...->...", factors, g) + noise[k]) / batch for k, g in per_example.items()}


def main(batch: int = 37, clip: float = 3.0, noise_multiplier: float = 1.1, lr: float = 0.5) -> bool:
    """Returns True when the per-example gradients, norms, clipped update and new parameters match ``torch.vmap``."""
    if not dist.is_initialized():
        colossalai.launch_from_torch(verbose=False)
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same model, data and noise on every rank
    model = MLP().double()
    # torch.func transforms take the parameters as an explicit argument; detached, as in the torch.func tutorials.
    params = {k: v.detach() for k, v in model.named_parameters()}
    xs, ys = torch.randn(batch, 10, dtype=torch.float64), torch.randint(0, 4, (batch,))

    def loss_fn(params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, params, (x.unsqueeze(0),))  # one example as a batch of one
        return nn.functional.cross_entropy(logits, y.unsqueeze(0))

    per_example = cmap(grad(loss_fn), in_dims=(None, 0, 0))(params, xs, ys)
    expected = torch.vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, xs, ys)
    for name in params:
        torch.testing.assert_close(per_example[name], expected[name], msg=lambda m: f"{name}: {m}")

    # Clipping inside the mapped function works too: only the clipped gradients come back.
    def clipped_grad(params: Params, x: torch.Tensor, y: torch.Tensor) -> Params:
        g = grad(loss_fn)(params, x, y)
        norm = torch.sqrt(sum(v.pow(2).sum() for v in g.values()))
        return {k: v * (clip / (norm + 1e-6)).clamp(max=1.0) for k, v in g.items()}

    clipped = cmap(clipped_grad, in_dims=(None, 0, 0))(params, xs, ys)
    clipped_ref = torch.vmap(clipped_grad, in_dims=(None, 0, 0))(params, xs, ys)
    for name in params:
        torch.testing.assert_close(clipped[name], clipped_ref[name], msg=lambda m: f"clipped {name}: {m}")

    noise = {k: noise_multiplier * clip * torch.randn(v.shape, dtype=v.dtype) for k, v in params.items()}
    update = dp_sgd_gradient(per_example, clip, noise, batch)
    update_ref = dp_sgd_gradient(expected, clip, noise, batch)
    new_params = {k: params[k] - lr * update[k] for k in params}
    for name in params:
        torch.testing.assert_close(update[name], update_ref[name], msg=lambda m: f"update {name}: {m}")
        torch.testing.assert_close(new_params[name], params[name] - lr * update_ref[name])

    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_example.values()))
    clipped_count = int((norms > clip).sum())
    print(
        f"[rank {rank}] per_sample_grads: OK, matches torch.vmap ({batch} examples, "
        f"grad norms {norms.min():.3f}..{norms.max():.3f}, {clipped_count} clipped to {clip})"
    )
    return True


if __name__ == "__main__":
    main()
