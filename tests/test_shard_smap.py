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

jax, jnp, lax = sc.jax_modules()  # None on a gloo rank, which imports this module for the ports


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


# ------------------------------------------------------------------------------------------ axis_index_groups
# name: (groups, f written with the library's psum/pmean/all_gather (each takes axis_index_groups=), out shape)
def grouped_cases(m):
    return {
        "psum [[0, 1], [2, 3]]": lambda b: m.psum(m.sin(b), "i", axis_index_groups=[[0, 1], [2, 3]]),
        "psum [[3, 1], [0, 2]]": lambda b: m.psum(b * b, "i", axis_index_groups=[[3, 1], [0, 2]]),
        "pmean [[0, 2], [1, 3]]": lambda b: m.pmean(b * 3, "i", axis_index_groups=[[0, 2], [1, 3]]),
        "all_gather [[0, 2], [3, 1]]": lambda b: m.all_gather(m.sin(b), "i", axis_index_groups=[[0, 2], [3, 1]]),
        "all_gather tiled axis 1": lambda b: m.all_gather(
            b * b, "i", axis_index_groups=[[2, 0], [1, 3]], axis=1, tiled=True
        ),
        "psum of all_gather": lambda b: m.psum(
            m.all_gather(b, "i", axis_index_groups=[[1, 0], [3, 2]], tiled=True),
            "i",
            axis_index_groups=[[0, 3], [1, 2]],
        ),
    }


def jax_grouped(name):
    f = grouped_cases(JaxNamesGrouped())[name]
    sm = jax.shard_map(
        f,
        mesh=jax.make_mesh((4,), ("i",), (jax.sharding.AxisType.Auto,)),
        in_specs=jax.P("i"),
        out_specs=jax.P("i"),
        check_vma=False,
    )
    x = _inputs([(8, 3)])[0]

    @jax.jit
    def values_and_grads(x, ct):
        y, vjp = jax.vjp(sm, x)
        return y, vjp(ct)

    shape = jax.eval_shape(sm, x).shape
    ct = np.random.RandomState(7).randint(-3, 4, size=shape).astype(np.float32)
    y, (g,) = values_and_grads(x, ct)
    return [np.asarray(y)], [np.asarray(g)], ct


class JaxNamesGrouped:
    def __init__(self):
        self.psum, self.pmean, self.all_gather, self.sin = lax.psum, lax.pmean, lax.all_gather, jnp.sin
        self.pmax, self.pmin = lax.pmax, lax.pmin


class CmNamesGrouped:
    def __init__(self):
        self.psum, self.pmean, self.all_gather, self.sin = cm.psum, cm.pmean, cm.all_gather, torch.sin
        self.pmax, self.pmin = cm.pmax, cm.pmin


def cm_grouped(cts):
    """Every case with check_vma on and off: values and the gradient for jax's cotangent."""
    mesh = sc.mesh((4,), ("i",))
    out = {}
    for name, ct in cts.items():
        for check in (True, False):
            f = grouped_cases(CmNamesGrouped())[name]
            x = torch.from_numpy(_inputs([(8, 3)])[0]).requires_grad_()
            y = shard_map(f, mesh, P("i"), P("i"), check_vma=check)(x)
            y.backward(torch.from_numpy(ct))
            out[name, check] = ([y.detach().numpy()], [x.grad.numpy()])
    return out


def grouped_errors():
    mesh = sc.mesh((4,), ("i",))
    out = {}
    for label, groups in (("uneven", [[0, 1, 2], [3]]), ("no cover", [[0, 1], [1, 2]]), ("short", [[0, 1], [2]])):
        try:
            shard_map(lambda b: cm.psum(b, "i", axis_index_groups=groups), mesh, P("i"), P("i"))(torch.ones(4))
            out[label] = "no error"
        except cm.CmapError as exc:
            out[label] = (isinstance(exc, ValueError), str(exc))
    try:  # loop mode's examples meet at one stacked value, with no per-example results
        cm.cmap(lambda v: cm.psum(v, "b", axis_index_groups=[[0, 1], [2, 3]]), axis_name="b", mode="loop")(
            torch.ones(4)
        )
        out["loop"] = "no error"
    except cm.CmapError as exc:
        out["loop"] = (isinstance(exc, NotImplementedError), str(exc))
    try:  # a grouped psum is invariant within its group only: its type varies over the axis
        shard_map(lambda b: cm.psum(b, "i", axis_index_groups=[[0, 1], [2, 3]]), mesh, P("i"), P())(torch.ones(4))
        out["typed P()"] = "no error"
    except cm.CmapError as exc:
        out["typed P()"] = (isinstance(exc, ValueError), str(exc))
    return out


