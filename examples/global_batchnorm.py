"""Batch normalisation with statistics over the whole global batch, split across ranks.

Each rank normalises its own examples with ``pmean`` over the global batch, so the result (and its gradients)
equal single-process ``nn.BatchNorm1d`` in training mode, however unevenly the batch splits. In float64: the
statistics add the examples in another order (per rank, then over the ranks), which moves a float32 sum of n terms
by up to about n * eps * sum|terms|, more than float32's default tolerance; a float64 one stays far under float64's.

This writes the statistic by hand, per example, as one writes any batch-coupled statistic; for the module itself,
``cmap(bn, mode="batched")(x)`` takes its statistics over the whole batch across the group with no code of one's own
(docs/guide.md, "BatchNorm and other batch-coupled modules").

Run: ``colossalai run --nproc_per_node 2 examples/global_batchnorm.py``
"""

import torch
import torch.distributed as dist

import colossalai_cmap as cm


def batchnorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Per-example BatchNorm1d (training mode) written with collectives over the axis ``"batch"``."""
    mean = cm.pmean(x, "batch")
    var = cm.pmean((x - mean) ** 2, "batch")  # biased variance, as BatchNorm uses for normalisation
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def main(batch: int = 37, features: int = 6) -> bool:
    if not dist.is_initialized():
        import colossalai

        colossalai.launch_from_torch(verbose=False)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, features, generator=g, dtype=torch.float64) * 3 + 1
    bn = torch.nn.BatchNorm1d(features).double()
    with torch.no_grad():
        bn.weight.copy_(torch.rand(features, generator=g) + 0.5)
        bn.bias.copy_(torch.randn(features, generator=g))
    bn.train()

    xs = x.clone().requires_grad_()
    expected = bn(xs)
    expected.square().sum().backward()

    xc = x.clone().requires_grad_()
    weight = bn.weight.detach().clone().requires_grad_()
    bias = bn.bias.detach().clone().requires_grad_()
    got = cm.cmap(batchnorm, in_dims=(0, None, None), axis_name="batch")(xc, weight, bias)
    got.square().sum().backward()

    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(xc.grad, xs.grad)
    torch.testing.assert_close(weight.grad, bn.weight.grad)
    torch.testing.assert_close(bias.grad, bn.bias.grad)
    print(f"[rank {rank}] global_batchnorm: OK, matches nn.BatchNorm1d (values and gradients, {batch} rows)")
    return True


if __name__ == "__main__":
    main()
