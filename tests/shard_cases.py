"""Checks that run inside the worker processes for the shard_map tests: each compares shard_map's values and
gradients with a single-process reference that computes the same global function, in float64 (cases.F64)."""

import importlib
import time
from functools import partial
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch
import torch.distributed as dist
from cases import F64, assert_same, sum_tolerance
from torch.utils._pytree import tree_leaves, tree_map

import colossalai_cmap as cm
from colossalai_cmap import P, shard_map

_MESHES: Dict[Any, Any] = {}


def jax_modules() -> Tuple[Any, Any, Any]:
    """jax, jax.numpy and jax.lax for a test module run by pytest (skipped where jax is not installed); None on a
    gloo rank, which imports the module for its ports and never runs jax. Set ``XLA_FLAGS`` before calling it."""
    if dist.is_initialized():
        return None, None, None
    import pytest

    return pytest.importorskip("jax"), pytest.importorskip("jax.numpy"), pytest.importorskip("jax.lax")


def mesh(shape: Tuple[int, ...], names: Tuple[str, ...]) -> Any:
    """A DeviceMesh made once per process (making one makes process groups, collectively)."""
    key = ("device", shape, names)
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def pg_mesh(shape: Tuple[int, ...], names: Tuple[str, ...]) -> Any:
    key = ("pg", shape, names)
    if key not in _MESHES:
        from colossalai.cluster import ProcessGroupMesh

        _MESHES[key] = cm.Mesh(ProcessGroupMesh(*shape), names)
    return _MESHES[key]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def values_and_grads(fn: Callable, *xs: torch.Tensor, seed: int = 99) -> Tuple[Any, Any]:
    """``fn(*xs)`` and the gradients of ``(sin(fn(*xs)) * W).sum()`` with respect to ``xs``, a fixed random W."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    y = fn(*xs)
    differentiable = [x for x in xs if x.requires_grad]
    if not y.requires_grad:
        return y.detach(), None
    w = randn(*y.shape, seed=seed)
    grads = torch.autograd.grad((torch.sin(y) * w).sum(), differentiable, allow_unused=True)
    return y.detach(), [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, differentiable)]


def compare(what: str, got: Tuple[Any, Any], want: Tuple[Any, Any]) -> None:
    assert_same(got[0], want[0], F64, f"{what}: values")
    if want[1] is not None:
        assert got[1] is not None, f"{what}: no gradient"
        for k, (g, e) in enumerate(zip(got[1], want[1])):
            assert_same(g, e, F64, f"{what}: gradient {k}")


# --------------------------------------------------------------------------- every collective, 1-D and tuple axes
def collective_cases(n: int, ax: Any) -> Dict[str, Tuple[Callable, Any, Any, Tuple[torch.Tensor, ...], Callable]]:
    """name -> (f, in_specs, out_specs, global inputs, reference of the global function), for an axis (or tuple of
    axes) ``ax`` of ``n`` ranks. The references are written from the meaning of each op over blocks."""
    k, m = 3, 2
    x = randn(n * k, m, seed=n)
    sq = randn(n, n * k, m, seed=n + 1)
    wide = randn(n * k, n * m, seed=n + 2)

    def blocks(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n, k, *t.shape[1:])

    return {
        "psum": (lambda b: cm.psum(b, ax), P(ax), P(), (x,), lambda t: blocks(t).sum(0)),
        "pmean": (lambda b: cm.pmean(b, ax), P(ax), P(), (x,), lambda t: blocks(t).mean(0)),
        # not differentiable (as cmap's): values only
        "pmax": (lambda b: cm.pmax(b.detach(), ax), P(ax), P(), (x,), lambda t: blocks(t.detach()).amax(0)),
        "pmin": (lambda b: cm.pmin(b.detach(), ax), P(ax), P(), (x,), lambda t: blocks(t.detach()).amin(0)),
        # all_gather's result varies (each rank's copy is its own output block, as in jax with check_vma=True)
        "all_gather": (lambda b: cm.all_gather(b, ax), P(ax), P(ax), (x,), lambda t: torch.cat([blocks(t)] * n)),
        "all_gather tiled": (
            lambda b: cm.all_gather(b, ax, tiled=True),
            P(ax),
            P(ax),
            (x,),
            lambda t: torch.cat([t] * n),
        ),
        "all_gather axis 1 tiled": (
            lambda b: cm.all_gather(b, ax, axis=1, tiled=True),
            P(ax),
            P(ax),
            (x,),
            lambda t: torch.cat([torch.cat(list(blocks(t)), 1)] * n),
        ),
        # all_gather_invariant's is invariant: one copy, replicated (its transpose is a slice)
        "all_gather_invariant": (lambda b: cm.all_gather_invariant(b, ax), P(ax), P(), (x,), blocks),
        "all_gather_invariant tiled": (
            lambda b: cm.all_gather_invariant(b, ax, tiled=True),
            P(ax),
            P(),
            (x,),
            lambda t: t * 1,
        ),
        "all_gather to invarying axis 1 tiled": (
            lambda b: cm.all_gather(b, ax, axis=1, tiled=True, to="invarying"),
            P(ax),
            P(),
            (x,),
            lambda t: torch.cat(list(blocks(t)), 1),
        ),
        "psum_scatter tiled": (
            lambda b: cm.psum_scatter(b[0], ax, scatter_dimension=0, tiled=True),
            P(ax),
            P(ax),
            (sq,),
            lambda t: t.sum(0),
        ),
        "psum_scatter": (
            lambda b: cm.psum_scatter(b[0, :n], ax, scatter_dimension=0)[None],
            P(ax),
            P(ax),
            (sq,),
            lambda t: t[:, :n].sum(0),
        ),
        "all_to_all tiled": (
            lambda b: cm.all_to_all(b, ax, 1, 0, tiled=True),
            P(ax, None),
            P(None, ax),
            (wide,),
            lambda t: t * 1,
        ),
        "all_to_all": (
            lambda b: cm.all_to_all(b[0, :n], ax, 0, 0)[None],
            P(ax),
            P(ax),
            (sq,),
            lambda t: t[:, :n].transpose(0, 1),
        ),
        # pairs (0, 1), (2, 3), ...: the odd members get their left neighbour's block, the even ones zeros
        "ppermute partial": (
            lambda b: cm.ppermute(b, ax, [(i, i + 1) for i in range(0, n - 1, 2)]),
            P(ax),
            P(ax),
            (x,),
            lambda t: torch.stack([blocks(t)[i - 1] if i % 2 else blocks(t)[i] * 0 for i in range(n)]).reshape(t.shape),
        ),
        "ppermute": (
            lambda b: cm.ppermute(b, ax, [(i, (i + 1) % n) for i in range(n)]),
            P(ax),
            P(ax),
            (x,),
            lambda t: torch.roll(t, k, 0),
        ),
        "axis_index": (
            lambda b: b * cm.axis_index(ax),
            P(ax),
            P(ax),
            (x,),
            lambda t: (blocks(t) * torch.arange(n, dtype=t.dtype)[:, None, None]).reshape(t.shape),
        ),
        "axis_size": (lambda b: b * cm.axis_size(ax), P(ax), P(ax), (x,), lambda t: t * n),
        "replicated input": (lambda r: cm.psum(r * 2, ax), P(), P(), (x,), lambda t: t * 2 * n),
    }


def check_collectives(shape: Tuple[int, ...], names: Tuple[str, ...], ax: Any, check_vma: bool = True) -> bool:
    m = mesh(shape, names)
    n = 1
    for a in ax if isinstance(ax, tuple) else (ax,):
        n *= m.size(names.index(a))
    for name, (f, ins, outs, xs, ref) in collective_cases(n, ax).items():
        got = values_and_grads(shard_map(f, m, ins, outs, check_vma=check_vma), *xs)
        compare(f"{name} over {ax}", got, values_and_grads(ref, *xs))
    return True


# ------------------------------------------------------------------------------------------- specs and meshes
def check_matmul_2d(kind: str) -> bool:
    """jax's first shard_map example: P("x", "y") and P("y", None) blocks, a psum over "y"."""
    m = mesh((2, 2), ("x", "y")) if kind == "device" else pg_mesh((2, 2), ("x", "y"))
    a, b = randn(8, 16, seed=1), randn(16, 4, seed=2)

    @partial(shard_map, mesh=m, in_specs=(P("x", "y"), P("y", None)), out_specs=P("x", None))
    def matmul_basic(a_block: torch.Tensor, b_block: torch.Tensor) -> torch.Tensor:
        assert a_block.shape == (4, 8) and b_block.shape == (8, 4)
        return cm.psum(a_block @ b_block, "y")

    compare("matmul_basic", values_and_grads(matmul_basic, a, b), values_and_grads(torch.matmul, a, b))
    return True