def test_axis_index_groups_against_jax(worlds):
    """Grouped psum, pmean and all_gather in shard_map: values and gradients on every rank are jax's (check_vma=False,
    the only mode where jax has them), with check_vma on and off; jax's check_vma=True raises NotImplementedError."""
    want, cts = {}, {}
    names = list(grouped_cases(JaxNamesGrouped()))
    for name in names:
        ys, grads, ct = jax_grouped(name)
        want[name], cts[name] = (ys, grads), ct
    with pytest.raises(NotImplementedError):
        f = grouped_cases(JaxNamesGrouped())["psum [[0, 1], [2, 3]]"]
        jax.shard_map(
            f,
            mesh=jax.make_mesh((4,), ("i",), (jax.sharding.AxisType.Auto,)),
            in_specs=jax.P("i"),
            out_specs=jax.P("i"),
        )(np.ones(8, np.float32))
    got = worlds(4).run(cm_grouped, cts)
    for name in names:
        for check in (True, False):
            tol = lambda kind, k: (1e-5, 1e-5)  # noqa: E731 (sin's ulps, as above)
            sc.compare_with_jax([rank[name, check] for rank in got], want[name], tol, f"{name} check_vma={check}")
    for errors in worlds(4).run(grouped_errors):
        assert errors["uneven"][0] and "every group must have the same size" in errors["uneven"][1], errors
        assert errors["no cover"][0] and "must cover all indices exactly once" in errors["no cover"][1], errors
        assert errors["short"][0] and "must cover all indices exactly once" in errors["short"][1], errors
        assert errors["typed P()"][0] and "possibly varying over {i}" in errors["typed P()"][1], errors
        assert errors["loop"][0] and "not in mode='loop'" in errors["loop"][1], errors


# cmap's named axes: 8 examples on 4 ranks; groups within a rank, across ranks, and mixed
CMAP_GROUPS = {
    "within ranks": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "across ranks": [[0, 5], [4, 1], [2, 7], [6, 3]],
    "fours": [[7, 0, 3, 4], [1, 2, 5, 6]],
}


def grouped_reference(x, groups, op):
    """Per example, its group's sum or its group's values in order (single process)."""
    out = []
    for i in range(x.shape[0]):
        g = next(g for g in groups if i in g)
        rows = torch.stack([x[j] for j in g])
        out.append(rows.sum(0) if op == "psum" else rows)
    return torch.stack(out)


def cmap_grouped(mode):
    x = sc.randn(8, 3, seed=4)
    out = {}
    for label, groups in CMAP_GROUPS.items():
        for op in ("psum", "all_gather"):
            fn = getattr(cm, op)

            def f(v):
                return fn(torch.sin(v), "b", axis_index_groups=groups) * 2

            got = sc.values_and_grads(cm.cmap(f, axis_name="b", mode=mode), x)
            want = sc.values_and_grads(lambda t: grouped_reference(torch.sin(t), groups, op) * 2, x)
            sc.compare(f"{label} {op} {mode}", got, want)
            out[label, op] = True
    return out


@pytest.mark.parametrize("mode", ["vmap", "batched"])
def test_axis_index_groups_in_cmap_axes(worlds, mode):
    """In cmap's named axes the groups are of examples: their values and gradients are those of the single-process
    reference, for groups within a rank (no communication), across ranks and of four."""
    got = worlds(4).run(cmap_grouped, mode)
    assert all(all(r.values()) for r in got)


