"""Tensors that ``func`` reads without being given them (closures, globals, module attributes) get vmap's gradient.

Each rank's local graph gives such a tensor this rank's share of its gradient; the whole gradient is the sum over
the group, as jax's ``shard_map`` transposes a closed-over value into a psum of its cotangents. After the shard has
run, :func:`watch` walks the local graph of the outputs, at every autograd level (an outer ``torch.func.grad``
has its own), and finds each edge from a node made during this call into a node made before it: the leaf of a
closure-captured tensor, or the last op of one computed earlier. A hook on the node sums that edge's gradient over
the group with a ``Join`` (one collective per node, for all its edges), which is differentiable, so double backward
and function transforms see the sum too. The walk stops at the call's own entry, whose backward sums already.

Every rank builds the same graph (an empty shard runs a stand-in example), so the hooks fire in the same order on
every rank; the walk's digest goes into the status round, and ranks whose graphs differ raise together.
"""

from typing import Any, Dict, Iterator, List, Sequence

import torch

from .layout import digest
from .primitives import JoinSpec, Link, joined
from .roles import COPY

WHAT = "the gradient of closure-captured tensors"


def watch(outputs: Sequence[Any], owner: object, start: int, link: Link) -> int:
    """Hook every edge from this call's graph into an earlier one; returns a digest of what was found (0: none)."""
    edges = _foreign_edges(outputs, owner, start)
    for node, ks in edges.items():
        node.register_hook(_hook(tuple(ks), link))
    return digest([len(ks) for ks in edges.values()]) if edges else 0


def _levels(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t`` and the tensors under its function-transform wrappers: each level has its own autograd graph."""
    while True:
        yield t
        if not torch._C._functorch.is_functorch_wrapped_tensor(t):
            return
        t = torch._C._functorch.get_unwrapped(t)


def _foreign(node: Any, start: int) -> bool:
    # A leaf's accumulator may be made lazily, during this call: it is foreign whatever its number says.
    return type(node).__name__ == "AccumulateGrad" or node._sequence_nr() < start


def _foreign_edges(outputs: Sequence[Any], owner: object, start: int) -> Dict[Any, List[int]]:
    stack = [lt.grad_fn for t in outputs if isinstance(t, torch.Tensor) for lt in _levels(t) if lt.grad_fn is not None]
    stack.reverse()
    seen, edges = set(), {}
    while stack:
        node = stack.pop()
        if node in seen or _foreign(node, start) or getattr(node, "_cmap_owner", None) is owner:
            continue
        seen.add(node)
        for k, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if _foreign(nxt, start):
                edges.setdefault(node, []).append(k)
            else:
                stack.append(nxt)
    return edges


def _hook(ks: Sequence[int], link: Link) -> Any:
    def hook(grad_inputs: Sequence[Any], grad_outputs: Sequence[Any]) -> tuple:
        picked = [k for k in ks if grad_inputs[k] is not None]
        spec = JoinSpec(link, (COPY,) * len(picked), WHAT, sync=True)
        summed = joined(spec, [grad_inputs[k] for k in picked])
        out = list(grad_inputs)
        for k, s in zip(picked, summed):
            out[k] = s
        return tuple(out)

    return hook