def check_uneven_and_tuple_specs() -> bool:
    """Dims that do not divide (tensor_split blocks), a tuple of axes on one dim, 2-D blocks, pytree specs."""
    m = mesh((2, 2), ("x", "y"))
    x = randn(7, 5, seed=3)

    def scaled(b: torch.Tensor) -> torch.Tensor:  # each block times its flat index over ("x", "y")
        return b * (cm.axis_index(("x", "y")) + 1)

    def ref_tuple(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([blk * (i + 1) for i, blk in enumerate(torch.tensor_split(t, 4, 0))])

    f = shard_map(scaled, m, P(("x", "y")), P(("x", "y")))
    compare("P(('x', 'y')) uneven", values_and_grads(f, x), values_and_grads(ref_tuple, x))

    def ref_yx(t: torch.Tensor) -> torch.Tensor:  # ("y", "x"): y major, so block j*2+i is on (x=i, y=j)
        parts = torch.tensor_split(t, 4, 0)
        return torch.cat([blk * (2 * (j % 2) + j // 2 + 1) for j, blk in enumerate(parts)])

    g = shard_map(scaled, m, P(("y", "x")), P(("y", "x")))
    compare("P(('y', 'x')) uneven", values_and_grads(g, x), values_and_grads(ref_yx, x))

    def two_d(b: torch.Tensor) -> torch.Tensor:
        return b * (cm.axis_index("x") * 10 + cm.axis_index("y") + 1)

    def ref_2d(t: torch.Tensor) -> torch.Tensor:
        rows = torch.tensor_split(t, 2, 0)
        return torch.cat(
            [
                torch.cat([c * (i * 10 + j + 1) for j, c in enumerate(torch.tensor_split(r, 2, 1))], 1)
                for i, r in enumerate(rows)
            ]
        )

    h = shard_map(two_d, m, P("x", "y"), P("x", "y"))
    compare("P('x', 'y') uneven 2-D", values_and_grads(h, x), values_and_grads(ref_2d, x))

    def tree(d: Dict[str, torch.Tensor], s: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"sum": cm.psum(d["a"].sum(0) * s, "x"), "rows": d["b"] * 2}

    t = shard_map(tree, m, ({"a": P("x"), "b": P(None, "y")}, P()), {"sum": P(), "rows": P(None, "y")})
    a, b, s = randn(4, 3, seed=4), randn(2, 6, seed=5), randn(3, seed=6)
    got = t({"a": a, "b": b}, s)
    assert_same(got, {"sum": a.sum(0) * s, "rows": b * 2}, F64, "pytree specs")
    return True


def check_local_io() -> bool:
    """local=True: the blocks in, the blocks out, per-rank gradients; equal to the global call's blocks."""
    m = mesh((4,), ("i",))
    rank = dist.get_rank()
    x = randn(8, 3, seed=7)
    f = lambda b: b * cm.psum(b.sum(), "i")  # noqa: E731
    glob = values_and_grads(shard_map(f, m, P("i"), P("i")), x)
    mine = x[2 * rank : 2 * rank + 2].detach().clone().requires_grad_()
    y = shard_map(f, m, P("i"), P("i"), local=True)(mine)
    assert_same(y.detach(), glob[0][2 * rank : 2 * rank + 2], F64, "local values")
    w = randn(8, 3, seed=99)[2 * rank : 2 * rank + 2]
    (torch.sin(y) * w).sum().backward()  # every rank's loss on its own block: together, the global loss
    assert_same(mine.grad, glob[1][0][2 * rank : 2 * rank + 2], F64, "local gradients")
    return True


# ------------------------------------------------------------------------------------- autograd and transforms
def check_transforms() -> bool:
    """torch.func.grad, vjp, jvp around shard_map; double backward through it."""
    m = mesh((2,), ("i",))
    x = randn(6, seed=8)

    def f(b: torch.Tensor) -> torch.Tensor:
        return torch.sin(b) * cm.psum((b * b).sum(), "i")

    sm = shard_map(f, m, P("i"), P("i"))

    def ref(t: torch.Tensor) -> torch.Tensor:
        return torch.sin(t) * (t * t).sum()

    assert_same(torch.func.grad(lambda t: sm(t).sum())(x), torch.func.grad(lambda t: ref(t).sum())(x), F64, "grad")
    v = randn(6, seed=9)
    _, vjp_got = torch.func.vjp(sm, x)
    _, vjp_want = torch.func.vjp(ref, x)
    assert_same(vjp_got(v), vjp_want(v), F64, "vjp")
    assert_same(torch.func.jvp(sm, (x,), (v,)), torch.func.jvp(ref, (x,), (v,)), F64, "jvp")
    xg = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(sm(xg).sum(), xg, create_graph=True)
    (gg,) = torch.autograd.grad((g * g).sum(), xg)
    xr = x.clone().requires_grad_()
    (h,) = torch.autograd.grad(ref(xr).sum(), xr, create_graph=True)
    (hh,) = torch.autograd.grad((h * h).sum(), xr)
    assert_same(gg, hh, F64, "double backward")
    return True


def check_closures_and_training() -> bool:
    """A model f closes over (its parameters never passed to shard_map) gets the global gradient: data-parallel
    training with shard_map and AdamW follows the same training in one process."""
    m = mesh((2, 2), ("x", "y"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)

    @partial(shard_map, mesh=m, in_specs=(P(("x", "y")), P(("x", "y"))), out_specs=P())
    def loss_dp(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return cm.pmean(((model(xb) - yb) ** 2).mean(), ("x", "y"))

    for step in range(3):
        xs, ys = randn(8, 4, seed=10 + step), randn(8, 1, seed=20 + step)
        for o in (opt, ref_opt):
            o.zero_grad()
        loss = loss_dp(xs, ys)
        loss.backward()
        want = ((ref(xs) - ys) ** 2).mean()
        want.backward()
        assert_same(loss.detach(), want.detach(), F64, f"loss {step}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_same(p.grad, q.grad, F64, f"{name}.grad {step}")
            # AdamW divides each entry by its own size, so an entry within rounding of 0 could step either way on
            # another CPU; none is (cases.F64's premise for optimizer steps)
            assert float(q.grad.abs().min()) > 1e-9, f"{name}.grad {step} has an entry near 0"
        opt.step()
        ref_opt.step()
    return True


def check_checkpoint_inside() -> bool:
    """jax's remat in the FSDP example: an all_gather inside torch.utils.checkpoint, recomputed in backward after
    shard_map returned, finds its axis."""
    m = mesh((4,), ("i",))
    w, x = randn(8, 3, seed=11), randn(5, 3, seed=12)

    def gathered(wb: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
        return torch.tanh(xb @ cm.all_gather(wb, "i", tiled=True).T)

    def f(wb: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(gathered, wb, xb, use_reentrant=False)

    want = values_and_grads(lambda a, b: torch.tanh(b @ a.T), w, x)
    # the gathered weight varies over "i", so a replicated output needs check_vma=False (as in jax) ...
    compare("checkpoint", values_and_grads(shard_map(f, m, (P("i"), P()), P(), check_vma=False), w, x), want)

    def invariant(wb: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:  # ... or the invariant gather
        gather = partial(cm.all_gather_invariant, axis_name="i", tiled=True)
        return torch.utils.checkpoint.checkpoint(lambda a, b: torch.tanh(b @ gather(a).T), wb, xb, use_reentrant=False)

    compare("checkpoint invariant", values_and_grads(shard_map(invariant, m, (P("i"), P()), P()), w, x), want)
    return True


# --------------------------------------------------------------------------------------------------- nesting
def check_cmap_inside() -> bool:
    """cmap inside shard_map maps over the examples of this rank's block, with both axes' collectives."""
    m = mesh((2,), ("i",))
    x = randn(6, 3, seed=13)

    def f(b: torch.Tensor) -> torch.Tensor:
        per = cm.cmap(lambda e: e - cm.pmean(e, "b") + cm.psum(e.sum(), "i"), axis_name="b")
        return per(b)

    def ref(t: torch.Tensor) -> torch.Tensor:
        blocks = t.reshape(2, 3, 3)
        totals = blocks.sum((1, 2)).sum()  # psum over "i" of each example's sum, example by example
        per_example = blocks.sum(2)  # (block, example)
        summed = per_example.sum(0)  # psum over "i" pairs example e of block 0 with example e of block 1
        del totals
        return (blocks - blocks.mean(1, keepdim=True) + summed[None, :, None]).reshape(6, 3)

    sm = shard_map(f, m, P("i"), P("i"))
    compare("cmap inside shard_map", values_and_grads(sm, x), values_and_grads(ref, x))
    return True


def check_shard_map_inside_cmap() -> bool:
    """shard_map over the "y" axis inside a cmap over the "x" axis of a 2x2 mesh: a data-parallel cmap whose
    examples run a tensor-parallel function."""
    m = mesh((2, 2), ("x", "y"))
    w, x = randn(4, 6, seed=14), randn(5, 4, seed=15)
    tp = shard_map(lambda wb, e: e @ wb, m["y"], (P(None, "y"), P()), P("y"))
    f = cm.cmap(lambda e: tp(w, e), group=m.get_group("x"))
    compare("shard_map inside cmap", values_and_grads(f, x), values_and_grads(lambda t: t @ w, x))
    return True


# --------------------------------------------------------------------------------------------------- failures
def check_failure(where: str) -> str:
    """An exception on one rank, while its peers wait in collectives over different axes, is a CmapError on every
    rank of the mesh that names it."""
    m = mesh((2, 2), ("x", "y"))

    def f(b: torch.Tensor) -> torch.Tensor:
        if where == "before" and dist.get_rank() == 3:
            raise ValueError("boom on rank 3")
        y = cm.psum(b, "y")
        if where == "between" and dist.get_rank() == 0:
            raise KeyError("boom on rank 0")
        return cm.psum(y, "x")

    try:
        shard_map(f, m, P("x", "y"), P())(torch.ones(4, 4))
    except cm.CmapError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def check_random_collectives_and_failures(steps: int, seed: int, timeout: float) -> List[Tuple[Any, ...]]:
    """On a 2 x 2 mesh of its own, ``steps`` training steps of an f that makes a random sequence of collectives (a psum
    over x, y or both, or none) under a random spec, on an input that requires grad or not; in some, a random rank
    raises before a random one of them, or after them all. Returns each step as (collectives, (rank, point) of the
    failure or None, spec, what came back: "ok", "CmapError" naming that rank, or the surprise, seconds)."""
    import random

    rank, rng, plan = dist.get_rank(), random.Random(seed), {}
    m = mesh((2, 2), ("x", "y"))

    def f(b: torch.Tensor) -> torch.Tensor:
        for k, axes in enumerate(plan["ops"]):
            if plan["fail"] == (rank, k):
                raise ValueError(f"boom before collective {k}")
            b = cm.psum(b, axes).sin() if axes else b.cos()
        if plan["fail"] == (rank, len(plan["ops"])):
            raise ValueError("boom after them all")
        return b * 2

    seen = []
    for step in range(steps):
        ops = tuple(rng.choice([None, "x", "y", ("x", "y")]) for _ in range(rng.randint(0, 3)))
        fail = (rng.randrange(4), rng.randint(0, len(ops))) if rng.random() < 0.4 else None
        spec = rng.choice([P("x"), P(("x", "y")), P("x", "y"), P(("y", "x")), P()])
        plan.update(ops=ops, fail=fail)
        x = randn(8, 4, seed=step).requires_grad_(rng.random() < 0.5)
        g = shard_map(f, m, spec, spec, check_vma=False, timeout=timeout)
        began = time.perf_counter()
        try:
            y = g(x)
            if x.requires_grad:
                y.pow(2).sum().backward()
            got = "ok"
        except cm.CmapError as exc:
            got = "CmapError" if fail is not None and f"group rank {fail[0]} (global" in str(exc) else str(exc)
        seen.append((ops, fail, repr(spec), got, time.perf_counter() - began))
    return seen


def check_failures_in_a_loop_on_a_mesh() -> List[str]:
    """On a 2 x 2 mesh, a training loop whose f sums over "y", then over "x": each rank in turn raises before the
    first psum, between them, and after both, while its peers wait in collectives over either axis or at the exit;
    every failing step is a CmapError naming that rank, and the step after it has the unsharded values and
    gradients. Returns each failing step's message (or "no error"), then "ok" for each good step."""
    m = mesh((2, 2), ("x", "y"))
    plan = {"where": "", "rank": -1}

    def f(b: torch.Tensor) -> torch.Tensor:
        here = dist.get_rank() == plan["rank"]
        if here and plan["where"] == "before":
            raise ValueError("boom before")
        y = cm.psum(b.sin(), "y")
        if here and plan["where"] == "between":
            raise ValueError("boom between")
        z = cm.psum(y, "x")
        if here and plan["where"] == "after":
            raise ValueError("boom after")
        return z * b

    g = shard_map(f, m, P("x", "y"), P("x", "y"))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    # the psums add 4 terms in another order than the reference: each result is within 2 gamma_8 of the largest
    # sum|terms|, here at most 4 * 8 (|x| + 1)^2 (|sin|, |cos| <= 1; the gradient's terms are products of those)
    tolerance = sum_tolerance(8, 32 * (float(x.abs().max()) + 1) ** 2, torch.float64)
    seen = []
    for rank in range(4):
        for where in ("before", "between", "after", ""):
            plan.update(where=where, rank=rank)
            given = x.clone().requires_grad_()
            try:
                g(given).pow(2).sum().backward()
            except cm.CmapError as exc:
                seen.append(str(exc))
                continue
            if where:
                seen.append("no error")
                continue
            ref = x.clone().requires_grad_()
            blocks = [blk.sin() for row in ref.tensor_split(2, 0) for blk in row.tensor_split(2, 1)]
            total = sum(blocks)
            out = torch.cat(
                [torch.cat([total * blk for blk in row.tensor_split(2, 1)], 1) for row in ref.tensor_split(2, 0)]
            )
            out.pow(2).sum().backward()
            assert_same(g(x), out.detach(), tolerance, "values")
            assert_same(given.grad, ref.grad, tolerance, "gradients")
            seen.append("ok")
    return seen


def check_carried_outputs_fail_alike() -> Dict[str, str]:
    """Two outputs that the exit's round carries, in a steady loop on a 1-D mesh: an exception on one rank, and a
    rank that returns one output where the others return two, are the same CmapError on every rank, and the next
    call returns the unsharded values."""
    m = mesh((dist.get_world_size(),), ("i",))
    x = torch.randn(4 * dist.get_world_size(), 3, generator=torch.Generator().manual_seed(0))
    mode = {"now": ""}

    def f(b: torch.Tensor) -> Any:
        if mode["now"] == "raise" and dist.get_rank() == 1:
            raise ValueError("boom on rank 1")
        if mode["now"] == "one output" and dist.get_rank() == 1:
            return (b.sin(),)
        return b.sin(), b.cos()

    g = shard_map(f, m, P("i"), P("i"))  # a prefix of any tuple: the structures differ only at the exit
    seen = {}
    for now in ("", "", "raise", "", "one output", ""):
        mode["now"] = now
        try:
            y = g(x)
            assert torch.equal(y[0], x.sin()) and torch.equal(y[1], x.cos()), now
        except cm.CmapError as exc:
            seen[now] = str(exc)
    return seen


# case: (mesh shape (0: the rest of the world), names, specs, global shape in blocks, dim widened)
BLOCK_SHAPE_CASES = {
    "split, in the round": ((0,), ("i",), P("i"), (2, 3), -1),
    "split, past the threshold": ((0,), ("i",), P("i"), (64, 1024), -1),
    "replicated": ((0,), ("i",), P(), (2, 300), -1),
    "2-D mesh, tiles": ((2, 0), ("x", "y"), P("x", "y"), (2, 3, 4), -1),
    "2-D mesh, tiles off the grid": ((2, 0), ("x", "y"), P("x", "y"), (2, 3, 4), 1),
    # split over x, copies along y: the exit carries them (the ranks at y = 0 send), or beside another output
    # whose copies run along x, assembles them axis by axis
    "2-D mesh, copies of another length": ((2, 0), ("x", "y"), P("x"), (3, 4), 0),
    "2-D mesh, copies of another length, beside others": ((2, 0), ("x", "y"), P("x"), (3, 4), 0),
}


def check_block_shapes_differ(case: str) -> Dict[str, Any]:
    """A steady loop in which one rank's output block, for one call, is one longer along one dim than its peers'
    (``shard_map(f, mesh, spec, spec)``, f elementwise; with ``P()`` out, the sum of the rows; "beside others": a
    second output, the input block, whose copies run along the other axis): every rank raises the same CmapError,
    and the calls before and after it return the unsharded values."""
    shape, names, spec, blocks, dim = BLOCK_SHAPE_CASES[case]
    beside = "beside others" in case
    size, rank = dist.get_world_size(), dist.get_rank()
    sizes = tuple(n or size // 2 ** (len(shape) - 1) for n in shape)
    m = mesh(sizes, names)
    mode = {"longer": False}

    def f(b: torch.Tensor) -> torch.Tensor:
        out = b.sin()
        if mode["longer"] and rank == size - 1:
            out = torch.cat([out, out.narrow(dim, 0, 1)], dim)
        out = out if spec != P() else out.sum(0)
        return (out, b) if beside else out

    out_specs = (spec, P(None, names[-1])) if beside else spec
    g = shard_map(f, m, P(*names) if spec == P() else spec, out_specs, check_vma=False)
    grid = list(sizes) + [1] * (len(blocks) - len(sizes)) if spec != P() else [size] + [1] * (len(blocks) - 1)
    x = torch.randn(*(b * n for b, n in zip(blocks, grid)), generator=torch.Generator().manual_seed(blocks[-1]))
    expected = x.sin() if spec != P() else x[: blocks[0]].sin().sum(0)
    seen: Dict[str, Any] = {"exact": [], "error": ""}
    for longer in (False, False, False, True, False, False):
        mode["longer"] = longer
        try:
            seen["exact"].append(torch.equal(g(x)[0] if beside else g(x), expected))
        except cm.CmapError as exc:
            seen["error"] = str(exc)
    return seen


def check_spec_errors() -> Dict[str, str]:
    m = mesh((2, 2), ("x", "y"))
    out = {}
    for name, (specs, arg) in {
        "rank": (P("x", "y", None), torch.ones(4, 4)),
        "axis": (P("z"), torch.ones(4)),
        "twice": (P("x", "x"), torch.ones(4, 4)),
        "prefix": ((P(), P()), torch.ones(4)),
    }.items():
        try:
            shard_map(lambda b: b, m, specs, P())(arg)
            out[name] = "no error"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}|{isinstance(exc, ValueError)}|{exc}"
    return out


def check_rep(replicated: bool) -> str:
    m = mesh((2, 2), ("x", "y"))
    f = (lambda b: cm.psum(b, "y")) if replicated else (lambda b: b * cm.axis_index("y"))
    try:
        y = shard_map(f, m, P("x", "y"), P("x"), check_rep=True)(torch.ones(4, 4))
        return f"ok {tuple(y.shape)}"
    except cm.CmapError as exc:
        return str(exc)


def check_partial_mesh() -> Any:
    """A mesh over ranks 0 and 1 of a world of 4: ranks 2 and 3 take no part (they return None)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = "partial"
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("s",))
    if dist.get_rank() >= 2:
        return shard_map(lambda b: b, _MESHES[key], P("s"), P("s"))(torch.ones(2))
    y = shard_map(lambda b: cm.psum(b, "s") * (cm.axis_index("s") + 1), _MESHES[key], P("s"), P("s"))(torch.arange(4.0))
    return y.tolist()


def check_compiled_around() -> bool:
    """torch.compile(shard_map(f)) gives eager's values and gradients (the orchestration is one graph break)."""
    m = mesh((2,), ("i",))
    x = randn(6, 3, seed=16)
    sm = shard_map(lambda b: torch.tanh(b) * cm.psum(b.sum(), "i"), m, P("i"), P("i"))
    compiled = torch.compile(sm, backend="aot_eager")
    compare("compiled", values_and_grads(compiled, x), values_and_grads(sm, x))
    return True


def check_spec_property(shape: Tuple[int, ...], entries: Tuple[Any, ...]) -> bool:
    """For any global shape (dims of any length, 0 included) and any spec on the 2x2 mesh: an elementwise f with the
    same in and out spec is the global elementwise function, and a psum over the spec's axes of each block's sum is
    the global sum (replicated axes are not summed), values and gradients."""
    m = mesh((2, 2), ("x", "y"))
    spec = P(*entries)
    x = randn(*shape, seed=sum(shape) + len(entries))
    elementwise = shard_map(lambda b: torch.sin(b) * 2, m, spec, spec)
    compare(
        f"elementwise {spec} {shape}", values_and_grads(elementwise, x), values_and_grads(lambda t: torch.sin(t) * 2, x)
    )

    def block_sum(b: torch.Tensor) -> torch.Tensor:
        return cm.psum(b.sum(), spec.axes()) if spec.axes() else b.sum()

    total = shard_map(block_sum, m, spec, P())
    compare(f"sum {spec} {shape}", values_and_grads(total, x), values_and_grads(torch.sum, x))
    return True


# ------------------------------------------------------------------- jax's tutorial and its port, side by side
def run_jax(examples: Any, example: str, args: Any, cotangents: Any = None, **kwargs: Any) -> Any:
    """``examples.jax_<example>(*args)`` (``examples``: the module of the ports): its outputs' leaves, and with ``cotangents`` (one per output leaf) the vjp's gradient
    for each leaf of args, all as numpy arrays. One jit for both: jax's eager mode takes minutes on the pipeline."""
    import jax
    import jax.numpy as jnp

    fn = partial(getattr(examples, "jax_" + example), **kwargs)

    @jax.jit
    def values_and_grads(args, cotangents):
        ys, vjp = jax.vjp(fn, *args)
        return ys, (None if cotangents is None else vjp(jax.tree.unflatten(jax.tree.structure(ys), cotangents)))

    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)  # halves the compile time of these tiny programs
    try:
        ys, grads = values_and_grads(jax.tree.map(jnp.asarray, args), cotangents and list(map(jnp.asarray, cotangents)))
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)
    return [np.asarray(y) for y in jax.tree.leaves(ys)], grads and [np.asarray(g) for g in jax.tree.leaves(grads)]


def jax_shapes(examples: Any, example: str, args: Any) -> Any:
    """The shapes of ``examples.jax_<example>(*args)``'s output leaves (traced, not run)."""
    import jax

    return [y.shape for y in jax.tree.leaves(jax.eval_shape(getattr(examples, "jax_" + example), *args))]


def run_cm(module: str, example: str, args: Any, cotangents: Any = None, **kwargs: Any) -> Any:
    """On each rank: ``cm_<example>(*args)`` of the module named ``module`` on the same global tensors, and with ``cotangents`` the gradient that
    backward leaves in each leaf of args (every leaf requires grad), all as numpy arrays."""
    fn = partial(getattr(importlib.import_module(module), "cm_" + example), **kwargs)
    args = tree_map(lambda a: torch.from_numpy(np.array(a)), args)
    leaves = tree_leaves(args)
    for leaf in leaves:
        leaf.requires_grad_(cotangents is not None)
    ys = tree_leaves(fn(*args))
    if cotangents is None:
        return [y.numpy() for y in ys], None
    torch.autograd.backward(ys, [torch.from_numpy(np.array(c)) for c in cotangents])
    grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
    return [y.detach().numpy() for y in ys], [g.numpy() for g in grads]


def integers(shape: Any, seed: int) -> np.ndarray:
    """Integer-valued float32 cotangents: every sum a vjp makes of them (and of the tutorial's integers) is exact."""
    return np.random.RandomState(seed).randint(-4, 5, size=shape).astype(np.float32)


def compare_with_jax(got: Any, want: Any, tol: Any, what: str) -> None:
    """Each rank's (values, gradients) against jax's: equal, or with ``tol(kind, k) = (atol, rtol)`` within
    atol + rtol |jax's| entrywise (atol may be an array of bounds), with NaN exactly where jax has NaN."""
    for rank, result in enumerate(got):
        for kind, g_leaves, w_leaves in (("values", result[0], want[0]), ("gradients", result[1], want[1])):
            if w_leaves is None:
                continue
            assert len(g_leaves) == len(w_leaves), f"{what} rank {rank}: {kind}: {len(g_leaves)} != {len(w_leaves)}"
            for k, (g, w) in enumerate(zip(g_leaves, w_leaves)):
                where = f"{what}, rank {rank}: {kind}[{k}]"
                assert g.shape == w.shape, f"{where}: shape {g.shape} != {w.shape}"
                if tol is None:
                    np.testing.assert_array_equal(g, w, err_msg=where)
                    continue
                atol, rtol = tol(kind, k)
                g64, w64 = g.astype(np.float64), w.astype(np.float64)
                assert np.array_equal(np.isnan(g64), np.isnan(w64)), f"{where}: NaN in other places\n{g}\n{w}"
                off = np.abs(g64 - w64) > atol + rtol * np.abs(w64)
                assert not off.any(), f"{where}: {off.sum()} entries off by more than the bound\n{g}\n{w}"
