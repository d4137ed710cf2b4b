"""Gradients through a distributed cmap call.

With ``dst=-1`` and ``src=None`` the whole per-rank call runs inside one ``autograd.Function``. In backward every
rank holds the same (replicated) gradient of the full output; it keeps its own rows, backpropagates them through
its local graph, and one ``all_reduce(SUM)`` combines the input gradients:

* a mapped input's gradient is zero outside this rank's rows, so the sum assembles it exactly;
* an ``in_dims=None`` input's or a module parameter's gradient is the sum of the per-shard contributions.

Nothing is gathered in backward and nothing is reduce-scattered, so no gradient is ever multiplied by P.
"""

import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch.autograd.function import once_differentiable

from . import comm
from .errors import CmapError, RankFailure
from .groups import Group


class _CmapFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, runner: "GradRunner", *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
            outputs = runner.forward(inputs)
        ctx.runner = runner
        ctx.inputs = inputs
        result = tuple(o.detach() for o in outputs)
        ctx.mark_non_differentiable(*[o for o in result if not (o.is_floating_point() or o.is_complex())])
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        in_grads = ctx.runner.backward(ctx.inputs, grads)
        del ctx.inputs
        return (None, *in_grads)


class GradRunner:
    """The forward and backward halves of one differentiable cmap call.

    Args:
        forward: runs the distributed call on fresh leaf inputs; returns the gathered tensor outputs and records,
            in ``local_pairs``, each local output that requires grad with a function that cuts this rank's rows
            out of the global output gradient.
        group: the group the call ran on.
        call: the call's name, for errors.
        timeout: bound on the backward collective.
        reduce: whether each input's gradient is summed over the group (one flag per input, or one for all).
            Inputs every rank holds whole (``src=None``, or unmapped inputs and parameters) are summed; a mapped
            input passed per rank (``src="local"``) keeps its own shard's gradient.
    """

    def __init__(
        self,
        forward: Callable[[List[torch.Tensor]], List[torch.Tensor]],
        group: Group,
        call: str,
        timeout: Optional[float],
        reduce: Union[bool, Sequence[bool]] = True,
    ) -> None:
        self._forward = forward
        self.reduce = reduce
        self.group = group
        self.call = call
        self.timeout = timeout
        self.local_pairs: List[Tuple[torch.Tensor, int, Callable[[torch.Tensor], torch.Tensor]]] = []

    def forward(self, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
        out = self._forward(inputs)
        captured = _captured_leaves([o for o, _, _ in self.local_pairs], inputs)
        if captured:
            shapes = ", ".join(str(tuple(t.shape)) for t in captured[:4])
            warnings.warn(
                f"{self.call}: func uses {len(captured)} tensor(s) that require grad but are not arguments (shapes "
                f"{shapes}); they receive no gradient through cmap. Pass them as arguments with in_dims=None.",
                stacklevel=4,
            )
        return out

    def backward(self, inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        failure: Optional[RankFailure] = None
        cause: Optional[BaseException] = None
        wanted = [i for i, t in enumerate(inputs) if t.requires_grad]
        local: List[Optional[torch.Tensor]] = [None] * len(inputs)
        try:
            outs = [o for o, _, _ in self.local_pairs]
            if outs and wanted:
                cut = [fn(grads[k]) for _, k, fn in self.local_pairs]
                found = torch.autograd.grad(outs, [inputs[i] for i in wanted], cut, allow_unused=True)
                for i, g in zip(wanted, found):
                    local[i] = g
        except Exception as exc:  # reported to every rank below, so none is left in the all_reduce
            failure = RankFailure.from_exception(exc, self.group.rank, self.group.global_rank)
            cause = exc
        self.local_pairs = []
        flags = [self.reduce] * len(inputs) if isinstance(self.reduce, bool) else list(self.reduce)
        if not any(flags):  # src="local", nothing replicated: every gradient stays with its shard, no collective
            if failure is not None:
                raise failure_error(self.call, failure, self.group) from cause
            return [_zeros_if_none(g, t) for g, t in zip(local, inputs)]
        shared = [i for i in wanted if flags[i]]
        summed = _reduce(inputs, local, shared, failure, cause, self.group, self.call, self.timeout)
        return [summed[i] if flags[i] else _zeros_if_none(local[i], inputs[i]) for i in range(len(inputs))]


def _zeros_if_none(grad: Optional[torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
    """A shard the local graph did not reach (an empty shard ran a stand-in) still gets a gradient, as with src=None."""
    if grad is None and like.requires_grad:
        return torch.zeros_like(like)
    return grad


def _captured_leaves(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Leaf tensors requiring grad that the local graph reaches but that are not cmap inputs (closures)."""
    known = {id(t) for t in inputs}
    seen, found, stack = set(), [], [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) not in known:
            found.append(variable)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def _reduce(
    inputs: Sequence[torch.Tensor],
    local: List[Optional[torch.Tensor]],
    wanted: Sequence[int],
    failure: Optional[RankFailure],
    cause: Optional[BaseException],
    group: Group,
    call: str,
    timeout: Optional[float],
) -> List[Optional[torch.Tensor]]:
    """Sum the per-rank gradients, one all_reduce per dtype, with a failure flag in the first one."""
    by_dtype: dict = {}
    for i in wanted:
        by_dtype.setdefault(inputs[i].dtype, []).append(i)
    if not by_dtype:
        by_dtype[torch.float32] = []
    result: List[Optional[torch.Tensor]] = [None] * len(inputs)
    flagged = False
    for n, (dtype, idx) in enumerate(by_dtype.items()):
        numel = sum(inputs[i].numel() for i in idx)
        device = inputs[idx[0]].device if idx else torch.device("cpu")
        buf = torch.zeros(numel + (1 if n == 0 else 0), dtype=dtype, device=device)
        offset = 0
        for i in idx:
            k = inputs[i].numel()
            if local[i] is not None:
                buf.narrow(0, offset, k).copy_(local[i].reshape(-1))
            offset += k
        if n == 0 and failure is not None:
            buf[-1] = 1
        comm.all_reduce(buf, group, call, timeout)
        if n == 0:
            flagged = bool(buf[-1].item() != 0)
        offset = 0
        for i in idx:
            k = inputs[i].numel()
            result[i] = buf.narrow(0, offset, k).view(inputs[i].shape)
            offset += k
    if flagged:
        failures = [f for f in comm.all_gather_object(failure, group, call, timeout, device) if f is not None]
        raise CmapError.from_failures(f"{call} (backward)", failures, group.rank) from cause
    return result


def failure_error(call: str, failure: RankFailure, group: Group) -> CmapError:
    return CmapError.from_failures(f"{call} (backward)", [failure], group.rank)


def apply(runner: GradRunner, tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    return _CmapFunction.apply(runner, *tensors)


class _NotDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, message: str, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.message = message
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, ...]:
        raise RuntimeError(ctx.message)


def not_differentiable(value: torch.Tensor, anchor: torch.Tensor, message: str) -> torch.Tensor:
    """``value``, marked so that backpropagating through it raises ``message`` (no collective, so no hang)."""
    if not (value.is_floating_point() or value.is_complex()):
        return value
    return _NotDifferentiable.apply(message, value, anchor)
