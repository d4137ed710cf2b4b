"""``cm.smap`` against jax 0.10's ``jax.smap`` on 4 host devices, on a 2x2 mesh ("x", "y").

* Values and gradients on every rank equal jax's: at the top level (``set_mesh``), inside a ``shard_map`` whose
  ``axis_names`` leave the smap's axis non-manual, and nested in itself. jax's ``grad`` through a nested smap
  raises ``DuplicateSpecError``; there the gradient is the flat ``shard_map``'s (jax's, computed flat), which is the
  same function. Inputs and cotangents are small integers in float32: values and gradients agree to the ulps of
  ``sin``, whose float32 rounding differs between XLA and torch.
* Errors where jax raises: an out_axes None for a varying output, an axis already manual, in_axes left out, a tuple
  axis name, no mesh in context.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import shard_cases as sc  # noqa: E402
import torch  # noqa: E402

import colossalai_cmap as cm  # noqa: E402
from colossalai_cmap import P, shard_map  # noqa: E402

EXAMPLES = sys.modules[__name__]

if torch.distributed.is_initialized():  # a gloo rank, importing this module for the ports: it never runs jax
    jax = jnp = lax = None
else:
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    lax = pytest.importorskip("jax.lax")


def jax_mesh():
    return jax.make_mesh((2, 2), ("x", "y"), (jax.sharding.AxisType.Auto,) * 2)


def cm_mesh():
    return sc.mesh((2, 2), ("x", "y"))


# ----------------------------------------------------------------------- the same programs, jax's and cmap's
# Each program is written once over a namespace of its library's names (smap, psum, axis_index, P, shard_map, mesh)
# and returns the mapped function of the global inputs.
def top_level(m, x, w):
    """smap over "x" under set_mesh: in_axes (0, None), out_axes 0; a replicated w mixed with a block."""
    f = m.smap(lambda b, w: m.sin(b) * w * (m.axis_index("x") + 1), in_axes=(0, None), out_axes=0, axis_name="x")
    return f(x, w)


def dims_kept(m, x, w):
    """in_axes 1 and out_axes 1 (f sees its block with the dim kept), and out_axes None of a psum."""
    f = m.smap(
        lambda b, w: (b * w[:, None], m.psum(b.sum(1), "x")), in_axes=(1, None), out_axes=(1, None), axis_name="x"
    )
    return f(x, w)


def in_shard_map(m, x, w):
    """smap over "x" inside a shard_map over "y" (axis_names={"y"}: f sees whole values along "x")."""

    def outer(b, w):
        inner = m.smap(
            lambda c, w: m.psum(m.sin(c) * w, "y") * (m.axis_index("x") + 1),
            in_axes=(0, None),
            out_axes=0,
            axis_name="x",
        )
        return inner(b, w * (m.axis_index("y") + 1))

    return m.shard_map(outer, mesh=m.mesh, in_specs=(m.P("y"), m.P()), out_specs=m.P(), axis_names={"y"})(x, w)


def nested(m, x, w):
    """smap over "y" of smap over "x": dim 0 split over "y" then "x" (the flat spec m.P(("y", "x")))."""

    def inner(c, w):
        return m.sin(c) * w * (m.axis_index("x") + 1) + m.axis_index("y")

    def outer(b, w):
        return m.smap(inner, in_axes=(0, None), out_axes=0, axis_name="x")(b, w * 2)

    return m.smap(outer, in_axes=(0, None), out_axes=0, axis_name="y")(x, w)


def nested_dims(m, x, w):
    """smap over "y" (dim 0) of smap over "x" (dim 1), a psum over "y" inside the inner one: the flat spec
    m.P("y", "x") in, m.P(None, "x") out."""

    def inner(c, w):
        return m.psum(m.sin(c) * w[:, None], "y") * (m.axis_index("x") + 1)

    def outer(b, w):
        return m.smap(inner, in_axes=(1, None), out_axes=1, axis_name="x")(b, w)

    return m.smap(outer, in_axes=(0, 0), out_axes=None, axis_name="y")(x, w)


def flat_nested(m, x, w):
    """:func:`nested` as one shard_map over both axes."""

    def f(c, w):
        return m.sin(c) * (w * 2) * (m.axis_index("x") + 1) + m.axis_index("y")

    return m.shard_map(f, mesh=m.mesh, in_specs=(m.P(("y", "x")), m.P()), out_specs=m.P(("y", "x")))(x, w)


def flat_nested_dims(m, x, w):
    """:func:`nested_dims` as one shard_map over both axes."""

    def f(c, w):
        return m.psum(m.sin(c) * w[:, None], "y") * (m.axis_index("x") + 1)

    return m.shard_map(f, mesh=m.mesh, in_specs=(m.P("y", "x"), m.P("y")), out_specs=m.P(None, "x"))(x, w)


def flat_in_shard_map(m, x, w):
    """:func:`in_shard_map` as one shard_map over both axes."""

    def f(c, w):
        return m.psum(m.sin(c) * (w * (m.axis_index("y") + 1)), "y") * (m.axis_index("x") + 1)

    return m.shard_map(f, mesh=m.mesh, in_specs=(m.P(("y", "x")), m.P()), out_specs=m.P("x"))(x, w)


PROGRAMS = {  # name: (program, global input shapes, jax's gradient is that of this flat program)
    "top level": (top_level, [(8, 3), (3,)], None),
    "dims kept": (dims_kept, [(3, 4), (3,)], None),
    "in a shard_map": (in_shard_map, [(8, 3), (3,)], flat_in_shard_map),
    "nested": (nested, [(8, 3), (3,)], flat_nested),
    "nested, dims 0 and 1": (nested_dims, [(4, 4), (4,)], flat_nested_dims),
}


class JaxNames:
    def __init__(self):
        self.smap, self.psum, self.axis_index, self.sin = jax.smap, lax.psum, lax.axis_index, jnp.sin
        self.shard_map, self.mesh, self.P = jax.shard_map, jax_mesh(), jax.P


class CmNames:
    def __init__(self):
        self.smap, self.psum, self.axis_index, self.sin = cm.smap, cm.psum, cm.axis_index, torch.sin
        self.shard_map, self.mesh, self.P = shard_map, cm_mesh(), P


def _inputs(shapes):
    rng = np.random.RandomState(sum(map(len, shapes)))
    return tuple(rng.randint(-3, 4, size=s).astype(np.float32) for s in shapes)


def jax_program(name):
    """jax's values of the program and its vjp for an integer cotangent (of the flat program where jax's grad
    through the nested one raises)."""
    program, shapes, flat = PROGRAMS[name]
    names, args = JaxNames(), _inputs(shapes)
    with jax.set_mesh(names.mesh):  # jitted: jax's eager nested smap fails where its jit does not
        ys = jax.tree.leaves(jax.jit(lambda *a: program(names, *a))(*args))
        cts = [np.random.RandomState(k).randint(-3, 4, size=y.shape).astype(np.float32) for k, y in enumerate(ys)]
        by = flat or program

        @jax.jit
        def grads_of(args, cts):
            return jax.vjp(lambda *a: tuple(jax.tree.leaves(by(names, *a))), *args)[1](tuple(cts))

        grads = grads_of(args, cts)
    return [np.asarray(y) for y in ys], [np.asarray(g) for g in grads], cts


def cm_program(name, cts):
    program, shapes, _ = PROGRAMS[name]
    args = [torch.from_numpy(a).requires_grad_() for a in _inputs(shapes)]
    with cm.set_mesh(cm_mesh()):
        ys = torch.utils._pytree.tree_leaves(program(CmNames(), *args))
    torch.autograd.backward(ys, [torch.from_numpy(c) for c in cts])
    return [y.detach().numpy() for y in ys], [a.grad.numpy() for a in args]


def cm_programs(cts):
    return {name: cm_program(name, ct) for name, ct in cts.items()}


def test_smap_against_jax(worlds):
    """Values and gradients on every rank, exactly jax's (the flat shard_map's gradient where jax's grad through the
    nested smap raises DuplicateSpecError)."""
    want, cts = {}, {}
    for name, (program, shapes, flat) in PROGRAMS.items():
        ys, grads, ct = jax_program(name)
        want[name], cts[name] = (ys, grads), ct
        if flat is not None:  # the flat program is the same function, and jax's grad of the nested one fails
            with jax.set_mesh(jax_mesh()):
                flat_ys = jax.tree.leaves(jax.jit(lambda *a: flat(JaxNames(), *a))(*_inputs(shapes)))
            for a, b in zip(ys, flat_ys):
                np.testing.assert_array_equal(a, np.asarray(b), err_msg=name)
    with jax.set_mesh(jax_mesh()), pytest.raises(Exception, match="duplicate entries|already bound by a parent"):
        args = _inputs(PROGRAMS["nested"][1])
        jax.jit(jax.grad(lambda *a: nested(JaxNames(), *a).sum()))(*args)
    got = worlds(4).run(cm_programs, cts)
    for name in PROGRAMS:
        # sin's float32 rounding differs by an ulp between XLA and torch: a few ulps after the products
        sc.compare_with_jax([rank[name] for rank in got], want[name], lambda kind, k: (1e-5, 1e-5), name)


# --------------------------------------------------------------------------------------------------- errors
def error_cases(m):
    """name: a call that jax refuses (run with the mesh in context)."""
    ones = m.ones

    def twice(b):
        return m.smap(lambda c: c, in_axes=0, out_axes=0, axis_name="x")(b)

    return {
        "out_axes None of a varying value": lambda: m.smap(lambda b: b, in_axes=0, out_axes=None, axis_name="x")(
            ones(4)
        ),
        "axis already manual": lambda: m.smap(twice, in_axes=0, out_axes=0, axis_name="x")(ones(4)),
        "in_axes left out": lambda: m.smap(lambda b: b, out_axes=0, axis_name="x")(ones(4)),
        "tuple axis name": lambda: m.smap(lambda b: b, in_axes=0, out_axes=0, axis_name=("x", "y"))(ones(4)),
        "in_axes a list": lambda: m.smap(lambda b: b, in_axes=[0], out_axes=0, axis_name="x")(ones(4)),
        "unknown axis": lambda: m.smap(lambda b: b, in_axes=0, out_axes=0, axis_name="z")(ones(4)),
    }


def _raised(run):
    try:
        run()
        return "no error"
    except Exception as exc:  # noqa: BLE001 (the kinds are compared)
        return (type(exc).__name__, isinstance(exc, ValueError), isinstance(exc, TypeError), str(exc))


def cm_errors():
    class Names(CmNames):
        ones = staticmethod(torch.ones)

    names = Names()
    out = {}
    with cm.set_mesh(names.mesh):
        for label, run in error_cases(names).items():
            out[label] = _raised(run)
    out["no mesh"] = _raised(lambda: cm.smap(lambda b: b, in_axes=0, out_axes=0, axis_name="x")(torch.ones(4)))
    return out


def test_smap_errors_where_jax_raises(worlds):
    class Names(JaxNames):
        ones = staticmethod(lambda n: np.ones(n, np.float32))

    names = Names()
    with jax.set_mesh(names.mesh):
        want = {label: _raised(run) for label, run in error_cases(names).items()}
    want["no mesh"] = _raised(lambda: jax.smap(lambda b: b, in_axes=0, out_axes=0, axis_name="x")(np.ones(4)))
    assert all(w != "no error" for w in want.values()), want
    assert want["axis already manual"][0] == "DuplicateSpecError", want
    for got in worlds(4).run(cm_errors):
        for label, w in want.items():
            g = got[label]
            assert g != "no error", (label, w)
            if label == "axis already manual":  # jax's is no ValueError; cmap's names the axis
                assert g[1] and "already manual" in g[3], g
                continue
            assert (g[1], g[2]) == (w[1], w[2]), (label, g, w)
        assert "was inferred to be possibly varying over {x}" in got["out_axes None of a varying value"][3]
        assert "in_axes was not specified" in got["in_axes left out"][3]
        assert "The context mesh cannot be empty" in got["no mesh"][3]
        assert "smap axis_name should be a `str`" in got["tuple axis name"][3]
        assert "to be a subset of" in got["unknown axis"][3]