def grouped_bytes():
    """Bytes this rank sends for a psum of 4096 float32 over the whole 4-rank axis and within groups of 2."""
    mesh = sc.mesh((4,), ("i",))
    groupings = (("full", None), ("pairs", [[0, 1], [2, 3]]), ("strided pairs", [[0, 2], [1, 3]]))
    return {label: psum_sent(mesh, "i", groups) for label, groups in groupings}


def psum_sent(mesh, axes, groups):
    """The bytes this rank sends in all, the collectives, and the bytes of its all-reduces, for one psum of 4096
    float32 over ``axes`` within ``groups`` (this rank's block: local=True, so nothing but the psum and the exit's
    rounds travels)."""
    import wire_tap

    x = torch.randn(4096)
    f = shard_map(
        lambda b: cm.psum(b, axes, axis_index_groups=groups), mesh, P(axes), P(axes), check_vma=False, local=True
    )
    f(x)  # the sub-groups are made on first use
    with wire_tap.counting() as log:
        f(x)
    return log.sent, log.names(), sum(b for name, b in log.calls if name == "all_reduce")


def test_axis_index_groups_bytes(worlds):
    """A grouped psum is an all-reduce over the group's ranks: per rank 2 (g - 1) / g n for groups of g, not the
    full group's 2 (P - 1) / P n (plus the call's few KiB of status rounds, alike in both)."""
    got = worlds(4).run(grouped_bytes)
    n = 4096 * 4
    for r in got:
        full, pairs, strided = r["full"][0], r["pairs"][0], r["strided pairs"][0]
        print("bytes per rank, full / pairs / strided pairs:", full, pairs, strided)
        # the data's bytes are the ring's; the status rounds beside them are counted in the totals' bound only
        assert (r["full"][2], r["pairs"][2], r["strided pairs"][2]) == (1.5 * n, 1.0 * n, 1.0 * n), r
        assert pairs <= 1.0 * n + 16 * 1024 and strided <= 1.0 * n + 16 * 1024, r


# groups over a tuple of mesh axes: they index the axes taken together, the first name major (jax's meaning)
def tuple_grouped_cases(m):
    return {
        "psum (x, y) [[0, 3], [1, 2]]": lambda b: m.psum(m.sin(b), ("x", "y"), axis_index_groups=[[0, 3], [1, 2]]),
        "psum (x, y) along x": lambda b: m.psum(b * b, ("x", "y"), axis_index_groups=[[2, 0], [3, 1]]),
        "psum (y, x) [[0, 1], [2, 3]]": lambda b: m.psum(m.sin(b), ("y", "x"), axis_index_groups=[[0, 1], [2, 3]]),
        "pmean (x, y) [[1, 2], [3, 0]]": lambda b: m.pmean(b * 3, ("x", "y"), axis_index_groups=[[1, 2], [3, 0]]),
        "all_gather (x, y)": lambda b: m.all_gather(m.sin(b), ("x", "y"), axis_index_groups=[[0, 2], [3, 1]]),
        "all_gather (y, x) tiled axis 1": lambda b: m.all_gather(
            b * b, ("y", "x"), axis_index_groups=[[2, 0], [1, 3]], axis=1, tiled=True
        ),
        "all_gather (x, y) of fours": lambda b: m.all_gather(b, ("x", "y"), axis_index_groups=[[3, 1, 0, 2]]),
    }


def jax_tuple_grouped(name):
    f = tuple_grouped_cases(JaxNamesGrouped())[name]
    spec = jax.P(("x", "y"))
    sm = jax.shard_map(f, mesh=jax_mesh(), in_specs=spec, out_specs=spec, check_vma=False)
    x = np.random.RandomState(3).randint(-3, 4, size=(4, 3)).astype(np.float32)
    y, vjp = jax.vjp(jax.jit(sm), x)
    ct = np.random.RandomState(7).randint(-3, 4, size=y.shape).astype(np.float32)
    return x, ([np.asarray(y)], [np.asarray(vjp(ct)[0])]), ct


