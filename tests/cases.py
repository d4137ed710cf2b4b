"""Shared inputs and the oracle comparison used by the checks that run inside the worker processes."""

import functools
import math
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch.utils._pytree import tree_flatten


def assert_same(actual: Any, expected: Any, exact: Union[bool, Dict[str, float]] = True, what: str = "") -> None:
    """Same pytree structure, and per leaf the same type, dtype, shape, device and values.

    ``exact``: True compares values bit for bit; a dict gives assert_close's tolerances (e.g. ``sum_tolerance``);
    False takes assert_close's defaults, where no sum is added in another order (a few roundings at most).
    """
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    assert a_spec == e_spec, f"{what}: structure {a_spec} != {e_spec}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        assert type(a) is type(e), f"{what}: leaf {i}: type {type(a)} != {type(e)}"
        if not isinstance(e, torch.Tensor):
            assert a == e, f"{what}: leaf {i}: {a!r} != {e!r}"
            continue
        assert a.dtype == e.dtype, f"{what}: leaf {i}: dtype {a.dtype} != {e.dtype}"
        assert a.shape == e.shape, f"{what}: leaf {i}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        assert a.device == e.device, f"{what}: leaf {i}: device {a.device} != {e.device}"
        if exact is True:
            assert torch.equal(a, e), f"{what}: leaf {i}: values differ\n{a}\n{e}"
        else:
            torch.testing.assert_close(a, e, **(exact or {}), msg=lambda m: f"{what}: leaf {i}: {m}")


# torch.testing.assert_close's default rtol per dtype: a few roundings of the elementwise ops around a sum.
_RTOL = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2, torch.float32: 1.3e-6, torch.float64: 1e-7}


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """gamma_n = n u / (1 - n u), u = eps / 2: a sum of n terms, or a dot product of length n (its products
    included), computed in any order, blocking or with fused multiply-adds, is within gamma_n * sum|terms| of the
    exact value."""
    u = torch.finfo(dtype).eps / 2
    return n * u / (1 - n * u)


def sum_tolerance(n: int, scale: Any, dtype: torch.dtype = torch.float32) -> Dict[str, float]:
    """assert_close tolerances for two evaluations of the same sum of ``n`` terms that may add them in different
    orders: a batch split over ranks and then all-reduced, a sum over a sharded dimension, a matmul that BLAS blocks
    differently for another number of rows. Each is within gamma_n * sum|terms| of the exact sum, so they differ by
    at most 2 * gamma_n * sum|terms| (about n * eps * sum|terms|), on any machine.

    ``scale`` is sum|terms|: a number, or a tensor with one per result (its largest entry is taken). rtol stays
    torch's default for the dtype: the few roundings of elementwise ops applied after the sum.
    """
    if torch.is_tensor(scale):
        scale = float(scale.abs().max()) if scale.numel() else 0.0
    return {"atol": 2 * gamma(n, dtype) * scale, "rtol": _RTOL[dtype]}


