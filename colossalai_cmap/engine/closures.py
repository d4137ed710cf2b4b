"""Tensors that ``func`` reads without being given them (closures, globals, attributes) get vmap's gradient.

Each rank's local graph gives such a tensor this rank's share of its gradient; the whole gradient is the sum over
the group, as jax's ``shard_map`` transposes a closed-over value into a psum of its cotangents. Three mechanisms,
each catching what the one before leaves:

1. Modules func names directly are reparametrized with their parameters through the call's entry (:mod:`module_params`).
2. :class:`Interceptor`, a ``TorchFunctionMode``, routes every other tensor that requires grad and was made before
   the call through a ``Split`` at its first use with grad enabled (and again in a recomputation of part of func in
   backward: :meth:`Interceptor.replaying`). The local graph then saves the routed value, so double backward
   through the cmap sees the sum too. It runs only where it can matter: when func's closures, globals or partial
   arguments hold such a tensor, or when an earlier call of this cmap found one by the walk below.
3. :func:`watch` walks the outputs' local graph after the share has run, at every autograd level (an outer
   ``torch.func.grad`` has its own), and finds each edge from a node made during this call into a node made before
   it: a tensor that reached the graph another way (say, as the argument of a ``torch.func.grad`` inside func).
   A hook on the node sums that edge's gradient over the group with a differentiable ``Join`` (one collective per
   node). This is exact to first order; a higher-order gradient through such an edge misses the other ranks' terms
   of the nodes that backward itself creates, which is why (2) comes first.

Every rank builds the same graph (an empty share runs a stand-in example), so entries and hooks run in the same
order on every rank; the walk's digest goes into the status round, and ranks whose graphs differ raise together.
"""

import contextlib
from typing import Any, Dict, Iterator, List, Sequence

import torch
from torch.overrides import TorchFunctionMode

from ..digests import digest
from ..torch_internals import (
    current_level,
    dynamo_tracing,
    level_of,
    node_metadata,
    sequence_nr,
    torch_function_disabled,
    transform_levels,
    tree_flatten,
)
from ..wire.exchange import JoinSpec, SplitSpec, join, requires_grad, split
from ..wire.link import Link
from ..wire.roles import COPY
from .module_params import References

WHAT = "the gradient of closure-captured tensors"


def watch(outputs: Sequence[Any], tag: object, start: int, link: Link) -> int:
    """Hook every edge from this call's graph into an earlier one; returns a digest of what was found (0: none)."""
    edges = _foreign_edges(outputs, tag, start)
    for node, ks in edges.items():
        node.register_hook(_hook(tuple(ks), link))
    return digest([len(ks) for ks in edges.values()]) if edges else 0


def reaches_outside(outputs: Sequence[Any], tag: object, start: int) -> bool:
    """Whether the outputs' graph has an edge from a node made during this call into one made before it, other
    than through the call's tagged nodes (its entry)."""
    return bool(_foreign_edges(outputs, tag, start))


def recomputes(outputs: Sequence[Any], tag: object, start: int) -> bool:
    """Whether the outputs' graph, within this call, holds a reentrant ``torch.utils.checkpoint``, which runs part
    of func again in backward on new leaves (the inputs detached)."""
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen or _foreign(node, start, tag) or getattr(node, "_cmap_tag", None) is tag:
            continue
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
    return False


MADE = "colossalai_cmap.call"  # autograd node metadata key: the call whose loop-mode threads made this node


def _foreign(node: Any, start: int, tag: object) -> bool:
    """Whether ``node`` was made before the call: a node numbered before the call's start on this thread that no
    loop-mode example thread of the call made (their numbers are their own thread's)."""
    # A leaf's accumulator may be made lazily, during this call: it is foreign whatever its number says.
    if type(node).__name__ == "AccumulateGrad":
        return True
    if sequence_nr(node) >= start or getattr(node, "_cmap_tag", None) is tag:
        return False
    return node_metadata(node).get(MADE) is not tag


class MadeHere(TorchFunctionMode):
    """In a loop-mode example thread: tags the autograd nodes each op makes with the call's tag. The nodes an op
    made are the ones between its outputs and its inputs' own nodes."""

    def __init__(self, tag: object) -> None:
        super().__init__()
        self.tag = tag

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not torch.is_grad_enabled():
            return func(*args, **kwargs)
        stop = set(_nodes(tree_flatten((args, kwargs))[0]))  # before the op: an in-place op gives its input a new one
        out = func(*args, **kwargs)
        stack = list(_nodes(tree_flatten(out)[0]))
        while stack:
            node = stack.pop()
            if node is None or node in stop or type(node).__name__ == "AccumulateGrad":
                continue
            if node_metadata(node).get(MADE) is self.tag:
                continue
            node_metadata(node)[MADE] = self.tag
            stack.extend(n for n, _ in node.next_functions)
        return out


