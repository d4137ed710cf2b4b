"""Collectives over a named mapped axis, JAX-style: ``psum(x, "i")`` inside ``cmap(f, axis_name="i")``.

A reduction covers every example of the global batch: the ones vmapped on this rank and those on the other ranks.
Every example sees the same result. Under ``torch.vmap`` the ops run through a vmap rule
(``autograd.Function.vmap``) that reduces the local batch, then across ranks, with one collective; in "batched"
mode ``func`` sees plain batches (batch dim 0) and gets the result expanded to its rows; in "loop" mode each
example runs in its own thread and the threads meet at a barrier, so the ranks still make one collective per op.
"""

import threading
from typing import Any, Callable, List, Optional, Tuple

import torch

from . import comm
from .context import AxisFrame, lookup

__all__ = ["psum", "pmean", "pmax", "pmin", "all_gather", "axis_index", "axis_size"]

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def _identity(op: str, like: torch.Tensor) -> torch.Tensor:
    if op == "sum":
        return torch.zeros_like(like)
    if like.dtype == torch.bool:
        return torch.full_like(like, op == "min")
    info = torch.finfo(like.dtype) if like.is_floating_point() else torch.iinfo(like.dtype)
    return torch.full_like(like, info.min if op == "max" else info.max)


def _cross_rank(frame: AxisFrame, name: str, op: str, local: torch.Tensor) -> torch.Tensor:
    """Reduce ``local`` (this rank's contribution) across the frame's group."""
    if frame.group is None or frame.group.size == 1:
        return local
    comm.op_round(
        f"p{op}({name!r})",
        (tuple(local.shape), str(local.dtype)),
        frame.group,
        frame.device,
        frame.call,
        frame.timeout,
        frame.round_bytes,
    )
    out = local.contiguous().clone()
    reduce_op = getattr(torch.distributed.ReduceOp, _REDUCE_OPS[op])
    dtype = out.dtype
    if dtype == torch.bool:  # gloo reduces no bools
        out = out.to(torch.uint8)
    comm.all_reduce(out, frame.group, frame.call, frame.timeout, op=reduce_op)
    return out.to(dtype)


def _gather_rows(frame: AxisFrame, name: str, rows: torch.Tensor) -> torch.Tensor:
    """All-gather every rank's real rows (dim 0) in global order; shards may be uneven."""
    if frame.group is None or frame.group.size == 1:
        return rows
    sizes = list(frame.sizes)
    cap = max(sizes)
    comm.op_round(
        f"all_gather({name!r})",
        (tuple(rows.shape[1:]), str(rows.dtype)),
        frame.group,
        frame.device,
        frame.call,
        frame.timeout,
        frame.round_bytes,
    )
    send = torch.zeros((cap, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    send[: rows.shape[0]] = rows
    buf = torch.empty((frame.group.size * cap, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    comm.all_gather_into(buf, send, frame.group, frame.call, frame.timeout)
    return torch.cat([buf[r * cap : r * cap + n] for r, n in enumerate(sizes)])


def _sum_over_group(frame: AxisFrame, grad: torch.Tensor) -> torch.Tensor:
    """Backward of a replicated result: every rank holds its examples' share of its gradient; sum them."""
    if frame.group is None or frame.group.size == 1:
        return grad
    total = grad.contiguous().clone()
    comm.all_reduce(total, frame.group, frame.call, frame.timeout)
    return total


class _Reduce(torch.autograd.Function):
    """Physical op: ``x`` holds this run's rows on dim 0; returns the global reduction (no batch dim)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str, op: str) -> torch.Tensor:
        frame = lookup(name, f"p{op}")
        empty = frame.dummy or x.shape[0] == 0
        local = _identity(op, x.new_empty(x.shape[1:])) if empty else _local_reduce(op, x)
        ctx.name, ctx.op, ctx.rows, ctx.dummy = name, op, x.shape[0], frame.dummy
        ctx.frame = frame
        return _cross_rank(frame, name, op, local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None]:
        if ctx.op != "sum":
            raise RuntimeError(
                f"p{ctx.op}({ctx.name!r}) is not differentiable; use psum/pmean/all_gather, or detach its input."
            )
        total = _sum_over_group(ctx.frame, grad)
        if ctx.dummy:
            total = torch.zeros_like(total)
        return total.unsqueeze(0).expand(ctx.rows, *total.shape), None, None


class _Gather(torch.autograd.Function):
    """Physical op: ``x`` holds this run's rows on dim 0; returns all B rows in global order."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:
        frame = lookup(name, "all_gather")
        real = x[:0] if frame.dummy else x
        ctx.frame, ctx.rows, ctx.dummy = frame, x.shape[0], frame.dummy
        return _gather_rows(frame, name, real)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None]:
        frame = ctx.frame
        total = _sum_over_group(frame, grad)
        if ctx.dummy:
            return torch.zeros((ctx.rows, *grad.shape[1:]), dtype=grad.dtype, device=grad.device), None
        return total.narrow(0, frame.offset, frame.rows), None


def _local_reduce(op: str, x: torch.Tensor) -> torch.Tensor:
    if op == "sum":
        return x.sum(0)
    if x.dtype == torch.bool:
        return x.any(0) if op == "max" else x.all(0)
    return x.amax(0) if op == "max" else x.amin(0)


class _Batched(torch.autograd.Function):
    """The user-facing op under ``torch.vmap``: its vmap rule calls the physical op on the unwrapped batch."""

    @staticmethod
    def forward(x: torch.Tensor, name: str, op: str) -> torch.Tensor:
        # Not batched (every example holds the same x): the result is known without communication.
        frame = lookup(name, op)
        if op == "gather":
            return x.unsqueeze(0).expand(frame.size, *x.shape).clone()
        return x * frame.size if op == "sum" else x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.name, ctx.op = inputs[1], inputs[2]
        ctx.size = lookup(inputs[1], inputs[2]).size

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None]:
        if ctx.op == "gather":
            return grad.sum(0), None, None
        if ctx.op != "sum":
            raise RuntimeError(f"p{ctx.op}({ctx.name!r}) is not differentiable.")
        return grad * ctx.size, None, None

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], x: torch.Tensor, name: str, op: str) -> Tuple[Any, Any]:
        dim = in_dims[0]
        if dim is None:
            return _Batched.apply(x, name, op), None
        rows = x.movedim(dim, 0)
        if op == "gather":
            return _Gather.apply(rows, name), None
        return _Reduce.apply(rows, name, op), None