def linear_scale(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sum|terms| of each entry of ``F.linear(x, weight, bias)``: a sum of in_features + 1 terms (with a bias)."""
    s = x.double().abs() @ weight.double().abs().T  # in float64: the bound itself must not round low
    return s if bias is None else s + bias.double().abs()


def batch_sum_tolerance(per_example: torch.Tensor, dtype: Optional[torch.dtype] = None) -> Dict[str, float]:
    """``sum_tolerance`` for a sum over the batch (dim 0) of these per-example terms: a parameter's gradient (the
    sum of its per-example gradients), a closure's, an in_dims=None input's, a psum."""
    scale = per_example.double().abs().sum(0)
    return sum_tolerance(max(per_example.shape[0], 1), scale, dtype or per_example.dtype)


# Parity of computations that chain sums with nonlinear ops (models, training steps, gradients of gradients) is
# checked in float64. There, reordering any sum of n <= 1000 terms with sum|terms| <= 1000 moves it by at most
# 2 * gamma_1000(float64) * 1000 < 3e-10 (sum_tolerance), so torch's float64 tolerances (1e-7, absolute and
# relative) leave a factor over 300 for what the ops after the sum can amplify it. Adam(W)'s update moves by at most
# (1 + |m_hat| / sqrt(v_hat)) * lr / eps per unit of change in one gradient entry (a few times 1e5 at lr 1e-3 and
# eps 1e-8; see adam_drift_bound for |m_hat| / sqrt(v_hat)), which keeps a float64 rounding difference far under
# 1e-7 over a few steps too. A wrong shard, a missing or doubled partial sum or a factor of P changes results by far
# more. In float32 the same sums may move by 0.1: no fixed tolerance could tell rounding from a bug there.
F64 = dict(atol=1e-7, rtol=1e-7)


def adam_drift_bound(lr: float, betas: Tuple[float, float], steps: int) -> float:
    """How far apart two Adam(W) runs that start equal can move one parameter in ``steps`` steps, whatever their
    gradients: twice the largest update per step, summed. Rounding that differs between machines can flip a tiny
    gradient entry's sign, and Adam divides each entry by its own magnitude, so no tighter bound holds per element.

    By Cauchy-Schwarz, at step t: |m_hat / sqrt(v_hat)| <= (1 - b1) / (1 - b1^t) * sqrt(sum_k (b1^2 / b2)^k)
    * sqrt((1 - b2^t) / (1 - b2)), k < t (1 at t = 1, where the update is lr * sign(g)); eps only shrinks it, and
    decoupled weight decay shrinks a difference.
    """
    b1, b2 = betas
    total = 0.0
    for t in range(1, steps + 1):
        s = sum((b1 * b1 / b2) ** k for k in range(t))
        total += 2 * lr * (1 - b1) / (1 - b1**t) * math.sqrt(s) * math.sqrt((1 - b2**t) / (1 - b2))
    return total


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _scale(x: torch.Tensor, s: float, bias: torch.Tensor) -> torch.Tensor:
    return x * s + bias


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.linear = torch.nn.Linear(5, 3)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(3, 5, generator=g))
            self.linear.bias.copy_(torch.randn(3, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def equivalence_cases(B: int) -> List[Tuple[str, Callable, Tuple[Any, ...], Dict[str, Any], Dict[str, Any], Any]]:
    """(name, func, args, kwargs, cmap/vmap options, exact) covering the core matrix for batch size B.

    ``exact`` is ``assert_same``'s: True where each example's result comes from the same ops on the same values as
    in vmap over the whole batch (elementwise ops, per-row reductions, a dot of two mapped vectors, which vmap runs
    as a batched matmul whose small-size kernel loops over each row alike). Where vmap turns the per-example work into
    one BLAS call over the batch (a dot with an unmapped vector is a matrix-vector product, a Linear an addmm), BLAS
    may block a shard's rows otherwise than the whole batch's: the tolerance of a dot of that length.
    """
    x = randn(B, 4, seed=1)
    y = randn(B, 4, seed=2)
    w = randn(4, seed=3)
    xt = randn(4, B, seed=4)  # batch on dim 1
    nc = randn(4, B, 6, seed=5).transpose(0, 1)[:, :, ::2]  # non-contiguous, batch dim 0
    nested = {"a": x, "b": (y, randn(B, 2, 3, seed=6))}
    module = Tiny()
    x_module = randn(B, 5, seed=8)
    dot_w = sum_tolerance(4, linear_scale(x, w[None]))
    dot_w_t = sum_tolerance(4, linear_scale(xt.T, w[None]))
    linear = sum_tolerance(6, linear_scale(x_module, module.linear.weight.detach(), module.linear.bias.detach()))
    return [
        ("dot", torch.dot, (x, y), {}, {}, True),
        ("in_dims None", torch.dot, (x, w), {}, {"in_dims": (0, None)}, dot_w),
        ("in_dims nonzero", torch.dot, (xt, w), {}, {"in_dims": (1, None)}, dot_w_t),
        ("in_dims negative", lambda a, b: a * b, (xt, y), {}, {"in_dims": (-1, 0)}, True),
        ("out_dims nonzero", lambda a: a.outer(a), (x,), {}, {"out_dims": 1}, True),
        ("out_dims negative", lambda a: a.outer(a), (x,), {}, {"out_dims": -1}, True),
        ("out_dims tuple", lambda a, b: (a + b, a.sum()), (x, y), {}, {"out_dims": (1, 0)}, True),
        ("dict output", lambda a: {"s": a.sum(), "p": (a * 2, a.max())}, (x,), {}, {}, True),
        (
            "nested inputs",
            lambda t: t["a"] * t["b"][0] + t["b"][1].sum(),
            (nested,),
            {},
            {"in_dims": ({"a": 0, "b": (0, 0)},)},
            True,
        ),
        ("non-contiguous", lambda a: a.cumsum(0), (nc,), {}, {}, True),
        ("float64", lambda a: a.exp(), (x.double(),), {}, {}, True),
        ("bfloat16", lambda a: a * 3, (x.bfloat16(),), {}, {}, True),
        ("int64", lambda a: a * 2 + 1, ((x * 10).long(),), {}, {}, True),
        ("bool", lambda a: a > 0, (x,), {}, {}, True),
        ("mixed dtypes", lambda a: (a > 0, (a * 10).long(), a.half()), (x,), {}, {}, True),
        ("kwargs", _scale, (x,), {"s": 2.5, "bias": w}, {}, True),
        ("partial", functools.partial(_scale, s=0.5, bias=w), (x,), {}, {}, True),
        ("module", module, (x_module,), {}, {}, linear),  # relu after the addmm: 1-Lipschitz
        ("scalar per example", lambda a: a.sum(), (x,), {}, {}, True),
    ]
