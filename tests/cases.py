"""Shared inputs and the oracle comparison used by the checks that run inside the worker processes."""

import functools
import math
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.utils._pytree import tree_flatten


def assert_same(actual: Any, expected: Any, exact: bool = True, what: str = "") -> None:
    """Same pytree structure, and per leaf the same type, dtype, shape, device and values."""
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
        if exact:
            assert torch.equal(a, e), f"{what}: leaf {i}: values differ\n{a}\n{e}"
        else:
            torch.testing.assert_close(a, e, msg=lambda m: f"{what}: leaf {i}: {m}")


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


def equivalence_cases(B: int) -> List[Tuple[str, Callable, Tuple[Any, ...], Dict[str, Any], Dict[str, Any], bool]]:
    """(name, func, args, kwargs, cmap/vmap options, exact) covering the core matrix for batch size B."""
    x = randn(B, 4, seed=1)
    y = randn(B, 4, seed=2)
    w = randn(4, seed=3)
    xt = randn(4, B, seed=4)  # batch on dim 1
    nc = randn(4, B, 6, seed=5).transpose(0, 1)[:, :, ::2]  # non-contiguous, batch dim 0
    nested = {"a": x, "b": (y, randn(B, 2, 3, seed=6))}
    module = Tiny()
    return [
        ("dot", torch.dot, (x, y), {}, {}, True),
        ("in_dims None", torch.dot, (x, w), {}, {"in_dims": (0, None)}, False),
        ("in_dims nonzero", torch.dot, (xt, w), {}, {"in_dims": (1, None)}, False),
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
        ("module", module, (randn(B, 5, seed=8),), {}, {}, False),
        ("scalar per example", lambda a: a.sum(), (x,), {}, {}, True),
    ]