def _apply(x: torch.Tensor, name: str, op: str) -> torch.Tensor:
    frame = lookup(name, "all_gather" if op == "gather" else f"p{op}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}(x, {name!r}): x must be a Tensor, got {type(x).__name__}.")
    if frame.mode == "batched":
        rows = x.shape[0]
        out = _Gather.apply(x, name) if op == "gather" else _Reduce.apply(x, name, op)
        return out.unsqueeze(0).expand(rows, *out.shape)
    if frame.mode == "loop" and not _is_batched(x):
        return frame.loop.run(
            x, lambda stacked: _Gather.apply(stacked, name) if op == "gather" else _Reduce.apply(stacked, name, op)
        )
    return _Batched.apply(x, name, op)


def _is_batched(x: torch.Tensor) -> bool:
    return torch._C._functorch.is_batchedtensor(x)


def psum(x: torch.Tensor, axis_name: str) -> torch.Tensor:
    """Sum of ``x`` over every example of the global batch (all ranks); every example gets the same value.

    Example:
        >>> cmap(lambda x: x / psum(x.sum(), "i"), axis_name="i")(torch.rand(10, 3))  # normalise by the total
    """
    return _apply(x, axis_name, "sum")


def pmean(x: torch.Tensor, axis_name: str) -> torch.Tensor:
    """Mean of ``x`` over every example of the global batch."""
    return psum(x, axis_name) / axis_size(axis_name)


def pmax(x: torch.Tensor, axis_name: str) -> torch.Tensor:
    """Elementwise maximum over every example of the global batch. Not differentiable."""
    return _apply(x, axis_name, "max")


def pmin(x: torch.Tensor, axis_name: str) -> torch.Tensor:
    """Elementwise minimum over every example of the global batch. Not differentiable."""
    return _apply(x, axis_name, "min")


def all_gather(x: torch.Tensor, axis_name: str) -> torch.Tensor:
    """Every example's ``x`` stacked along a new dim 0, in global order: shape ``(B, *x.shape)``."""
    return _apply(x, axis_name, "gather")


def axis_index(axis_name: str) -> torch.Tensor:
    """The global index of the current example along ``axis_name`` (an int64 scalar tensor per example)."""
    frame = lookup(axis_name, "axis_index")
    if frame.index is None:
        raise RuntimeError(f"axis_index({axis_name!r}) is only available inside the mapped function.")
    return frame.loop.index() if frame.mode == "loop" and frame.loop is not None else frame.index


def axis_size(axis_name: str) -> int:
    """The global batch size B along ``axis_name`` (not the number of ranks)."""
    return lookup(axis_name, "axis_size").size


class LoopBarrier:
    """Loop mode: one thread per example; a collective waits for all of them, then runs once on the stack."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._local = threading.local()
        self._slots: List[Any] = [None] * count
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self._barrier = threading.Barrier(count, action=self._act)

    def set_index(self, i: int, index: torch.Tensor) -> None:
        self._local.i, self._local.index = i, index

    def index(self) -> torch.Tensor:
        return self._local.index

    def run(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.count == 1:
            return fn(x.unsqueeze(0))
        self._slots[self._local.i] = x
        self._fn = fn
        self._barrier.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def _act(self) -> None:
        try:
            if any(s.requires_grad for s in self._slots) and torch.is_grad_enabled():
                raise RuntimeError(
                    "collectives in mode='loop' are not differentiable; use mode='vmap' or "
                    "'batched', or run under torch.no_grad()."
                )
            with torch.no_grad():
                self._result, self._error = self._fn(torch.stack(self._slots)), None
        except BaseException as exc:  # re-raised in every example thread
            self._result, self._error = None, exc

    def abort(self) -> None:
        self._barrier.abort()