def _nodes(values: Sequence[Any]) -> Iterator[Any]:
    """The autograd nodes of the tensors among ``values``, at every function-transform level."""
    for v in values:
        if isinstance(v, torch.Tensor):
            for t in transform_levels(v):
                if t.grad_fn is not None:
                    yield t.grad_fn


def _foreign_edges(outputs: Sequence[Any], tag: object, start: int) -> Dict[Any, List[int]]:
    stack = list(_nodes(outputs))
    stack.reverse()
    seen, edges = set(), {}
    while stack:
        node = stack.pop()
        if node in seen or _foreign(node, start, tag) or getattr(node, "_cmap_tag", None) is tag:
            continue
        seen.add(node)
        for k, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if _foreign(nxt, start, tag):
                edges.setdefault(node, []).append(k)
            else:
                stack.append(nxt)
    return edges


def _hook(ks: Sequence[int], link: Link) -> Any:
    def hook(grad_inputs: Sequence[Any], grad_outputs: Sequence[Any]) -> tuple:
        picked = [k for k in ks if grad_inputs[k] is not None]
        spec = JoinSpec(link, (COPY,) * len(picked), WHAT, sync=True)
        summed = join(spec, [grad_inputs[k] for k in picked])
        out = list(grad_inputs)
        for k, s in zip(picked, summed):
            out[k] = s
        return tuple(out)

    return hook


# ----------------------------------------------------------------------------------------------- interception
_SKIP = {torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward, torch.Tensor.register_hook}
_ACCESSORS = ("__get__", "__set__")


def may_capture(refs: References) -> bool:
    """Whether func's closures, globals or partial arguments hold a tensor that requires grad (one level deep)."""
    if not refs:
        return False
    for value in refs.values():
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
            return True
    return False


class Interceptor(TorchFunctionMode):
    """Routes each tensor that requires grad and was made before the call through the call's entry, at first use."""

    def __init__(self, tag: object, start: int, link: Link) -> None:
        super().__init__()
        self.tag, self.start, self.link = tag, start, link
        self.level = current_level() or 0  # wrappers above it were made in the call
        self.aliases: Dict[int, Any] = {}
        self.unrouted: Dict[int, Any] = {}  # read where no graph is made (a reentrant checkpoint's first run)
        self.replay = False

    def met(self) -> bool:
        """Whether func read a tensor made before the call that requires grad."""
        return bool(self.aliases or self.unrouted)

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Active again in func's backward, for a recomputation of part of func (reentrant checkpointing): it
        routes only the tensors the call itself met, since the recomputation's inputs are new leaves."""
        self.replay = True
        try:
            with self:
                yield
        finally:
            self.replay = False

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # dynamo inspects tensors while tracing: let it see them as they are (the graph walk covers compiled code)
        if dynamo_tracing():
            return func(*args, **kwargs)
        if func not in _SKIP and getattr(func, "__name__", "") not in _ACCESSORS:
            args = tuple(self._routed(a) for a in args)
            if kwargs:
                kwargs = {k: self._routed(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def route(self, v: Any) -> Any:
        """``v`` routed through the call's entry if it is a tensor made before the call that requires grad: for a
        value func returns as it is, which no torch function saw."""
        return self._one(v)

    def _routed(self, v: Any) -> Any:
        if isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in v):
            return type(v)(self._one(t) for t in v) if type(v) in (list, tuple) else v
        return self._one(v)

    def _one(self, v: Any) -> Any:
        if not requires_grad(v):
            return v
        if level_of(v) > self.level or self._made_here(v):
            return v
        found = self.aliases.get(id(v))
        if found is None or found[0] is not v:
            if self.replay and self.unrouted.get(id(v), (None,))[0] is not v:
                return v
            if not torch.is_grad_enabled() and current_level() is None:
                self.unrouted[id(v)] = (v,)  # no gradient here; a recomputation with one routes it
                return v
            with torch_function_disabled():
                alias = split(SplitSpec(self.link, (COPY,), self.tag), [v])[0]
            found = self.aliases[id(v)] = (v, alias)
        return found[1]

    def _made_here(self, v: torch.Tensor) -> bool:
        """Whether some level of ``v`` has an autograd node made during this call (the entry's outputs too)."""
        for t in transform_levels(v):
            node = t.grad_fn
            if node is not None:
                return not _foreign(node, self.start, self.tag)
        return False
