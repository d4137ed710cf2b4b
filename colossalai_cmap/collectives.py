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

from .context import lookup
from .exchange import JoinSpec, ScatterSpec
from .primitives import joined, scattered
from .protocol import Kind
from .roles import COPY, MAX, MIN, Rows

__all__ = ["psum", "pmean", "pmax", "pmin", "all_gather", "axis_index", "axis_size"]

_ROLES = {"sum": COPY, "max": MAX, "min": MIN}


def _identity(op: str, like: torch.Tensor) -> torch.Tensor:
    if like.dtype == torch.bool:
        return torch.full_like(like, op == "min")
    info = torch.finfo(like.dtype) if like.is_floating_point() else torch.iinfo(like.dtype)
    return torch.full_like(like, info.min if op == "max" else info.max)


def _local_reduce(op: str, rows: torch.Tensor) -> torch.Tensor:
    if op == "sum":
        return rows.sum(0)
    if rows.shape[0] == 0:
        return _identity(op, rows.new_empty(rows.shape[1:]))
    if rows.dtype == torch.bool:
        return rows.any(0) if op == "max" else rows.all(0)
    return rows.amax(0) if op == "max" else rows.amin(0)


def _reduce(rows: torch.Tensor, name: str, op: str) -> torch.Tensor:
    """This run's rows (dim 0) reduced over every example of the global batch.

    A sum is ``Scatter(Join(.))``: per-rank partial sums joined into the global sum, which every rank then uses as its
    own value, so its backward sums the cotangents over the group too. An empty shard's stand-in contributes nothing,
    through its graph (zero rows), so that backward still meets on every rank.
    """
    frame = lookup(name, f"p{op}")
    local = _local_reduce(op, rows[:0] if frame.dummy else rows)
    if frame.link is None or frame.link.group.size == 1:
        return local
    (total,) = joined(JoinSpec(frame.link, (_ROLES[op],), f"p{op}({name!r})", Kind.OP), [local])
    if op != "sum":
        return total
    return scattered(ScatterSpec(frame.link, (COPY,)), [total])[0]


def _gather(rows: torch.Tensor, name: str) -> torch.Tensor:
    """Every rank's real rows (dim 0) in global order (shares may be uneven); backward sums, then takes the rows."""
    frame = lookup(name, "all_gather")
    real = rows[:0] if frame.dummy else rows
    if frame.link is None or frame.link.group.size == 1:
        return real
    spec = JoinSpec(frame.link, (Rows(0, tuple(frame.sizes)),), f"all_gather({name!r})", Kind.OP)
    (full,) = joined(spec, [real])
    return scattered(ScatterSpec(frame.link, (COPY,)), [full])[0]


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
        return (_gather(rows, name) if op == "gather" else _reduce(rows, name, op)), None


def _apply(x: torch.Tensor, name: str, op: str) -> torch.Tensor:
    frame = lookup(name, "all_gather" if op == "gather" else f"p{op}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}(x, {name!r}): x must be a Tensor, got {type(x).__name__}.")
    if frame.mode == "batched":
        out = _gather(x, name) if op == "gather" else _reduce(x, name, op)
        return out.unsqueeze(0).expand(x.shape[0], *out.shape)
    if frame.mode == "loop" and not _is_batched(x):
        return frame.loop.run(
            x, lambda stacked: _gather(stacked, name) if op == "gather" else _reduce(stacked, name, op)
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