def cm_tuple_grouped(xs, cts):
    """Every case with check_vma on and off: values and the gradient for jax's cotangent, on the 2x2 mesh."""
    out = {}
    for name, ct in cts.items():
        for check in (True, False):
            f = tuple_grouped_cases(CmNamesGrouped())[name]
            x = torch.from_numpy(xs[name]).requires_grad_()
            y = shard_map(f, cm_mesh(), P(("x", "y")), P(("x", "y")), check_vma=check)(x)
            y.backward(torch.from_numpy(ct))
            out[name, check] = ([y.detach().numpy()], [x.grad.numpy()])
    return out


def test_axis_index_groups_over_a_tuple_of_mesh_axes_against_jax(worlds):
    """Groups over ("x", "y") index the axes taken together, "x" major (over ("y", "x"), "y" major): grouped psum,
    pmean and all_gather give jax's values and gradients on every rank, with check_vma on and off."""
    names = list(tuple_grouped_cases(JaxNamesGrouped()))
    xs, want, cts = {}, {}, {}
    for name in names:
        xs[name], want[name], cts[name] = jax_tuple_grouped(name)
    got = worlds(4).run(cm_tuple_grouped, xs, cts)
    for name in names:
        for check in (True, False):
            tol = lambda kind, k: (1e-5, 1e-5)  # noqa: E731 (sin's ulps, as above)
            sc.compare_with_jax([rank[name, check] for rank in got], want[name], tol, f"{name} check_vma={check}")


def cmap_tuple_grouped():
    """Groups over the axes of two nested cmaps ("b" over the ranks, "c" inside it: 4 x 2 examples, the index
    b * 2 + c), and over a mesh axis and a cmap inside the shard_map ("x" of 2 ranks, "c" of 4 examples: the index
    x * 4 + c); values and gradients against the single-process reference."""
    x = sc.randn(4, 2, 3, seed=4)
    groups = [[0, 5], [4, 1], [2, 7], [6, 3]]
    mesh = sc.mesh((2,), ("x",))
    for op in ("psum", "all_gather"):
        fn = getattr(cm, op)

        def inner(v, names):
            return fn(torch.sin(v), names, axis_index_groups=groups) * 2

        def want(t):
            return grouped_reference(torch.sin(t.flatten(0, -2)), groups, op).unflatten(0, t.shape[:-1]) * 2

        nested = cm.cmap(cm.cmap(lambda v: inner(v, ("b", "c")), axis_name="c"), axis_name="b")
        sc.compare(f"{op} over cmaps", sc.values_and_grads(nested, x), sc.values_and_grads(want, x))
        y = x.reshape(8, 3)  # a block of 4 examples per rank
        in_mesh = shard_map(cm.cmap(lambda v: inner(v, ("x", "c")), axis_name="c"), mesh, P("x"), P("x"))
        sc.compare(f"{op} over x, c", sc.values_and_grads(in_mesh, y), sc.values_and_grads(want, y))
    return True


def test_axis_index_groups_over_a_tuple_of_cmap_axes(worlds):
    """Groups over a tuple naming cmap axes index the axes taken together, the first name major, as over mesh
    axes: each example gets its own group's sum or values."""
    assert all(worlds(2).run(cmap_tuple_grouped))


def tuple_grouped_bytes():
    """Bytes this rank sends for a psum of 4096 float32 over ("x", "y") of the 2x2 mesh, whole and within pairs."""
    groupings = (("full", None), ("pairs along y", [[0, 1], [2, 3]]), ("diagonal pairs", [[0, 3], [1, 2]]))
    return {label: psum_sent(cm_mesh(), ("x", "y"), groups) for label, groups in groupings}


