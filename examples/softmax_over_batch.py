"""Softmax over the batch axis: each example's weight is exp(score) divided by the sum over the global batch.

``pmax`` keeps it numerically stable, ``psum`` normalises, and ``all_gather``/``axis_index`` show where each
example sits in the global batch. The scores are float64: the normalising sum adds the examples in another order
(per rank, then over the ranks) than ``torch.softmax``, and the gradient sums them again; in float32 that can move
the gradient by more than float32's default tolerance, in float64 by far less than float64's.

Run: ``colossalai run --nproc_per_node 2 examples/softmax_over_batch.py``
"""

import torch
import torch.distributed as dist

import colossalai_cmap as cm


def batch_softmax(score: torch.Tensor) -> torch.Tensor:
    shifted = score - cm.pmax(score, "b").detach()  # pmax is not differentiable; the shift cancels anyway
    e = shifted.exp()
    return e / cm.psum(e, "b")


def rank_in_batch(score: torch.Tensor) -> torch.Tensor:
    """How many examples score higher than this one (0 = best), from every example's score."""
    everyone = cm.all_gather(score, "b")
    earlier = torch.arange(cm.axis_size("b")) < cm.axis_index("b")  # ties go to the earlier example
    return (everyone > score).sum() + ((everyone == score) & earlier).sum()


def main(batch: int = 23) -> bool:
    if not dist.is_initialized():
        import colossalai

        colossalai.launch_from_torch(verbose=False)
    rank = dist.get_rank()
    scores = torch.randn(batch, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 4

    s = scores.clone().requires_grad_()
    got = cm.cmap(batch_softmax, axis_name="b")(s)
    (got * torch.arange(batch, dtype=got.dtype)).sum().backward()
    ref = scores.clone().requires_grad_()
    expected = torch.softmax(ref, dim=0)
    (expected * torch.arange(batch, dtype=expected.dtype)).sum().backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(s.grad, ref.grad)

    ranks = cm.cmap(rank_in_batch, axis_name="b")(scores)
    assert torch.equal(ranks, torch.argsort(torch.argsort(scores, descending=True, stable=True)))
    print(f"[rank {rank}] softmax_over_batch: OK, matches torch.softmax(dim=0) and argsort ({batch} rows)")
    return True


if __name__ == "__main__":
    main()
