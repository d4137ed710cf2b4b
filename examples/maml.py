"""MAML for sine regression, functorch's example with ``torch.vmap`` swapped for ``cmap``: the tasks spread over ranks.

The meta-parameters are a plain list that the per-task function reads from its closure. Inside it, an inner loop
takes ``torch.func.grad`` of the support loss with respect to those parameters and one gradient step; the query
loss of the adapted parameters is the task's loss. ``cmap(get_loss_for_task)`` runs each rank's share of the tasks,
and ``loss.backward()`` on the mean task loss gives every rank the meta-gradient of the whole batch of tasks, through
the inner gradient step (second order) and the closure, exactly as single-process ``torch.vmap`` does. Every rank
then takes the same Adam step. The loss curve is checked against the single-process run, in float64: the
meta-gradient sums the tasks in another order (per rank, then over the ranks), which moves a float32 sum of n terms
by up to about n * eps * sum|terms|, a float64 one by a factor 5e8 less.

Run with ``colossalai run --nproc_per_node 2 examples/maml.py``.
"""

import math
from typing import Callable, List, Tuple

import colossalai
import torch
import torch.distributed as dist
import torch.nn.functional as F
from colossalai import cmap
from torch.func import grad


def make_params(gen: torch.Generator) -> List[torch.Tensor]:
    def uniform(*shape: int, bound: float) -> torch.Tensor:
        return (torch.rand(*shape, generator=gen) * 2 - 1) * bound

    return [
        t.double().requires_grad_()
        for t in (
            uniform(40, 1, bound=1.0),
            torch.zeros(40),
            uniform(40, 40, bound=1 / math.sqrt(40)),
            torch.zeros(40),
            uniform(1, 40, bound=1 / math.sqrt(40)),
            torch.zeros(1),
        )
    ]


def net(params: List[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    x = F.relu(F.linear(x, params[0], params[1]))
    x = F.relu(F.linear(x, params[2], params[3]))
    return F.linear(x, params[4], params[5])


def sample_tasks(gen: torch.Generator, tasks: int, shots: int) -> Tuple[torch.Tensor, ...]:
    """Sine curves of random amplitude and phase: a support set and a query set per task."""
    amplitude = torch.rand(tasks, 1, 1, generator=gen) * 4.9 + 0.1
    phase = torch.rand(tasks, 1, 1, generator=gen) * math.pi
    x1, x2 = (torch.rand(tasks, shots, 1, generator=gen) * 10 - 5 for _ in range(2))
    tensors = x1, amplitude * torch.sin(x1 + phase), x2, amplitude * torch.sin(x2 + phase)
    return tuple(t.double() for t in tensors)


def train(mapper: Callable, steps: int, tasks: int = 8, shots: int = 10, alpha: float = 0.1) -> List[float]:
    gen = torch.Generator().manual_seed(0)  # the same parameters and tasks on every rank
    params = make_params(gen)
    opt = torch.optim.Adam(params, lr=1e-3)

    def get_loss_for_task(x1: torch.Tensor, y1: torch.Tensor, x2: torch.Tensor, y2: torch.Tensor) -> torch.Tensor:
        def inner_loss(params: Tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(net(list(params), x), y)

        grads = grad(inner_loss)(tuple(params), x1, y1)
        adapted = [p - alpha * g for p, g in zip(params, grads)]
        return F.mse_loss(net(adapted, x2), y2)

    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = mapper(get_loss_for_task)(*sample_tasks(gen, tasks, shots)).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(steps: int = 5) -> bool:
    """Returns True when the meta-training loss curve equals single-process ``torch.vmap``'s."""
    if not dist.is_initialized():
        colossalai.launch_from_torch(verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    got, expected = train(cmap, steps), train(torch.vmap, steps)
    ok = all(math.isclose(a, b, rel_tol=1e-7, abs_tol=1e-7) for a, b in zip(got, expected))
    verdict = "OK, matches torch.vmap" if ok else f"MISMATCH: {got} vs {expected}"
    print(f"[rank {rank}] maml: {verdict} ({len(got)} meta-steps, 8 tasks over {world} ranks, loss {got[-1]:.4f})")
    return ok


if __name__ == "__main__":
    main()
