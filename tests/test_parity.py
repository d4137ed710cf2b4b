"""Parity with jax: every collective's values and gradients, flat, nested and over tuple axes, on the same numbers.

jax runs here, on 4 CPU devices (``jax.pmap``, one example per device, and ``shard_map`` on a 2x2 device mesh for
nested and tuple axes) and with ``jax.vmap(..., axis_name=...)`` for batches of other sizes; cmap runs in a gloo world. Skipped where
jax is not installed (``make parity`` installs it). jax's own known gap, the gradient of a non-tiled ``all_to_all``
whose split and concat axes differ, is compared against the transpose rule in ``test_axis_ops`` instead.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from axis_cases import BY_NAME, CASES, NESTED, Case, axis_size_of, values_and_grads  # noqa: E402
from cases import gamma  # noqa: E402

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
lax = pytest.importorskip("jax.lax")

JAX_GRAD_GAP = {"all_to_all 0,1", "all_to_all 1,0"}  # jax 0.10.2: "Expected cotangent type ..."


def jax_f(case: Case, B: int, axis="i"):
    if case.op == "axis_index":
        return lambda v: v * lax.axis_index(axis)
    kw = case.kwargs(B)
    return lambda v: getattr(lax, case.op)(v, axis, **kw)


def jax_values_and_grads(f, X, W, differentiable):
    y = np.asarray(f(jnp.asarray(X)))
    if not differentiable:
        return y, None
    g = jax.grad(lambda x: (jnp.sin(f(x)) * jnp.asarray(W)).sum())(jnp.asarray(X))
    return y, np.asarray(g)


def numbers(shape, seed):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def tolerances(X, W, n):
    """How far jax's and cmap's float32 values and gradients may be apart, for a collective over n examples.

    A value is a sum of at most n examples' entries (|x| <= max|X|), which XLA and gloo add in their own orders: it
    moves by at most dy = 2 gamma_n * n max|X| (cases.sum_tolerance). The gradient of (sin(y) * W).sum() sums at most
    n cotangents W cos(y): each moves with y (cos is 1-Lipschitz) and with the two libraries' cos, taken here to be
    within 2 ulps each (4 eps together), and their sum by 2 gamma_n * n max|W| more. rtol is a few roundings of the
    elementwise ops (pmean's division, axis_index's product).
    """
    x_max, w_max = float(np.abs(X).max(initial=0)), float(np.abs(W).max(initial=0))
    eps = float(np.finfo(np.float32).eps)
    dy = 2 * gamma(n + 1) * n * x_max  # n + 1: pmean's division too
    dg = n * w_max * (dy + 4 * eps) + 2 * gamma(n) * n * w_max
    return dict(rtol=1.3e-6, atol=dy), dict(rtol=1.3e-6, atol=dg)


def compare(got, want, tol, what):
    np.testing.assert_allclose(got[0], want[0], **tol[0], err_msg=f"{what}: values")
    if want[1] is not None:
        np.testing.assert_allclose(got[1], want[1], **tol[1], err_msg=f"{what}: gradient")


@pytest.mark.parametrize("P,B,how", [(2, 4, "pmap"), (3, 5, "vmap"), (4, 3, "vmap")])
def test_each_collective(worlds, P, B, how):
    cases = [c for c in CASES if not (how == "vmap" and c.op == "ppermute")]  # jax.vmap has no ppermute rule
    for k, case in enumerate(cases):
        X = numbers((B, *case.shape(B)), k)
        f = jax_f(case, B)
        mapped = jax.pmap(f, axis_name="i") if how == "pmap" else jax.vmap(f, axis_name="i")
        differentiable = case.differentiable and case.name not in JAX_GRAD_GAP and case.op not in ("pmax", "pmin")
        y = np.asarray(mapped(jnp.asarray(X)))
        W = numbers(y.shape, 100 + k)
        want = jax_values_and_grads(mapped, X, W, differentiable)
        got = worlds(P).run(values_and_grads, case.name, X, W)
        tol = tolerances(X, W, B)
        for rank, result in enumerate(got):
            compare(result if differentiable else (result[0], None), want, tol, f"{case.name} B={B} P={P} rank {rank}")


def mesh_map(f):
    """f on each of 2x2 devices, one example each: jax's ``shard_map`` over the mesh axes ("i", "j")."""
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("i", "j"))
    spec = PartitionSpec("i", "j")
    return jax.shard_map(lambda block: f(block[0, 0])[None, None], mesh=mesh, in_specs=spec, out_specs=spec)


def test_nested_and_tuple_axes(worlds):
    """``cmap(cmap(f, 'j'), 'i')`` on a 2x2 gloo mesh against ``shard_map`` on a 2x2 device mesh."""
    for k, (axis, name) in enumerate(NESTED):
        case = BY_NAME[name]
        X = numbers((2, 2, *case.shape(axis_size_of(axis, 2, 2))), k)
        f = jax_f(case, axis_size_of(axis, 2, 2), axis)
        mapped = mesh_map(f)
        differentiable = case.differentiable and case.name not in JAX_GRAD_GAP
        y = np.asarray(mapped(jnp.asarray(X)))
        W = numbers(y.shape, 200 + k)
        want = jax_values_and_grads(mapped, X, W, differentiable)
        got = worlds(4).run(values_and_grads, name, X, W, axis)
        tol = tolerances(X, W, axis_size_of(axis, 2, 2))
        for rank, result in enumerate(got):
            compare(result if differentiable else (result[0], None), want, tol, f"nested {axis} {name} rank {rank}")
