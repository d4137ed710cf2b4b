"""Every torch internal the package uses, behind one seam: a torch upgrade that moves or renames one changes this file.

Each function says what the package uses it for and which internal (an underscore name, or ``torch._C``) it wraps:
function transforms' levels and wrappers (``torch._C._functorch``, ``torch._functorch.vmap``), the autograd engine
(sequence numbers, the running backward, its end-of-backward callbacks, node metadata), dynamo, the functional
collectives that dynamo traces (``torch.distributed._functional_collectives``, ``torch.ops._c10d_functional``), and a
few others. Torch's pytree (``torch.utils._pytree``) is re-exported as is: the package's pytree is this module's.
Public torch APIs (``torch.compiler.is_compiling``, ``torch.overrides.TorchFunctionMode``) are used directly, and
``tests/test_layers.py`` checks that no other module names an internal.

A leaf module: it imports only torch.
"""

from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
import torch.autograd.forward_ad as fwAD
from torch._functorch import vmap as functorch_vmap
from torch.nn import _reduction
from torch.utils._pytree import (  # noqa: F401  (torch's pytree, a private module: the package's pytree is this)
    SUPPORTED_NODES,
    MappingKey,
    TreeSpec,
    _broadcast_to_and_flatten,
    keystr,
    register_pytree_node,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_structure,
    tree_unflatten,
)
from torch.utils.checkpoint import _StopRecomputationError

try:  # the state of torch.func.functional_call, read by the closure walk
    from torch.nn.utils.stateless import _reparametrize_module
except ImportError:  # pragma: no cover - other torch versions: the closure walk covers the parameters
    _reparametrize_module = None

# ------------------------------------------------------------------------------------------------------- pytree


def broadcast_to_and_flatten(
    tree: Any, spec: TreeSpec, is_leaf: Optional[Callable[[Any], bool]] = None
) -> Optional[List[Any]]:
    """``tree``'s leaves broadcast to the structure ``spec`` (a prefix of it), or None where it is not a prefix
    (``torch.utils._pytree._broadcast_to_and_flatten``)."""
    return _broadcast_to_and_flatten(tree, spec, is_leaf=is_leaf)


# ----------------------------------------------------------------------------------------- function transforms

# Checkpoint's early stop of a recomputation (``torch.utils.checkpoint._StopRecomputationError``): control flow.
STOP_RECOMPUTATION = _StopRecomputationError


def current_level() -> Optional[int]:
    """The innermost function transform's level now running, or None outside any
    (``torch._C._functorch.maybe_current_level``)."""
    return torch._C._functorch.maybe_current_level()


def level_of(t: torch.Tensor) -> int:
    """The level of ``t``'s outermost function-transform wrapper, -1 for a plain tensor
    (``torch._C._functorch.maybe_get_level``)."""
    return torch._C._functorch.maybe_get_level(t)


def is_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a function transform's wrapper (``torch._C._functorch.is_functorch_wrapped_tensor``)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def is_batched(t: torch.Tensor) -> bool:
    """Whether ``t``'s outermost wrapper is a vmap level's (``torch._C._functorch.is_batchedtensor``)."""
    return torch._C._functorch.is_batchedtensor(t)


def transform_levels(t: torch.Tensor) -> List[torch.Tensor]:
    """``t`` and the tensors under its function-transform wrappers, outermost first, the plain tensor last: each
    level has its own autograd graph (``torch._C._functorch.get_unwrapped``, level by level)."""
    found = [t]
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
        found.append(t)
    return found


def add_batch_dim(t: torch.Tensor, dim: int, level: int) -> torch.Tensor:
    """``t`` batched along ``dim`` at vmap ``level`` (``torch._C._functorch._add_batch_dim``)."""
    return torch._C._functorch._add_batch_dim(t, dim, level)


def remove_batch_dim(t: torch.Tensor, level: int, size: int, out_dim: int) -> torch.Tensor:
    """``t``'s batch at vmap ``level`` as dim ``out_dim`` of ``size`` rows, unwrapped
    (``torch._C._functorch._remove_batch_dim``)."""
    return torch._C._functorch._remove_batch_dim(t, level, size, out_dim)


def vmap_level(batch_size: int, randomness: str) -> ContextManager[int]:
    """Opens a vmap level as ``torch.vmap`` does, yielding it (``torch._functorch.vmap.vmap_increment_nesting``)."""
    return functorch_vmap.vmap_increment_nesting(batch_size, randomness)


def batched_inputs(dims: Sequence[Any], leaves: Sequence[Any], level: int, spec: Any) -> Any:
    """The flat inputs batched at ``level`` along ``dims``, unflattened with ``spec``, as ``torch.vmap`` makes them
    (``torch._functorch.vmap._create_batched_inputs``)."""
    return functorch_vmap._create_batched_inputs(list(dims), list(leaves), level, spec)


def outside_transforms() -> ContextManager[None]:
    """While open, tensors are made and read as plain ones, whatever function transform is around
    (``torch._C._DisableFuncTorch``)."""
    return torch._C._DisableFuncTorch()


def in_forward_ad() -> bool:
    """Whether a forward-mode AD level is open (``torch.autograd.forward_ad._current_level``)."""
    return fwAD._current_level >= 0


def can_reparametrize() -> bool:
    """Whether this torch has ``torch.func.functional_call``'s context that swaps a module's parameters
    (``torch.nn.utils.stateless._reparametrize_module``)."""
    return _reparametrize_module is not None


