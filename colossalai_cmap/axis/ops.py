"""Every named-axis collective as func calls it, per example: one autograd Function run by each op's rules.

A mapped axis runs over every example of the global batch: the ones this rank maps and those on the other ranks.
Under ``torch.vmap`` an op is :class:`AxisOp`, an autograd Function that looks up the op's :class:`~.rules.AxisRule`
and follows it: its vmap rule, at the vmap level of the axis's own cmap, turns the batch of local examples into
one exchange (the rule's rows, :mod:`.lowering`). At any other vmap level (a cmap nested inside, an outer
``torch.vmap``, or the axis of an outer cmap seen from an inner one) the level's dim rides along as a leading data
dim (the rule's batching), and the op goes on to the level of its axis. Its backward and forward-mode rules are
jax's transposes, written with the table's ops (the rule's transpose), so ``torch.func.grad`` inside func, double
backward and function transforms compose. In "batched" mode func sees the batch as dim 0, and in "loop" mode the
examples run in threads that meet at each collective (the frame's loop). Along a ``shard_map`` mesh axis ("rank"
mode) each rank is one member of the axis, and func's plain tensor is its one row.
"""

from typing import Any, Optional, Tuple

import torch

from ..torch_internals import current_level, is_batched, level_of, transform_levels
from .frame import AxisFrame, lookup
from .lowering import lower_rows, traced_vmap
from .rules import rule_of


def processed_level() -> int:
    """Inside a vmap rule: the vmap level being lowered (functorch runs the rule one level below it)."""
    return (current_level() or 0) + 1


class AxisOp(torch.autograd.Function):
    """One collective as func sees it, per example, following the rule of ``op`` (a name of the table); see the
    module docstring. ``arg`` parametrises the per-example ops."""

    @staticmethod
    def forward(x: torch.Tensor, name: str, op: str, arg: Any = None) -> torch.Tensor:
        # Not batched at the axis's level: every example holds the same x, so the result needs no communication.
        # (The per-example ops are always given a value batched at the axis's level: see batched_at_axis.)
        rule = rule_of(op)
        return rule.unbatched(x, lookup(name, rule.name).size)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.name, ctx.op = inputs[1], inputs[2]
        ctx.arg = inputs[3] if len(inputs) > 3 else None

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None]:
        return transpose(grad, ctx.name, ctx.op, ctx.arg), None, None, None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        rule = rule_of(ctx.op)
        if not rule.differentiable:
            raise RuntimeError(f"{rule.label(ctx.name)} is not differentiable.")
        if rule.per_example:
            return apply(tangent, ctx.name, ctx.op, ctx.arg)
        return AxisOp.apply(tangent, ctx.name, ctx.op, ctx.arg)

    @staticmethod
    def vmap(
        info: Any, in_dims: Tuple[Optional[int], ...], x: torch.Tensor, name: str, op: str, arg: Any = None
    ) -> Tuple[Any, Any]:
        dim = in_dims[0]
        if dim is None:
            return AxisOp.apply(x, name, op, arg), None
        rule = rule_of(op)
        rows = x.movedim(dim, 0)
        frame = lookup(name, rule.name)
        if frame.level is not None and processed_level() != frame.level:
            # another map's vmap level: its dim rides along while the op goes on to its own axis's level
            inner_arg, out_dim = rule.batching(arg)
            return AxisOp.apply(rows, name, op, inner_arg), out_dim
        out = lower_rows(frame, rows, rule, name, arg)
        return out, (0 if rule.per_example else None)


def transpose(grad: torch.Tensor, name: str, op: str, arg: Any) -> torch.Tensor:
    """jax's transpose of ``op``, per example, written with the table's ops (so it is differentiable again)."""
    rule = rule_of(op)
    if rule.transpose is None:
        raise RuntimeError(f"{rule.label(name)} is not differentiable; use psum, pmean or all_gather.")
    by = rule.transpose
    return by.arrange(apply(grad, name, by.op, by.arg(arg)), arg)


def index(name: str) -> torch.Tensor:
    """The global index of the current example along the axis ``name`` (an int64 scalar tensor per example)."""
    frame = lookup(name, "axis_index")
    if frame.index is None:
        raise RuntimeError(f"axis_index({name!r}) is only available inside the mapped function.")
    return frame.loop.index() if frame.mode.in_turns and frame.loop is not None else frame.index


def apply(x: torch.Tensor, name: str, op: str, arg: Any = None) -> torch.Tensor:
    """The op (a name of the table) on ``x`` in the axis's mode."""
    rule = rule_of(op)
    frame = lookup(name, rule.name)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{rule.name}(x, {name!r}): x must be a Tensor, got {type(x).__name__}.")
    if frame.mode.per_rank:  # a shard_map axis: this rank is one member of it, and func holds its own value
        out = lower_rows(frame, x.unsqueeze(0), rule, name, arg)
        return out.squeeze(0) if rule.per_example else out
    if frame.mode.holds_rows:
        out = lower_rows(frame, x, rule, name, arg)
        return out if rule.per_example else out.unsqueeze(0).expand(x.shape[0], *out.shape)
    if frame.mode.in_turns and not is_batched(x):
        return frame.loop.run(x, lambda stacked: lower_rows(frame, stacked, rule, name))
    if torch.compiler.is_compiling():
        return traced_vmap(frame, x, rule, name, arg)
    if rule.per_example:
        x = batched_at_axis(frame, x)
    return AxisOp.apply(x, name, op, arg)


def batched_at_axis(frame: AxisFrame, x: torch.Tensor) -> torch.Tensor:
    """``x`` batched at the axis's own vmap level: a per-example op gives each example its own part, so its vmap rule
    must run there even when every example holds the same ``x`` (adding the zero of a batched index makes it so)."""
    if any(is_batched(t) and level_of(t) == frame.level for t in transform_levels(x)):
        return x
    return x + (frame.index * 0).to(x.dtype)
