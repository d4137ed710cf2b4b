"""Megatron's sequence parallelism for ``shard_model(..., sequence_parallel=True)``.

Between the tensor-parallel regions (norms, residual adds, dropout) each rank holds its ``torch.tensor_split``
rows of the sequence (dim 1). A column-parallel layer all-gathers the sequence on entry (backward: the reduce-scatter
of its input gradient) and keeps only the sharded input for backward, where it gathers it again
(:class:`Regather`) to form its weight gradient; a row-parallel layer and the vocabulary-parallel embedding
reduce-scatter their partial sums to the sequence on exit (backward: the all-gather). Every exchange is a native
collective (:mod:`~colossalai_cmap.wire.native`) with ``checked=False``: no status round, as in Megatron.

The transformers model runs unmodified: a vocabulary-parallel embedding's exit puts this rank's rows into zeros of
the whole sequence (a local pad, no communication), so the model's forward computes positions, the causal mask and
the rotary embeddings from the whole length as unsharded; each decoder layer's forward pre-hook takes this rank's
rows of a whole-length input (the pad's transpose). A replicated embedding's output is taken the same way, with a
gather of its gradient in backward (a round-free ``Split`` of rows), so its table's gradient is whole on every rank. An
attention or MLP module holding column-parallel layers gathers the sequence on entry (attention reshapes by the
input's length). The parameters no tensor-parallel layer holds, other than the input embedding (the norms), get
their gradients summed over the group: each rank's rows contribute a part, in one all-reduce per backward
(:class:`GradSums`). The LM head keeps its gathered input for backward (one ``[batch, sequence, hidden]`` per
model, not per layer) rather than gather it again.
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..torch_internals import after_backward, backward_reaches, current_graph_task_id
from ..wire.comm import default_timeout
from ..wire.exchange import SplitSpec, all_reduce, split
from ..wire.group import Group
from ..wire.link import Link, link_for
from ..wire.native import AllGather, NativeSpec
from ..wire.roles import Rows, first_row, tensor_split_sizes

__all__ = ["SequenceState", "GradSums", "Regather", "LinearOnGathered", "pad_to_sequence"]

CALL = "shard_model"


class SequenceState:
    """The whole sequence's length of the running forward (read by the model's forward pre-hook), shared by the
    layers and hooks of one sharded model."""

    def __init__(self, group: Group) -> None:
        self.group, self.timeout = group, default_timeout()
        self.length: Optional[int] = None
        self.replicated_input = True  # the decoder layers' first input is replicated (an unsharded embedding)
        self.grad_sums = GradSums(group, self.timeout)

    def spec(self, t: torch.Tensor, length: int, what: str) -> NativeSpec:
        """The rows of a sequence of ``length`` (dim 1) over the group, for a round-free gather or reduce-scatter."""
        link = link_for(self.group, t.device, CALL, self.timeout)
        return NativeSpec(link, 1, tensor_split_sizes(length, self.group.size), what, checked=False)

    def mine(self, length: int) -> Tuple[int, int]:
        """This rank's (first row, row count) of a sequence of ``length``."""
        sizes = tensor_split_sizes(length, self.group.size)
        return first_row(sizes, self.group.rank), sizes[self.group.rank]

    def read_length(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """The model's forward pre-hook: the whole length, from ``input_ids`` or ``inputs_embeds``."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
            raise ValueError(
                f"{CALL}: sequence_parallel=True: {type(module).__name__} was called without input_ids or "
                f"inputs_embeds of shape [batch, sequence, ...]; the sequence length is what the ranks split."
            )
        self.length = ids.shape[1]

    def enter_layer(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """A decoder layer's forward pre-hook: this rank's rows of a whole-length hidden state (the embedding's
        pad, or a replicated embedding); a sharded one passes as it is."""
        positional = bool(args)
        x = args[0] if positional else kwargs.get("hidden_states")
        if self.length is None or not isinstance(x, torch.Tensor) or x.shape[1] != self.length:
            return None
        if self.replicated_input:  # backward gathers the rows' gradients: every rank holds the whole gradient
            spec = self.spec(x, self.length, "the decoder layers' input")
            x = split(SplitSpec(spec.link, (Rows(1, spec.sizes),), checked=False), [x])[0]
        else:  # the embedding's pad: backward pads this rank's rows, which the pad's transpose takes
            start, count = self.mine(self.length)
            x = x.narrow(1, start, count)
        if positional:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}


class GradSums:
    """The sums over a group of replicated parameters' gradients (each rank's rows give a part: the norms under
    sequence parallelism), coalesced into one ``all_reduce`` per backward and dtype, as Megatron's
    ``_allreduce_layernorm_grads`` does after backward.

    Each parameter's gradient hook keeps this rank's part and lets autograd accumulate zeros in its place; the
    first of a backward queues a callback on autograd's engine that, once the backward has finished, sums the kept
    parts in one flat all-reduce and adds each sum to its ``.grad``: ``.grad`` ends as the old value plus the sum,
    exactly what a sum in each hook gives. Under ``torch.autograd.grad`` (nothing accumulates) or
    ``create_graph=True`` the hook sums its gradient alone and returns it.
    """

    def __init__(self, group: Group, timeout: float) -> None:
        self.group, self.timeout = group, timeout
        self.pending: Dict[int, List[Tuple[nn.Parameter, torch.Tensor]]] = {}  # by autograd graph task
        self.accumulators: List[Any] = []  # autograd's AccumulateGrad nodes, kept alive to be asked about

    def add(self, p: nn.Parameter) -> None:
        """Sum ``p``'s gradient over the group in every backward."""
        node = torch.autograd.graph.get_gradient_edge(p).node
        self.accumulators.append(node)

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled() or not _accumulates(node):
                return all_reduce(link_for(self.group, grad.device, CALL, self.timeout), grad)
            task = current_graph_task_id()
            if task not in self.pending:
                self.pending[task] = []
                after_backward(lambda: self.flush(task))
            self.pending[task].append((p, grad))
            return torch.zeros_like(grad)

        p.register_hook(hook)

    def flush(self, task: int) -> None:
        """The end of a backward: every kept part summed, one all-reduce per (device, dtype), added to ``.grad``."""
        kept = self.pending.pop(task, [])
        by_kind: Dict[Tuple[torch.device, torch.dtype], List[Tuple[nn.Parameter, torch.Tensor]]] = {}
        for p, grad in kept:
            by_kind.setdefault((grad.device, grad.dtype), []).append((p, grad))
        for (device, _), items in by_kind.items():
            flat = torch.cat([grad.reshape(-1) for _, grad in items])
            sums = all_reduce(link_for(self.group, device, CALL, self.timeout), flat)
            for (p, grad), total in zip(items, sums.split([grad.numel() for _, grad in items])):
                total = total.view_as(grad)
                if p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.add_(total)


