"""``torch.compile(shard_map(f), fullgraph=True)``: one graph with no break, eager shard_map's values and gradients.

Real gloo worlds of 4 ranks on a 2 x 2 mesh ("x", "y"), in float64, against the eager shard_map (``check_vma=True``,
the default, and ``check_vma=False``) and the unsharded computation on the same numbers. The compiled call runs the
same block ops; what may differ is the order of a sum over ranks (gloo's all-reduce against the eager protocol's)
and aot_eager's decompositions of a matmul: every value is a sum of at most 8 products of three inputs drawn from
a normal distribution (|x| < 6), so the difference is at most 2 * gamma_8(float64) * 8 * 6^3 < 1e-11, far under
the float64 tolerance (cases.F64). Each compile costs seconds here, so the cases share compiles: one compile per
case, counted by dynamo's ``CompileCounterWithBackend`` (a recompile or a graph break would count two frames).
"""

from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch._dynamo.testing
from cases import F64, randn
from shard_cases import mesh

import colossalai_cmap as cm
from colossalai_cmap import P

DOUBLE = torch.float64


def _close(got: Any, want: Any, what: str) -> None:
    torch.testing.assert_close(got, want, **F64, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------------------------------- the cases
def megatron(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Megatron's MLP: batch over "x", columns of w1 and rows of w2 over "y", one psum."""
    return cm.psum(torch.tanh(x @ w1) @ w2, "y")


def fsdp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """FSDP: batch and weights over both axes, each weight all-gathered (tiled) before use."""
    full1 = cm.all_gather(w1, ("x", "y"), tiled=True)
    return torch.tanh(x @ full1) @ cm.all_gather(w2, ("x", "y"), tiled=True)


def scattered(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Megatron's MLP with its psum scattered over the batch (sequence parallelism's reduce-scatter)."""
    return cm.psum_scatter(torch.tanh(x @ w1) @ w2, "y", scatter_dimension=0, tiled=True)


def many(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """The other collectives, each on a varying block: ppermute, all_to_all, axis_index, pcast, all_gather_invariant,
    pmean, pmax (no gradient), pbroadcast."""
    h = torch.tanh(x @ w1)  # (2, 4) per rank
    shifted = cm.ppermute(h, "x", [(0, 1), (1, 0)])
    swapped = cm.all_to_all(h, "y", 0, 0, tiled=True)
    ranked = h * (1 + cm.axis_index("y")) + cm.pmax(h.detach(), "x")
    cast = cm.pcast(w2.sum(), "y", to="varying") * h
    whole = cm.all_gather_invariant(h, "y", tiled=True)  # invariant over "y"
    return shifted + ranked + cast, swapped, cm.pmean(whole, "x"), cm.pbroadcast(h, "x", 1)


def _mlp_args() -> Tuple[torch.Tensor, ...]:
    return (
        randn(4, 8, seed=1, dtype=DOUBLE),
        randn(8, 8, seed=2, dtype=DOUBLE) / 3,
        randn(8, 8, seed=3, dtype=DOUBLE) / 3,
    )


def _unsharded(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w1) @ w2


# name: (f, in_specs, out_specs, the unsharded reference or None)
CASES: Dict[str, Tuple[Callable, Any, Any, Any]] = {
    "megatron": (megatron, (P("x"), P(None, "y"), P("y", None)), P("x"), _unsharded),
    "fsdp": (fsdp, (P(("x", "y")), P(("x", "y")), P(("x", "y"))), P(("x", "y")), _unsharded),
    "psum_scatter": (scattered, (P(), P(None, "y"), P("y", None)), P("y"), _unsharded),
    "collectives": (
        many,
        (P("x"), P(None, "y"), P()),
        (P("x", "y"), P("x", "y"), P(None, None), P("x", "y")),
        None,
    ),
}


def _loss(out: Any) -> torch.Tensor:
    """A loss that weighs every output leaf differently, so a gradient routed to the wrong leaf shows."""
    flat = torch.utils._pytree.tree_leaves(out)
    return sum(((v.sin() * (k + 1)).sum() for k, v in enumerate(flat)), torch.zeros((), dtype=DOUBLE))


def _grads(fn: Callable, args: Tuple[torch.Tensor, ...]) -> Tuple[Any, List[torch.Tensor]]:
    leaves = [a.clone().requires_grad_() for a in args]
    out = fn(*leaves)
    _loss(out).backward()
    return torch.utils._pytree.tree_map(torch.Tensor.detach, out), [a.grad for a in leaves]


def check_case(name: str, check_vma: bool, backend: str) -> int:
    """Compiled = eager shard_map = the unsharded computation, values and every input's gradient, on every rank; one
    frame compiled with fullgraph=True; returns dynamo's frame count."""
    f, in_specs, out_specs, ref = CASES[name]
    args = _mlp_args()
    sm = cm.shard_map(f, mesh=mesh((2, 2), ("x", "y")), in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    eager, eager_grads = _grads(sm, args)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(sm, fullgraph=True, backend=counter)
    got, got_grads = _grads(compiled, args)
    again, _ = _grads(compiled, args)  # the same graph again: no recompile
    what = f"{name} check_vma={check_vma} {backend}"
    _close(got, eager, f"{what}: compiled vs eager")
    _close(again, eager, f"{what}: second compiled call vs eager")
    _close(got_grads, eager_grads, f"{what}: gradients, compiled vs eager")
    if ref is not None:
        want, want_grads = _grads(ref, args)
        _close(got, want, f"{what}: compiled vs unsharded")
        _close(got_grads, want_grads, f"{what}: gradients, compiled vs unsharded")
    return counter.frame_count


# (case, check_vma, backend): each compile costs seconds, so the matrix is a cover, not a product
MATRIX = [
    ("megatron", True, "aot_eager"),
    ("fsdp", True, "aot_eager"),
    ("psum_scatter", True, "eager"),
    ("collectives", True, "aot_eager"),
    ("collectives", False, "eager"),
]


@pytest.mark.parametrize("name,check_vma,backend", MATRIX, ids=[f"{m[0]}-vma{int(m[1])}-{m[2]}" for m in MATRIX])
def test_compiled_shard_map(worlds, name, check_vma, backend):
    assert worlds(4).run(check_case, name, check_vma, backend, deadline=300) == [1] * 4