def test_axis_index_groups_over_a_tuple_bytes(worlds):
    """Groups over a tuple of mesh axes are all-reduces over each group's ranks, as over one axis: n per rank for
    pairs, where the whole 4 ranks send 1.5 n."""
    got = worlds(4).run(tuple_grouped_bytes)
    n = 4096 * 4
    for r in got:
        full, along, diagonal = r["full"][0], r["pairs along y"][0], r["diagonal pairs"][0]
        print("bytes per rank, full / pairs along y / diagonal pairs:", full, along, diagonal, r["diagonal pairs"][1])
        # the data's bytes are the ring's over each group; the status rounds are bounded in the totals only: a
        # mesh's exits take a round on each group its calls' f used (noted with the mesh for as long as the process
        # keeps it), so they depend on which checks ran before this one in the same pooled world
        assert (r["full"][2], r["pairs along y"][2], r["diagonal pairs"][2]) == (1.5 * n, 1.0 * n, 1.0 * n), r
        assert full <= 1.5 * n + 16 * 1024 and along <= 1.0 * n + 16 * 1024 and diagonal <= 1.0 * n + 16 * 1024, r
        # one all-reduce per pair in both, and the status rounds may differ by one: the diagonal pairs are one more
        # noted part than the pairs along y, unless a check before this one used them on this mesh already
        reduces = [
            [name for name in r[k][1] if name != "all_gather_into_tensor"] for k in ("pairs along y", "diagonal pairs")
        ]
        assert reduces[0] == reduces[1] == ["all_reduce"], r
        assert 0 <= len(r["diagonal pairs"][1]) - len(r["pairs along y"][1]) <= 1, r


def grouped_on_an_axis_s_groups():
    """On a 2x2 mesh of its own: grouped psums over ("x", "y") whose groups are the y axis's ([[0, 1], [2, 3]]) and
    the x axis's ([[0, 2], [1, 3]]), each counted once steady; then a shard_map of sin on that mesh, counted: this
    rank's collectives, each with its group ("x" or "y" for the axes' own, else its ranks), and whether the sums are
    exact."""
    import torch.distributed as dist
    import wire_tap
    from torch.distributed.device_mesh import init_device_mesh

    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    names = {square.get_group("x"): "x", square.get_group("y"): "y"}

    def label(group):
        return names.get(group, tuple(dist.get_process_group_ranks(group)))

    x = torch.randint(-3, 4, (4, 8)).float()  # small integers: the sums are exact in any order
    seen, exact = {}, True
    for axis, groups, want in (("y", [[0, 1], [2, 3]], x.view(2, 2, 8).sum(1)), ("x", [[0, 2], [1, 3]], None)):
        f = shard_map(lambda b: cm.psum(b, ("x", "y"), axis_index_groups=groups), square, P(("x", "y")), P(("x", "y")))
        f(x)
        with wire_tap.counting() as log:
            y = f(x)
        want = x.view(2, 2, 8).sum(1).repeat_interleave(2, 0) if axis == "y" else x.view(2, 2, 8).sum(0).repeat(2, 1)
        exact = exact and torch.equal(y, want)
        seen[axis] = [(name, label(group)) for name, group, _ in log.where]
    plain = shard_map(torch.sin, square, P("x", "y"), P("x", "y"))
    plain(x)
    with wire_tap.counting() as log:
        plain(x)
    seen["exit"] = [(name, label(group)) for name, group, _ in log.where]
    return seen, exact


def test_a_grouped_psum_over_an_axis_s_groups_runs_on_that_axis_and_adds_no_round_to_the_exits(worlds):
    """Groups over ("x", "y") that are the groups of one mesh axis make the psum that axis's own, on the axis's group
    (no group of the same ranks beside it): the mesh's later exits take their rounds on the whole mesh and the axes
    the psums took, none on a copy of an axis."""
    for seen, exact in worlds(4).run(grouped_on_an_axis_s_groups, deadline=60):
        assert exact, seen
        # each psum is its axis's round (8 floats ride in it), then the exit's rounds: on each axis noted so far (in
        # the order first met), then the whole mesh's
        rounds = lambda *groups: [("all_gather_into_tensor", group) for group in groups]  # noqa: E731
        assert seen["y"] == rounds("y", "y", (0, 1, 2, 3)), seen
        assert seen["x"] == rounds("x", "y", "x", (0, 1, 2, 3)), seen
        assert seen["exit"] == rounds("y", "x", (0, 1, 2, 3)), seen