def reparametrized(module: torch.nn.Module, mapping: Dict[str, torch.Tensor]) -> ContextManager[None]:
    """While open, ``module``'s named parameters are the tensors of ``mapping``, as in ``torch.func.functional_call``
    (``torch.nn.utils.stateless._reparametrize_module``)."""
    return _reparametrize_module(module, mapping)


# ----------------------------------------------------------------------------------------------- autograd engine


def next_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread gets (``torch._C._autograd._get_sequence_nr``)."""
    return torch._C._autograd._get_sequence_nr()


def sequence_nr(node: Any) -> int:
    """An autograd node's sequence number, increasing in the order nodes are made (``Node._sequence_nr``)."""
    return node._sequence_nr()


def node_metadata(node: Any) -> dict:
    """An autograd node's own dict, where the package notes who made it (``Node.metadata``)."""
    return node.metadata


def current_graph_task_id() -> int:
    """The running backward's id, -1 outside one (``torch._C._current_graph_task_id``)."""
    return torch._C._current_graph_task_id()


def backward_running() -> bool:
    """Whether this thread is inside a backward (``torch._C._current_graph_task_id``)."""
    return torch._C._current_graph_task_id() >= 0


def after_backward(callback: Callable[[], None]) -> None:
    """Runs ``callback`` when the running backward finishes
    (``torch.autograd.Variable._execution_engine.queue_callback``)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def backward_reaches(node: Any) -> bool:
    """Whether the running backward executes ``node``; raises RuntimeError under ``torch.autograd.grad`` for a leaf's
    node (``torch._C._will_engine_execute_node``)."""
    return torch._C._will_engine_execute_node(node)


def legacy_reduction(size_average: Optional[bool], reduce: Optional[bool]) -> str:
    """A loss's ``reduction`` from its deprecated ``size_average``/``reduce`` arguments, as torch's losses read them
    (``torch.nn._reduction.legacy_get_string``)."""
    return _reduction.legacy_get_string(size_average, reduce)


def version_counter(t: torch.Tensor) -> int:
    """``t``'s version counter, bumped by every in-place change (``Tensor._version``)."""
    return t._version


def neg_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a lazily negated view of the same storage (``torch._neg_view``)."""
    return torch._neg_view(t)


# ------------------------------------------------------------------------------------------- dynamo and modes


def not_traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, which dynamo runs eagerly instead of tracing: one graph break (``torch._disable_dynamo``)."""
    return torch._disable_dynamo(fn)


def dynamo_tracing() -> bool:
    """Whether dynamo is tracing now (``torch._guards.TracingContext.try_get``)."""
    return torch._guards.TracingContext.try_get() is not None


def torch_function_disabled() -> ContextManager[None]:
    """While open, no ``__torch_function__`` mode or override runs (``torch._C.DisableTorchFunction``)."""
    return torch._C.DisableTorchFunction()


# --------------------------------------------------------------------------- functional collectives (under dynamo)


def functional_all_reduce(t: torch.Tensor, reduce_op: str, pg: Any) -> torch.Tensor:
    """The all-reduce dynamo traces into a graph (``torch.distributed._functional_collectives.all_reduce``)."""
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(t, reduce_op, pg)


def functional_broadcast(t: torch.Tensor, src: int, pg: Any) -> torch.Tensor:
    """The broadcast dynamo traces into a graph (``torch.distributed._functional_collectives.broadcast``)."""
    import torch.distributed._functional_collectives as fc

    return fc.broadcast(t, src, pg)


def functional_all_gather_op(t: torch.Tensor, size: int, pg: Any) -> torch.Tensor:
    """The ranks' ``t`` stacked along dim 0, waited on: the op under ``all_gather_tensor``, whose contiguity assert
    dynamo cannot trace in a backward (``torch.ops._c10d_functional.all_gather_into_tensor``)."""
    import torch.distributed._functional_collectives as fc

    gathered = torch.ops._c10d_functional.all_gather_into_tensor(t, size, fc._resolve_group_name(pg, ""))
    return fc.wait_tensor(gathered)


def differentiable_all_gather(t: torch.Tensor, size: int, pg: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ranks' ``t`` stacked along dim 0 by the all-gather op with its own autograd kernel: (the pending result,
    which carries the gradient; its values, waited on outside autograd, which has no kernel for the wait)
    (``torch.ops._c10d_functional_autograd.all_gather_into_tensor``)."""
    import torch.distributed._functional_collectives as fc

    pending = torch.ops._c10d_functional_autograd.all_gather_into_tensor(t, size, fc._resolve_group_name(pg, ""))
    return pending, fc.wait_tensor(pending.detach())


def waited(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a DTensor's in-flight local result waited on
    (``torch.distributed._functional_collectives.AsyncCollectiveTensor``)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


# ------------------------------------------------------------------------------------------------- distributed


def default_store() -> Any:
    """The default process group's c10d store (``torch.distributed.distributed_c10d._get_default_store``)."""
    return torch.distributed.distributed_c10d._get_default_store()


def chunk_size(total: int, parts: int, index: int) -> int:
    """The size of part ``index`` of ``total`` split as DTensor's ``Shard`` splits it, ``torch.chunk``'s way
    (``Shard._local_shard_size_on_dim``)."""
    from torch.distributed.tensor import Shard

    return Shard._local_shard_size_on_dim(total, parts, index)[0]