def _accumulates(node: Any) -> bool:
    """Whether the running backward accumulates into the leaf of ``node`` (False under ``torch.autograd.grad``,
    which torch does not answer for leaves)."""
    try:
        return backward_reaches(node)
    except RuntimeError:  # "... we are currently running autograd.grad()"
        return False


def pad_to_sequence(state: SequenceState, mine: torch.Tensor, length: int) -> torch.Tensor:
    """This rank's rows in zeros of the whole sequence (no communication); backward takes this rank's rows."""
    start, count = state.mine(length)
    before = mine.new_zeros((mine.shape[0], start, *mine.shape[2:]))
    after = mine.new_zeros((mine.shape[0], length - start - count, *mine.shape[2:]))
    return torch.cat([before, mine, after], 1)


class Regather:
    """The whole sequence of one sharded input, gathered again in backward once for every column-parallel layer
    that reads it (q, k and v; gate and up), and dropped after the last of them."""

    def __init__(self, spec: NativeSpec) -> None:
        self.spec, self.pending, self.full = spec, 0, None

    def take(self, shard: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            self.full = AllGather.plain(self.spec, [shard])
        full = self.full
        self.pending -= 1
        if self.pending <= 0:
            self.full = None
        return full


class LinearOnGathered(torch.autograd.Function):
    """``F.linear`` of a gathered sequence that keeps only this rank's rows for backward (Megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication`` with sequence parallelism): backward gathers them again
    for the weight gradient; the input gradient goes to the gather, whose backward reduce-scatters it."""

    @staticmethod
    def forward(
        ctx: Any,
        full: torch.Tensor,
        shard: torch.Tensor,
        regather: Regather,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
    ) -> torch.Tensor:
        ctx.regather, ctx.has_bias = regather, bias is not None
        regather.pending += 1
        ctx.save_for_backward(shard, weight)
        return torch.nn.functional.linear(full, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        shard, weight = ctx.saved_tensors
        full = ctx.regather.take(shard) if ctx.needs_input_grad[3] else None
        grad_full = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        flat = grad.reshape(-1, grad.shape[-1])
        grad_w = flat.t().matmul(full.reshape(-1, full.shape[-1])) if full is not None else None
        grad_b = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[4] else None
        return grad_full, None, None, grad_w, grad_b


def link_of(state: SequenceState, t: torch.Tensor) -> Link:
    return link_for(state.group, t.device, CALL, state.timeout)