# grouped pmax and pmin (jax takes axis_index_groups there too): values only, neither is differentiable
def grouped_extreme_cases(m):
    """name: (the mesh's axis names, the spec's axes, f)."""
    return {
        "pmax i [[0, 3], [1, 2]]": (("i",), "i", lambda b: m.pmax(m.sin(b), "i", axis_index_groups=[[0, 3], [1, 2]])),
        "pmin i [[2, 0], [1, 3]]": (("i",), "i", lambda b: m.pmin(m.sin(b), "i", axis_index_groups=[[2, 0], [1, 3]])),
        "pmax (x, y) [[0, 3], [1, 2]]": (
            ("x", "y"),
            ("x", "y"),
            lambda b: m.pmax(m.sin(b), ("x", "y"), axis_index_groups=[[0, 3], [1, 2]]),
        ),
        "pmin (y, x) [[0, 1], [2, 3]]": (
            ("x", "y"),
            ("x", "y"),
            lambda b: m.pmin(m.sin(b), ("y", "x"), axis_index_groups=[[0, 1], [2, 3]]),
        ),
    }


def extreme_input():
    return np.random.RandomState(5).randint(-3, 4, size=(4, 3)).astype(np.float32)


def jax_grouped_extreme(name, check):
    names, axes, f = grouped_extreme_cases(JaxNamesGrouped())[name]
    mesh = jax.make_mesh((4,) if names == ("i",) else (2, 2), names, (jax.sharding.AxisType.Auto,) * len(names))
    sm = jax.shard_map(f, mesh=mesh, in_specs=jax.P(axes), out_specs=jax.P(axes), check_vma=check)
    return np.asarray(jax.jit(sm)(extreme_input()))


def cm_grouped_extremes():
    out = {}
    for name, (names, axes, f) in grouped_extreme_cases(CmNamesGrouped()).items():
        mesh = sc.mesh((4,), ("i",)) if names == ("i",) else cm_mesh()
        for check in (True, False):
            out[name, check] = shard_map(f, mesh, P(axes), P(axes), check_vma=check)(torch.from_numpy(extreme_input()))
    x = sc.randn(8, 3, seed=4)
    for mode in ("vmap", "batched"):  # in a cmap axis: the single-process reference
        for op in ("pmax", "pmin"):
            groups = CMAP_GROUPS["across ranks"]
            f = cm.cmap(lambda v: getattr(cm, op)(v, "b", axis_index_groups=groups), axis_name="b", mode=mode)
            want = grouped_reference(x, groups, "all_gather")
            want = want.amax(1) if op == "pmax" else want.amin(1)
            assert torch.equal(f(x), want), (mode, op)
    return out


def test_grouped_pmax_and_pmin_against_jax(worlds):
    """pmax and pmin take axis_index_groups as jax's do, over one mesh axis and over a tuple of them, with
    check_vma on and off (jax computes both), and in cmap's axes."""
    got = worlds(4).run(cm_grouped_extremes)
    for name in grouped_extreme_cases(JaxNamesGrouped()):
        for check in (True, False):
            want = jax_grouped_extreme(name, check)
            for rank, values in enumerate(got):
                np.testing.assert_allclose(values[name, check].numpy(), want, 1e-6, 1e-6, err_msg=f"{name} {rank}")


def cm_untyped_outer(cts):
    """smap inside a shard_map with check_vma=False (its output P(), a psum over the outer axis inside the smap):
    values and the gradient for jax's cotangent."""
    names = CmNames()
    names.shard_map = lambda *a, **k: shard_map(*a, **k, check_vma=False)
    args = [torch.from_numpy(a).requires_grad_() for a in _inputs(PROGRAMS["in a shard_map"][1])]
    y = in_shard_map(names, *args)
    y.backward(torch.from_numpy(cts[0]))
    return [y.detach().numpy()], [a.grad.numpy() for a in args]


def test_smap_in_an_untyped_shard_map(worlds):
    """smap inside a shard_map with check_vma=False: values and gradients on every rank are the flat shard_map's
    (jax's, computed flat: its grad through the nested smap raises)."""
    ys, grads, cts = jax_program("in a shard_map")
    got = worlds(4).run(cm_untyped_outer, cts)
    sc.compare_with_jax(got, (ys, grads), lambda kind, k: (1e-5, 1e-5), "smap in an untyped shard_map")
