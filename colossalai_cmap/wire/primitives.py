"""The two communication primitives, ``Split`` and ``Join``, as autograd Functions that compose with functorch.

Each is a ``torch.autograd.Function`` in the ``setup_context`` style, with ``backward``, ``jvp`` and ``vmap`` rules,
so that torch's autograd and torch.func handle everything around them: closures, higher-order gradients,
``grad``/``vjp``/``jvp``/``jacrev``/``jacfwd``/``hessian``, an outer ``torch.vmap`` and nesting. The backward of each
is the other (:mod:`roles` has the transpose of every role), built from ``apply`` calls, so double backward works.
``Join`` moves data in one round (:mod:`protocol`), and a second collective only for what does not fit.

:func:`join` and :func:`split` are what the layers above call: the Functions where a derivative or a function
transform needs them, else the plain ``join_values`` and ``split_values`` (:mod:`.exchange`), without the Function
machinery.
"""

from typing import Any, Callable, Optional, Sequence, Tuple

import torch
import torch.autograd.forward_ad as fwAD

from .exchange import JoinSpec, SplitSpec, join_values, local_transpose, split_values
from .roles import join_transpose, shifted, split_transpose


# --------------------------------------------------------------------------------------- differentiable versions
def requires_grad(t: Any) -> bool:
    """Whether ``t`` requires grad at any autograd level (a vmap wrapper hides its inner tensor's flag)."""
    if not isinstance(t, torch.Tensor):
        return False
    while not t.requires_grad:
        if not torch._C._functorch.is_functorch_wrapped_tensor(t):
            return False
        t = torch._C._functorch.get_unwrapped(t)
    return True


def needs_function(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the Function machinery is needed: a derivative to track, or a function transform to obey."""
    if torch._C._functorch.maybe_current_level() is not None:
        return True
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def join(spec: JoinSpec, tensors: Sequence[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """Per-rank values to global ones: :class:`Join` where a derivative or a function transform needs it (never
    with a ``dst``: only that rank gets the result, so no backward could meet), else the plain exchange."""
    if spec.dst == -1 and needs_function(tensors):
        return Join.apply(spec, *tensors)
    return join_values(spec, tensors)


def split(spec: SplitSpec, tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """Global values to per-rank ones: :class:`Split` where a derivative or a function transform needs it."""
    return Split.apply(spec, *tensors) if needs_function(tensors) else split_values(spec, tensors)


def _non_differentiable(ctx: Any, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
    """Outputs that carry no derivative, as vmap's would: integer ones, and (outside function transforms and
    forward-mode AD) those whose input needs none, so that ``requires_grad`` comes back as the input had it."""
    plain = torch._C._functorch.maybe_current_level() is None and fwAD._current_level < 0
    fixed = [
        o
        for o, x in zip(outputs, inputs)
        if isinstance(o, torch.Tensor)
        and (not (o.is_floating_point() or o.is_complex()) or (plain and not x.requires_grad))
    ]
    if fixed:
        ctx.mark_non_differentiable(*fixed)


def _wanted(ctx: Any, grads: Sequence[Any]) -> list:
    return [i for i, g in enumerate(grads) if ctx.needs_input_grad[i + 1] and g is not None]


def _spread(picked: Sequence[int], values: Sequence[Any], count: int) -> Tuple[Any, ...]:
    out: list = [None] * count
    for i, v in zip(picked, values):
        out[i] = v
    return (None, *out)


def _vmapped(apply: Callable, spec: Any, in_dims: Sequence[Optional[int]], xs: Sequence[Any]) -> Tuple[Any, Any]:
    """Both vmap rules: each batched tensor's vmap dim goes to the front, row dims shift by one; one collective."""
    batched = [d is not None for d in in_dims[1:]]
    moved = [x.movedim(d, 0) if d is not None else x for x, d in zip(xs, in_dims[1:])]
    out = apply(spec._replace(roles=shifted(spec.roles, batched)), *moved)
    return out, tuple(0 if b else None for b in batched)


class Join(torch.autograd.Function):
    """Per-rank values to global ones (see :mod:`roles`); backward is :class:`Split`."""

    @staticmethod
    def forward(spec: JoinSpec, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return tuple(o if o is not x else x.view_as(x) for o, x in zip(join_values(spec, xs), xs))

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]
        ctx.like = [(x.shape, x.dtype, x.device) for x in inputs[1:]]  # zeros for a missing tangent
        _non_differentiable(ctx, inputs[1:], output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        spec, picked = ctx.spec, _wanted(ctx, grads)
        sized = spec.sized_roles()
        roles = [join_transpose(sized[i]) for i in picked]
        out = Split.apply(SplitSpec(spec.link, tuple(roles)), *[grads[i] for i in picked]) if picked else ()
        return _spread(picked, out, len(grads))

    @staticmethod
    def jvp(ctx: Any, _: Any, *tangents: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        # Every rank joins every tangent (zeros where one has none): a peer's may be set where this one's is not.
        full = [t if t is not None else torch.zeros(s, dtype=d, device=v) for t, (s, d, v) in zip(tangents, ctx.like)]
        sub = JoinSpec(ctx.spec.link, ctx.spec.sized_roles(), f"the tangents of {ctx.spec.what}", sync=True)
        return tuple(Join.apply(sub, *full))

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], spec: JoinSpec, *xs: torch.Tensor) -> Tuple[Any, Any]:
        return _vmapped(Join.apply, spec, in_dims, xs)


class Split(torch.autograd.Function):
    """Global values to this rank's per-rank values (see :mod:`roles`); backward is :class:`Join`."""

    @staticmethod
    def forward(spec: SplitSpec, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return tuple(o if o is not x else x.view_as(x) for o, x in zip(split_values(spec, xs), xs))

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]
        owner = inputs[0].owner
        if owner is not None:
            ctx._cmap_owner = owner
            if owner.running:
                owner.note_entry(inputs[0], inputs[1:], output)
        ctx.set_materialize_grads(False)  # an unused value gets no gradient (None), as without cmap
        _non_differentiable(ctx, inputs[1:], output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        spec, picked = ctx.spec, _wanted(ctx, grads)
        if spec.owner is not None and spec.owner.running:  # a gradient taken inside func: per example, here
            return _spread(picked, [local_transpose(spec, spec.roles[i], grads[i]) for i in picked], len(grads))
        roles = tuple(split_transpose(spec.roles[i]) for i in picked)
        out = Join.apply(JoinSpec(spec.link, roles), *[grads[i] for i in picked]) if picked else ()
        return _spread(picked, out, len(grads))

    @staticmethod
    def jvp(ctx: Any, _: Any, *tangents: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        spec = ctx.spec
        picked = [i for i, t in enumerate(tangents) if t is not None]
        sub = SplitSpec(spec.link, tuple(spec.roles[i] for i in picked))
        out = Split.apply(sub, *[tangents[i] for i in picked]) if picked else ()
        return _spread(picked, out, len(tangents))[1:]

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], spec: SplitSpec, *xs: torch.Tensor) -> Tuple[Any, Any]:
        return _vmapped(Split.apply, spec, in_dims, xs)


class _Refused(torch.autograd.Function):
    """Identity forward; backward raises the message (no collective is involved, so nothing can hang)."""

    @staticmethod
    def forward(message: str, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.message = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, ...]:
        raise RuntimeError(ctx.message)


def not_differentiable(value: Any, message: str) -> Any:
    """``value`` marked so that backpropagating through it raises ``message``."""
    if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
        return value
    return _Refused.apply(message, value.detach().requires_grad_())


__all__ = ["Join", "Split", "join", "split", "requires_grad", "not_differentiable"]
