"""A loss averaged over the batch sees the whole batch: in ``mode="batched"``, ``reduction="mean"`` of
``F.cross_entropy``, ``F.nll_loss``, ``F.mse_loss``, ``F.l1_loss``, ``F.binary_cross_entropy`` and
``F.binary_cross_entropy_with_logits`` is the mean over every rank's rows, as ``model(..., labels=labels).loss`` is
over the whole batch in one process.

A mean is a sum over a count, whatever the shape (transformers flattens ``(B, T, V)`` logits to ``(B * T, V)``): each
rank takes its loss with ``reduction="sum"`` and its count, which is torch's denominator of the mean (the targets not
``ignore_index``; with a class ``weight``, the sum of their weights; with class probabilities, the rows; the elements
for the elementwise losses); one ``Join(COPY)`` sums both over the group and a ``Split(COPY)`` makes the sums this
rank's own, so that backward sums their cotangents over the group (one collective). Every rank then divides alike,
so the loss is equal on every rank: the exit returns it as an ``out_dims=None`` output would be (:func:`made_here`),
its cotangent counted once. In a world of one the loss is torch's own, with no communication, and is returned alike.
Label smoothing keeps the form: torch's mean with it is its sum over the same count. An empty share's stand-in counts
nothing. A loss whose input has no batch dim (0-dim, or ``cross_entropy`` of one unbatched example) stays this rank's.
"""

from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from ..torch_internals import legacy_reduction
from ..wire.exchange import JoinSpec, SplitSpec, join, split
from ..wire.link import Link
from ..wire.roles import COPY
from ..wire.rounds import Kind

WHAT = "a loss's mean over the whole batch"

_CLASSES = (F.cross_entropy, F.nll_loss)  # the count: the targets' (weighted) number, or the rows
MEAN_LOSSES = frozenset(
    _CLASSES + (F.mse_loss, F.l1_loss, F.binary_cross_entropy, F.binary_cross_entropy_with_logits)
)  # the count: the elements of the (broadcast) loss


def reduction_of(kwargs: Dict[str, Any]) -> str:
    """The reduction a loss call asks for: ``reduction``, or the deprecated ``size_average``/``reduce``."""
    if kwargs.get("size_average") is not None or kwargs.get("reduce") is not None:
        return legacy_reduction(kwargs.get("size_average"), kwargs.get("reduce"))
    return kwargs.get("reduction", "mean")


def batched(func: Callable, x: torch.Tensor) -> bool:
    """Whether the loss's input has a batch dim, its first: a class loss's input is ``(N, C, ...)``."""
    return x.dim() >= (2 if func in _CLASSES else 1)


def whole_mean(func: Callable, kwargs: Dict[str, Any], link: Optional[Link], empty: bool) -> torch.Tensor:
    """The loss ``func(**kwargs)`` with ``reduction="mean"`` over the whole batch across ``link``'s group (keywords
    bound to ``func``'s signature; ``link``: None in a world of one, where it is torch's own)."""
    if link is None:
        return func(**kwargs)
    summed = {k: v for k, v in kwargs.items() if k not in ("size_average", "reduce")}
    summed["reduction"] = "sum" if not empty else "none"
    local = func(**summed)
    if empty:  # a stand-in's loss: through the graph, no values
        local = local.flatten()[:0].sum()
    count = 0.0 if empty else _count(func, kwargs, local)
    acc = torch.float64 if local.dtype == torch.float64 else torch.float32
    both = torch.stack([local.to(acc), torch.as_tensor(count, device=local.device).to(acc).detach()])
    (total,) = join(JoinSpec(link, (COPY,), WHAT, Kind.OP), [both])
    (total,) = split(SplitSpec(link, (COPY,)), [total])  # backward: the cotangents summed over the group
    return (total[0] / total[1]).to(local.dtype)


def _count(func: Callable, kw: Dict[str, Any], local: torch.Tensor) -> Any:
    """torch's denominator of the mean, on this rank's rows: a number, or a 0-dim tensor where it reads targets."""
    x, target = kw["input"], kw["target"]
    if func not in _CLASSES:
        return torch.broadcast_shapes(x.shape, target.shape).numel()
    if target.is_floating_point():  # class probabilities: the rows, each position of (N, d1, ...)
        return x.numel() // x.shape[1]
    with torch.no_grad():
        kept = target != kw["ignore_index"]
        weight = kw.get("weight")
        if weight is None:
            return kept.sum()
        return weight[target.masked_fill(~kept, 0)].masked_fill(~kept, 0).sum()


def arguments(signature: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """A call's arguments by name, defaults included."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)
