"""The vocabulary-parallel cross entropy (Megatron-LM's): the loss of logits each rank holds a slice of the
vocabulary of, with no rank ever holding the whole ``[tokens, vocabulary]`` logits and no collective moving them.

Forward makes two small all-reduces per call, of one value per token: the max over the vocabulary (a shift for the
exponentials), then the sum of exponentials stacked with the target's logit. Backward is this rank's slice of
``softmax - one_hot(target)``, with no communication. :class:`CausalLMLoss` is transformers' ``ForCausalLMLoss``
on such logits (label shifting, ``ignore_index``, ``num_items_in_batch``), set as a model's ``loss_function`` by
``shard_model(..., loss_parallel=True)``.
"""

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from ..wire.comm import default_timeout
from ..wire.group import Group
from ..wire.link import Link, link_for
from ..wire.native import all_reduce, all_reduce_max
from ..wire.roles import first_row, tensor_split_sizes
from .layers import CALL

__all__ = ["vocab_parallel_cross_entropy", "CausalLMLoss"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses of vocabulary-sharded logits ``[N, V_rank]``; ignored tokens' losses are zero."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, link: Link, ignore: int) -> Any:
        count = logits.shape[-1]
        if count:
            top = logits.detach().max(-1).values
        else:  # more ranks than vocabulary entries: this rank holds none
            top = logits.new_full(logits.shape[:-1], float("-inf"))
        top = all_reduce_max(link, top)
        shifted = logits - top.unsqueeze(-1)
        exps = shifted.exp()
        inside = (target >= start) & (target < start + count)
        local = torch.where(inside, target - start, torch.zeros_like(target))
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) if count else shifted.new_zeros(target.shape)
        sums = all_reduce(link, torch.stack([exps.sum(-1), picked * inside]))
        valid = target != ignore
        loss = torch.where(valid, sums[0].log() - sums[1], torch.zeros_like(sums[0]))
        exps.div_(sums[0].unsqueeze(-1))  # this rank's slice of the softmax, kept for backward
        ctx.save_for_backward(exps, local, inside & valid, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        softmax, local, hit, valid = ctx.saved_tensors
        g = softmax * (grad * valid).unsqueeze(-1)
        if softmax.shape[-1]:
            g.scatter_add_(-1, local.unsqueeze(-1), -(grad * hit).unsqueeze(-1).to(g.dtype))
        return g, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: Group, vocab_size: int, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token cross entropy of logits split by vocabulary over ``group`` (``torch.tensor_split`` sizes of
    ``vocab_size``): ``logits`` ``[..., V_rank]``, this rank's slice; ``target`` ``[...]``, global ids, the same on
    every rank. Returns ``[...]`` losses, zero where ``target == ignore_index``; the same on every rank.
    """
    sizes = tensor_split_sizes(vocab_size, group.size)
    if logits.shape[-1] != sizes[group.rank]:
        raise ValueError(
            f"{CALL}: loss_parallel: logits of shape {tuple(logits.shape)} are not this rank's "
            f"{sizes[group.rank]} of the {vocab_size} vocabulary entries (torch.tensor_split over {group.size} ranks)."
        )
    if group.size == 1:
        flat = F.cross_entropy(
            logits.reshape(-1, vocab_size), target.reshape(-1), ignore_index=ignore_index, reduction="none"
        )
        return flat.reshape(target.shape)
    link = link_for(group, logits.device, CALL, default_timeout())
    flat = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), first_row(sizes, group.rank), link, ignore_index
    )
    return flat.reshape(target.shape)


class CausalLMLoss:
    """transformers' ``ForCausalLMLoss`` on vocabulary-sharded logits: labels shifted left by one (padded with
    ``ignore_index``), half-precision logits upcast to float32 (float64 ones kept, where transformers rounds them to
    float32), the mean over the tokens not ignored (or the sum over
    ``num_items_in_batch``). A model's ``loss_function`` under ``shard_model(..., loss_parallel=True)``."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: Optional[Any] = None,
        ignore_index: int = -100,
        shift_labels: Optional[torch.Tensor] = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        losses = vocab_parallel_cross_entropy(logits, shift_labels, self.group, vocab_size, ignore_index)
        total = losses.sum()
        if num_items_in_batch is not None:
            return total / num_items_in_batch
        return total / (shift_labels != ignore_index).sum()
