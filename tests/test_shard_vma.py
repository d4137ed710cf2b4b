"""shard_map at jax 0.10's API: ``pcast``/``pvary``, ``all_gather_invariant`` (and ``all_gather(..., to="invarying")``),
``pbroadcast``, and the varying-axis types of ``check_vma=True`` (the default), against jax 0.10 on 4 host devices.

* Values and gradients on every rank equal jax's (the same function written twice, ``jax_*`` and ``cm_*``), with
  ``check_vma`` on and off on both sides. Inputs and cotangents are small integers in float32: every sum is exact,
  so the comparison is exact.
* The types: where jax's ``check_vma`` raises for an out_specs entry that claims replication, cmap raises (a
  ``CmapError`` that is a ``ValueError``, on every rank, naming the path and the axis); where jax accepts, cmap
  accepts and returns jax's value.
* Backward communication: the collectives that jax's compiled gradient adds to its forward (counted in its HLO)
  are the collectives cmap's backward makes inside ``f`` (cmap's backward also gathers the split inputs' gradients,
  so every rank holds the whole gradient, which jax leaves sharded: one more collective, counted apart).
* In cmap's named axes (no types) the new names are jax's untyped meanings: ``pcast`` the identity,
  ``all_gather_invariant`` ``all_gather``, ``pbroadcast`` the psum of the masked value.
"""

import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import shard_cases as sc  # noqa: E402
import torch  # noqa: E402
import wire_tap  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import colossalai_cmap as cm  # noqa: E402
from colossalai_cmap import P, shard_map  # noqa: E402

EXAMPLES = sys.modules[__name__]

jax, jnp, lax = sc.jax_modules()  # None on a gloo rank, which imports this module for the ports


def jax_mesh(shape, names):
    return jax.make_mesh(shape, names, (jax.sharding.AxisType.Auto,) * len(shape))


def cm_mesh(shape, names):
    return sc.mesh(shape, names)


# ------------------------------------------------------------------ the same functions, jax's and cmap's
# name: (mesh shape, names, in_specs, out_specs, jax's f, cmap's f, global input shapes)
def _cases(P_, psum, pcast, agi, ag, pbroadcast, pmean, axis_index, closure):
    return {
        "psum(w*x)": ((4,), ("i",), (P_(), P_("i")), P_(), lambda w, x: psum(w * x, "i"), [(2,), (8, 2)]),
        "psum(x)*w": ((4,), ("i",), (P_(), P_("i")), P_(), lambda w, x: psum(x, "i") * w, [(2,), (8, 2)]),
        "psum(pcast(w))": ((4,), ("i",), (P_(),), P_(), lambda w: psum(pcast(w, "i"), "i"), [(3,)]),
        "pcast then mul": ((4,), ("i",), (P_(), P_("i")), P_("i"), lambda w, x: pcast(w, "i") * x, [(2,), (8, 2)]),
        "all_gather_invariant tiled": ((4,), ("i",), (P_("i"),), P_(), lambda x: agi(x, "i", 0, True), [(8, 3)]),
        "all_gather_invariant axis 1": ((4,), ("i",), (P_("i"),), P_(), lambda x: agi(x, "i", 1, False), [(8, 3)]),
        "all_gather to invarying (x, y)": (
            (2, 2),
            ("x", "y"),
            (P_(("x", "y")),),
            P_(),
            lambda x: ag(x, ("x", "y")),
            [(8, 3)],
        ),
        "all_gather_invariant of a replicated w": (
            (4,),
            ("i",),
            (P_(), P_("i")),
            P_(),
            lambda w, x: agi(w, "i", 0, False) * psum(x.sum(), "i"),
            [(2,), (8,)],
        ),
        "pbroadcast": ((4,), ("i",), (P_("i"),), P_("i"), lambda x: pbroadcast(x, "i", 2), [(8, 2)]),
        "pbroadcast on (x, y)": (
            (2, 2),
            ("x", "y"),
            (P_("x", "y"),),
            P_("x", "y"),
            lambda x: pbroadcast(x, ("x", "y"), 1),
            [(4, 4)],
        ),
        "psum over y of a block varying over x": (
            (2, 2),
            ("x", "y"),
            (P_("x", "y"), P_()),
            P_("x", None),
            lambda x, w: psum(x * w, "y"),
            [(4, 4), (2, 2)],
        ),
        # redundant psums: jax 0.10 accepts them with check_vma=True, a psum of an invariant value is N times it
        "psum(psum(x))": ((4,), ("i",), (P_("i"),), P_(), lambda x: psum(psum(x, "i"), "i"), [(8, 2)]),
        "pmean(pmean(x))": ((4,), ("i",), (P_("i"),), P_(), lambda x: pmean(pmean(x, "i"), "i"), [(8, 2)]),
        "psum of a replicated w": ((4,), ("i",), (P_(),), P_(), lambda w: psum(w, "i"), [(3,)]),
        "psum of a closure": ((4,), ("i",), (P_("i"),), P_(), lambda x: psum(closure, "i") * psum(x, "i"), [(8, 2)]),
        # check_vma=False only (with it, jax and cmap refuse the out_specs): a P() output that in fact varies, whose
        # cotangent jax splits evenly across its copies
        "a varying block to P()": ((4,), ("i",), (P_("i"),), P_(), lambda x: x * x, [(8, 2)]),
        "a varying product to P()": ((4,), ("i",), (P_("i"), P_()), P_(), lambda x, w: x * w, [(8, 2), (2,)]),
        "varying over y to P(x)": (
            (2, 2),
            ("x", "y"),
            (P_("x"),),
            P_("x"),
            lambda x: x * (1 + axis_index("y")),
            [(8, 2)],
        ),
        "varying over x to P(None, y)": (
            (2, 2),
            ("x", "y"),
            (P_("x", "y"), P_()),
            P_(None, "y"),
            lambda x, w: x * w * (1 + axis_index("x")),
            [(4, 4), (2,)],
        ),
    }


CLOSURE = np.array([1.0, -2.0], dtype=np.float32)


def jax_cases(check_vma=True):
    def pcast(w, ax):
        return lax.pcast(w, ax, to="varying") if check_vma else w

    def agi(x, ax, axis, tiled):
        return lax.all_gather(x, ax, axis=axis, tiled=tiled, to="invarying" if check_vma else "varying")

    def pbroadcast(x, ax, source):  # jax's documented equivalent (its pbroadcast has no CPU lowering)
        return lax.psum(jnp.where(lax.axis_index(ax) == source, x, jnp.zeros_like(x)), ax)

    ag = lambda x, ax: agi(x, ax, 0, False)  # noqa: E731
    return _cases(jax.P, lax.psum, pcast, agi, ag, pbroadcast, lax.pmean, lax.axis_index, jnp.asarray(CLOSURE))


def cm_cases():
    return _cases(
        P,
        cm.psum,
        lambda w, ax: cm.pcast(w, ax, to="varying"),
        lambda x, ax, axis, tiled: cm.all_gather_invariant(x, ax, axis=axis, tiled=tiled),
        lambda x, ax: cm.all_gather(x, ax, to="invarying"),
        cm.pbroadcast,
        cm.pmean,
        cm.axis_index,
        torch.from_numpy(CLOSURE),
    )


def _inputs(shapes):
    rng = np.random.RandomState(sum(map(len, shapes)))
    return tuple(rng.randint(-3, 4, size=s).astype(np.float32) for s in shapes)


def run_jax_case(name, check_vma, cotangent_seed=5):
    shape, names, ins, outs, f, shapes = jax_cases(check_vma)[name]
    sm = jax.shard_map(f, mesh=jax_mesh(shape, names), in_specs=ins, out_specs=outs, check_vma=check_vma)
    args = _inputs(shapes)
    shape_out = jax.eval_shape(sm, *args).shape
    ct = np.random.RandomState(cotangent_seed).randint(-3, 4, size=shape_out).astype(np.float32)

    @jax.jit
    def values_and_grads(args, ct):  # one small program: jax's eager shard_map is slow
        y, vjp = jax.vjp(sm, *args)
        return y, vjp(ct)

    y, grads = values_and_grads(args, ct)
    return [np.asarray(y)], [np.asarray(g) for g in grads], ct


def run_cm_case(name, check_vma, ct):
    shape, names, ins, outs, f, shapes = cm_cases()[name]
    sm = shard_map(f, mesh=cm_mesh(shape, names), in_specs=ins, out_specs=outs, check_vma=check_vma)
    args = [torch.from_numpy(a).requires_grad_() for a in _inputs(shapes)]
    y = sm(*args)
    y.backward(torch.from_numpy(ct))
    return [y.detach().numpy()], [a.grad.numpy() for a in args]


CASE_NAMES = [
    "psum(w*x)",
    "psum(x)*w",
    "psum(pcast(w))",
    "pcast then mul",
    "all_gather_invariant tiled",
    "all_gather_invariant axis 1",
    "all_gather to invarying (x, y)",
    "all_gather_invariant of a replicated w",
    "pbroadcast",
    "pbroadcast on (x, y)",
    "psum over y of a block varying over x",
    "psum(psum(x))",
    "pmean(pmean(x))",
    "psum of a replicated w",
    "psum of a closure",
]
UNTYPED_ONLY = [
    "a varying block to P()",
    "a varying product to P()",
    "varying over y to P(x)",
    "varying over x to P(None, y)",
]


def run_cm_cases(cts):
    """Every case, with and without types, on this rank."""
    return {(name, check): run_cm_case(name, check, cts[name, check]) for name, check in cts}


def test_new_collectives_against_jax(worlds):
    """Values and gradients (a vjp with an integer cotangent) on every rank, exactly jax's, check_vma on and off
    (off only for the outputs that claim replication wrongly: jax gives each copy an even share of the cotangent)."""
    want, cts = {}, {}
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)  # halves the compile time of these tiny programs
    try:
        for name in CASE_NAMES + UNTYPED_ONLY:
            for check in (False,) if name in UNTYPED_ONLY else (True, False):
                ys, grads, ct = run_jax_case(name, check)
                want[name, check], cts[name, check] = (ys, grads), ct
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)
    got = worlds(4).run(run_cm_cases, cts)
    for key, (ys, grads) in want.items():
        sc.compare_with_jax([rank[key] for rank in got], (ys, grads), None, f"{key[0]} (check_vma={key[1]})")


# ----------------------------------------------------------------------------------------- the type check
def check_table(m, zeros_like, argmax):
    """name: (the in_specs entry of x (8,), f written with the collectives of ``m``, jax.lax or cm); out_specs P()."""
    return {
        "all_gather to P()": ("i", lambda x: m.all_gather(x, "i")),
        "zeros_like": ("i", lambda x: zeros_like(x)),
        "axis_index": ("i", lambda x: x * 0 + m.axis_index("i")),
        "ppermute of a psum": ("i", lambda x: m.ppermute(m.psum(x, "i"), "i", [(0, 1), (1, 0), (2, 3), (3, 2)])),
        "psum_scatter": ("i", lambda x: m.psum_scatter(x, "i", tiled=True)),
        "a block": ("i", lambda x: x),
        "pmax": ("i", lambda x: m.pmax(x, "i")),
        "psum of a replicated value": (None, lambda x: m.psum(x * 2, "i")),
        "argmax of a psum": ("i", lambda x: argmax(m.psum(x, "i"))),
        "a replicated block": (None, lambda x: x * 3),
    }


def jax_check(name):
    table = check_table(lax, jnp.zeros_like, jnp.argmax)
    spec, f = table[name]
    sm = jax.shard_map(f, mesh=jax_mesh((4,), ("i",)), in_specs=jax.P(spec), out_specs=jax.P())
    try:
        return ("ok", np.asarray(sm(np.arange(8.0, dtype=np.float32))).tolist())
    except ValueError as exc:
        return ("raised", str(exc))


def cm_checks(names):
    table = check_table(cm, torch.zeros_like, torch.argmax)
    out = {}
    for name in names:
        spec, f = table[name]
        try:
            y = shard_map(f, mesh=cm_mesh((4,), ("i",)), in_specs=P(spec), out_specs=P())(torch.arange(8.0))
            out[name] = ("ok", y.tolist())
        except cm.CmapError as exc:
            out[name] = ("raised", str(exc), isinstance(exc, ValueError))
    return out


def test_out_specs_checked_as_jax_does(worlds):
    """Where jax's check_vma raises (an out_specs P() for a value that varies), cmap raises on every rank; where jax
    accepts, cmap accepts and returns jax's value."""
    names = list(check_table(lax, jnp.zeros_like, jnp.argmax))
    want = {n: jax_check(n) for n in names}
    assert [n for n in names if want[n][0] == "raised"] == [
        "all_gather to P()",
        "zeros_like",
        "axis_index",
        "ppermute of a psum",
        "psum_scatter",
        "a block",
    ], want
    for rank, got in enumerate(worlds(4).run(cm_checks, names)):
        for n in names:
            assert got[n][0] == want[n][0], (rank, n, got[n], want[n])
            if want[n][0] == "ok":
                assert got[n][1] == want[n][1], (rank, n, got[n], want[n])
            else:
                assert got[n][2], f"{n}: the CmapError is also a ValueError"
                assert "was inferred to be possibly varying over {i}" in got[n][1], got[n][1]


def cm_wrong_pytree_spec():
    """jax's message for a pytree: only the output at fault is named, with its path and axis."""
    m = cm_mesh((2, 2), ("x", "y"))
    out = {}

    def f(a, b):
        return a, {"v": b * 2, "w": cm.psum(b, "x")}

    specs = (P("x"), {"v": P(), "w": P()})
    try:
        shard_map(f, mesh=m, in_specs=(P("x"), P("x")), out_specs=specs)(torch.ones(4), torch.ones(4))
    except cm.CmapError as exc:
        out["typed"] = (str(exc), isinstance(exc, ValueError))
    y = shard_map(f, mesh=m, in_specs=(P("x"), P("x")), out_specs=specs, check_vma=False)(torch.ones(4), torch.ones(4))
    out["untyped"] = y[1]["v"].tolist()
    for label, run in {
        "pcast of a varying value": lambda: shard_map(
            lambda a: cm.pcast(a, "x", to="varying"), mesh=m, in_specs=P("x"), out_specs=P("x")
        )(torch.ones(4)),
        "pcast without to": lambda: shard_map(lambda a: cm.pcast(a, "x"), mesh=m, in_specs=P(), out_specs=P("x"))(
            torch.ones(4)
        ),
        "pvary of a varying value": lambda: shard_map(
            lambda a: cm.pvary(a, ("x", "y")), mesh=m, in_specs=P("y"), out_specs=P("y")
        )(torch.ones(4)),
    }.items():
        try:
            run()
            out[label] = "no error"
        except cm.CmapError as exc:
            out[label] = str(exc)
    return out


def test_wrong_out_specs_message(worlds):
    """The sentence of jax's error (checked against jax's own), the pytree path and the axis, every rank."""
    mesh = jax_mesh((2, 2), ("x", "y"))
    with pytest.raises(ValueError) as jax_error:
        jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P())(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="Unsupported pcast from=varying, to='varying'"):
        jax.shard_map(lambda a: lax.pcast(a, "x", to="varying"), mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))(
            np.ones(4, np.float32)
        )
    sentence = "was given out_specs which require replication which can't be statically inferred given the mesh:"
    assert sentence in str(jax_error.value)
    for got in worlds(4).run(cm_wrong_pytree_spec):
        text, is_value_error = got["typed"]
        assert is_value_error and sentence in text, text
        assert "shard_map applied to the function 'f'" in text, text
        want = (
            "out_specs[1]['v'] is P() which implies that the corresponding output value is only varying across mesh "
            "axes {} and not {x}, but it was inferred to be possibly varying over {x}"
        )
        assert want in text and "out_specs[1]['w']" not in text and "out_specs[0]" not in text, text
        assert "consider disabling the check by passing the check_vma=False argument" in text, text
        assert got["untyped"] == [2.0, 2.0]  # without the check: coordinate 0's block, as before
        assert "Unsupported pcast from=varying, to='varying'" in got["pcast of a varying value"]
        assert "missing 1 required keyword-only argument: 'to'" in got["pcast without to"]
        assert "Unsupported pcast from=varying" in got["pvary of a varying value"]


# ---------------------------------------------------------------------------------- backward communication
BACKWARD = {  # name: (in_specs, f, out_specs); inputs w (2,), x (8, 2)
    "psum(w*x)": ((P(), P("i")), lambda w, x: cm.psum(w * x, "i"), P()),
    "psum(x)*w": ((P(), P("i")), lambda w, x: cm.psum(x, "i") * w, P()),
    "psum(pcast(w))": (
        (P(), P("i")),
        lambda w, x: cm.psum(cm.pcast(w, "i", to="varying"), "i") * cm.psum(x.sum(0), "i"),
        P(),
    ),
    "all_gather_invariant": ((P(), P("i")), lambda w, x: cm.all_gather_invariant(x, "i", tiled=True) * w, P()),
    "megatron mlp": (
        (P(), P(None, "i"), P("i", None)),
        lambda x, w1, w2: cm.psum(torch.relu(x @ w1) @ w2, "i"),
        P(),
    ),
}


def jax_backward(name, check_vma):
    """Collectives in jax's compiled gradient less those of its forward."""
    pcast = (lambda v: lax.pcast(v, "i", to="varying")) if check_vma else (lambda v: v)
    table = {
        "psum(w*x)": ((jax.P(), jax.P("i")), lambda w, x: lax.psum(w * x, "i"), jax.P()),
        "psum(x)*w": ((jax.P(), jax.P("i")), lambda w, x: lax.psum(x, "i") * w, jax.P()),
        "psum(pcast(w))": (
            (jax.P(), jax.P("i")),
            lambda w, x: lax.psum(pcast(w), "i") * lax.psum(x.sum(0), "i"),
            jax.P(),
        ),
        "all_gather_invariant": (
            (jax.P(), jax.P("i")),
            lambda w, x: lax.all_gather(x, "i", tiled=True, to="invarying" if check_vma else "varying") * w,
            jax.P(),
        ),
        "megatron mlp": (
            (jax.P(), jax.P(None, "i"), jax.P("i", None)),
            lambda x, w1, w2: lax.psum(jax.nn.relu(x @ w1) @ w2, "i"),
            jax.P(),
        ),
    }
    ins, f, outs = table[name]
    sm = jax.shard_map(f, mesh=jax_mesh((4,), ("i",)), in_specs=ins, out_specs=outs, check_vma=check_vma)
    args = _backward_inputs(name, np)
    grad = jax.grad(lambda *a: jnp.sin(sm(*a)).sum(), argnums=tuple(range(len(args))))

    def count(fn):
        text = jax.jit(fn).lower(*args).compile().as_text()
        ops = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
        return sum(len(re.findall(rf"\b{op}(-start)?\(", text)) for op in ops)

    return count(grad) - count(sm)


def _backward_inputs(name, lib):
    rng = np.random.RandomState(3)
    if name == "megatron mlp":
        shapes = [(3, 4), (4, 8), (8, 4)]
    else:
        shapes = [(2,), (8, 2)]
    return tuple(rng.randint(-2, 3, size=s).astype(np.float32) for s in shapes)


def cm_backward(name, check_vma):
    """This rank's backward collectives and bytes, and how many of them gather the split inputs' gradients (the
    boundary: one Join per mesh axis at most), with the gradients."""
    ins, f, outs = BACKWARD[name]
    args = [torch.from_numpy(a).requires_grad_() for a in _backward_inputs(name, np)]
    y = shard_map(f, mesh=cm_mesh((4,), ("i",)), in_specs=ins, out_specs=outs, check_vma=check_vma)(*args)
    with wire_tap.counting() as log:
        torch.sin(y).sum().backward()
    return log.count, log.sent, [a.grad.tolist() for a in args]


def test_backward_communicates_what_jax_does(worlds):
    """With types, backward makes inside f the collectives jax's typed gradient makes (plus the one gather of the
    split inputs' gradients at the boundary). Gradients agree with and without types."""
    got = {}
    for name in BACKWARD:
        typed, untyped = worlds(4).run(cm_backward, name, True), worlds(4).run(cm_backward, name, False)
        assert all(r == typed[0] for r in typed) and all(r == untyped[0] for r in untyped), name
        np.testing.assert_allclose(
            np.concatenate([np.ravel(g) for g in typed[0][2]]),
            np.concatenate([np.ravel(g) for g in untyped[0][2]]),
            rtol=1e-6,
            atol=1e-6,
            err_msg=name,
        )
        got[name] = (typed[0][:2], untyped[0][:2])
        assert typed[0][0] - 1 == jax_backward(name, True), (name, got[name])
    print("backward (collectives, bytes) per rank, typed and untyped:", got)


# ------------------------------------------------------------------------------------- cmap's named axes
def cm_in_cmap():
    """In cmap's named axes the new names have jax's untyped meanings; their gradients are vmap's."""
    x = torch.arange(12.0).reshape(6, 2).requires_grad_()

    def f(v):
        same = cm.pcast(v, "b", to="varying") + cm.pvary(v, "b")
        gathered = cm.all_gather_invariant(v, "b")
        return same * 2 + cm.pbroadcast(v, "b", 4) + gathered.sum(0)

    y = cm.cmap(f, axis_name="b")(x)
    want = x * 4 + x[4] + x.sum(0)
    (g,) = torch.autograd.grad((y * y).sum(), x)
    (e,) = torch.autograd.grad((want * want).sum(), x)
    return torch.equal(y, want) and torch.allclose(g, e)


def test_new_names_in_cmap_axes(worlds):
    assert worlds(4).run(cm_in_cmap) == [True] * 4


# ------------------------------------------------------------------------ random programs, typed and untyped
def _program(ops, b, w):
    """``ops`` applied to the block ``b`` (each a (name, axes) pair), with a replicated ``w`` mixed in."""
    cast = set()  # the axes w was cast to varying over: a pcast casts only the others, as jax 0.10 requires
    for op, ax in ops:
        if op == "psum":
            b = cm.psum(b, ax)
        elif op == "mul w":
            b = b * w
        elif op == "pcast w":
            fresh = tuple(a for a in (ax if isinstance(ax, tuple) else (ax,)) if a not in cast)
            w = cm.pcast(w, fresh, to="varying") if fresh else w
            cast.update(fresh)
        elif op == "all_gather_invariant":
            b = cm.all_gather_invariant(b, ax, tiled=True).narrow(0, 0, b.shape[0])
        elif op == "all_gather":
            b = cm.all_gather(b, ax, tiled=True).narrow(0, 0, b.shape[0])
        elif op == "ppermute":
            n = cm.axis_size(ax)
            b = cm.ppermute(b, ax, [(i, (i + 1) % n) for i in range(n)])
        elif op == "axis_index":
            b = b * (cm.axis_index(ax) + 1)
        elif op == "sin":
            b = torch.sin(b) + w
    return b


def run_program(ops, final_psum):
    """The program with check_vma on and off: values, gradients, and whether the typed run refused out_specs P()."""
    m = cm_mesh((2, 2), ("x", "y"))
    x = sc.randn(4, 3, seed=len(ops))
    w = sc.randn(3, seed=len(ops) + 1)
    v = sc.randn(3, seed=len(ops) + 2).requires_grad_()  # a closure, as a module's parameter
    results = {}
    for check in (True, False):

        def f(b, w):
            out = _program(ops, b, w) * v
            return cm.psum(out, ("x", "y")) if final_psum else out.sum(0)

        xs = [x.clone().requires_grad_(), w.clone().requires_grad_(), v]
        try:
            y = shard_map(f, m, (P(("x", "y")), P()), P(), check_vma=check)(*xs[:2])
            grads = torch.autograd.grad((torch.sin(y) * (1 + torch.arange(y.numel()))).sum(), xs, allow_unused=True)
            results[check] = (y.detach(), [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, xs)])
        except cm.CmapError as exc:
            assert check and isinstance(exc, ValueError) and "possibly varying" in str(exc), str(exc)
            results[check] = "refused"
    if results[True] == "refused":
        return "refused"
    sc.compare("typed against untyped", results[True], results[False])
    return "same"


OPS = ["psum", "mul w", "pcast w", "all_gather_invariant", "all_gather", "ppermute", "axis_index", "sin"]
AXES = ["x", "y", ("x", "y")]


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(OPS), st.sampled_from(AXES)), max_size=5), st.booleans())
def test_random_programs_typed_as_untyped(worlds, ops, final_psum):
    """With check_vma=True a program's values and gradients are those with check_vma=False; a program whose output
    varies and is declared P() is refused, by the types, and one whose final psum makes it invariant never is."""
    got = worlds(4).run(run_program, ops, final_psum)
    assert len(set(got)) == 1, got
    if final_psum:
        assert got[0] == "same", (ops, got)


# --------------------------------------------------------------------------------------- partial manual axes
def jax_partial_manual(x, w):
    mesh = jax_mesh((2, 2), ("x", "y"))
    f = jax.shard_map(
        lambda b, w: lax.psum(jnp.sin(b) * w, "x"),
        mesh=mesh,
        in_specs=(jax.P("x"), jax.P()),
        out_specs=jax.P(),
        axis_names={"x"},
    )
    return f(x, w)


def cm_partial_manual(x, w):
    mesh = cm_mesh((2, 2), ("x", "y"))
    f = shard_map(
        lambda b, w: cm.psum(torch.sin(b) * w, "x"), mesh=mesh, in_specs=(P("x"), P()), out_specs=P(), axis_names={"x"}
    )
    return f(x, w)


def cm_partial_manual_errors():
    mesh = cm_mesh((2, 2), ("x", "y"))
    out = {}
    for label, f, ins in (
        ("collective over y", lambda b: cm.psum(b, "y"), P("x")),
        ("in_specs names y", lambda b: b, P("y")),
    ):
        try:
            shard_map(f, mesh=mesh, in_specs=ins, out_specs=P("x"), axis_names={"x"})(torch.ones(4))
            out[label] = "no error"
        except cm.CmapError as exc:
            out[label] = (
                type(exc).__mro__[1].__name__,
                isinstance(exc, NameError),
                isinstance(exc, ValueError),
                str(exc),
            )
    return out


def test_partial_manual_axes(worlds):
    """axis_names={"x"} on a 2x2 mesh: f sees whole values along "y"; values and gradients are jax's; a collective
    over "y" is a NameError and a spec naming "y" a ValueError, as in jax."""
    args = (np.arange(8.0, dtype=np.float32).reshape(4, 2), np.array([1.0, -2.0], np.float32))
    want = sc.run_jax(EXAMPLES, "partial_manual", args, [np.ones((2, 2), np.float32)])
    got = worlds(4).run(sc.run_cm, __name__, "partial_manual", args, [np.ones((2, 2), np.float32)])
    sc.compare_with_jax(got, want, lambda kind, k: (1e-6, 1e-6), "partial manual")
    for errors in worlds(4).run(cm_partial_manual_errors):
        assert errors["collective over y"][1] and "Found an unbound axis name: y" in errors["collective over y"][3]
        assert errors["in_specs names y"][2] and "not one of the manual axes" in errors["in_specs names y"][3]


# ------------------------------------------------------------------------------------------------ typeof
def typeof_seen(m, typeof, mesh, spec_of, x, w):
    """What ``typeof`` prints for values inside a shard_map over (x, y) (jax: ``str(jax.typeof(v))``, as
    ``float32[2,2]{V:(x,y)}``), and ``typeof(v).vma`` (jax 0.10: ``.manual_axis_type.varying``) of an axis_index."""
    seen = []

    def f(b, w):
        y = m.psum(b, "x")
        for v in (b, w, y, b * w[0], m.all_gather(y, "y"), m.pmax(b, ("x", "y")), m.ppermute(w, "y", [(0, 1), (1, 0)])):
            seen.append(str(typeof(v)))
        t = typeof(m.axis_index("y"))
        seen.append(sorted(getattr(t, "vma", None) or t.manual_axis_type.varying))
        return b

    shard_map_ = jax.shard_map if m is lax else shard_map
    shard_map_(f, mesh=mesh, in_specs=(spec_of("x", "y"), spec_of()), out_specs=spec_of("x", "y"))(x, w)
    return seen


def cm_typeof():
    x, w = torch.ones(4, 4), torch.ones(3)
    seen = typeof_seen(cm, cm.typeof, cm_mesh((2, 2), ("x", "y")), P, x, w)
    outside = cm.typeof(x)
    return seen, (str(outside), outside.vma, outside.manual_axis_type.varying)


def test_typeof_as_jax(worlds):
    """``cm.typeof(v)`` prints as ``jax.typeof(v)`` does inside a shard_map (dtype, shape, varying axes), on every
    rank; outside any map nothing varies."""
    x, w = np.ones((4, 4), np.float32), np.ones(3, np.float32)
    want = typeof_seen(lax, jax.typeof, jax_mesh((2, 2), ("x", "y")), jax.P, x, w)
    assert want[:3] == ["float32[2,2]{V:(x,y)}", "float32[3]", "float32[2,2]{V:y}"], want
    for seen, outside in worlds(4).run(cm_typeof):
        assert seen == want
        assert outside == ("float32[4,4]", frozenset(), frozenset())


# ------------------------------------------------------------------ second derivatives through a P() output
def double_backward_cases(psum, sin):
    """name: f of a block of x (8,) on a 4-mesh ("i"), out_specs P(), check_vma=False: outputs that are replicated."""
    return {
        "psum(b * b)": lambda b: psum(b * b, "i"),
        "sin(psum(b)) * psum(b * b)": lambda b: sin(psum(b, "i")) * psum(b * b, "i"),
    }


def jax_double_backward(name):
    f = double_backward_cases(lax.psum, jnp.sin)[name]
    sm = jax.shard_map(f, mesh=jax_mesh((4,), ("i",)), in_specs=jax.P("i"), out_specs=jax.P(), check_vma=False)
    loss = lambda v: (sm(v) ** 2).sum()  # noqa: E731
    x = np.arange(8.0, dtype=np.float32) / 4
    return np.asarray(jax.grad(loss)(x)), np.asarray(jax.grad(lambda v: jax.grad(loss)(v).sum())(x))


def cm_double_backward(names):
    out = {}
    for name in names:
        f = double_backward_cases(cm.psum, torch.sin)[name]
        sm = shard_map(f, mesh=cm_mesh((4,), ("i",)), in_specs=P("i"), out_specs=P(), check_vma=False)
        x = (torch.arange(8.0) / 4).requires_grad_()
        (g1,) = torch.autograd.grad(sm(x).square().sum(), x, create_graph=True)
        (g2,) = torch.autograd.grad(g1.sum(), x)
        func = torch.func.grad(lambda v: sm(v).square().sum())(x.detach())
        out[name] = (g1.detach().numpy(), g2.numpy(), func.numpy())
    return out


def test_untyped_replicated_output_second_derivatives(worlds):
    """check_vma=False splits a P() output's cotangent evenly over its copies; the split's own transpose (met in
    double backward) is the mean of the copies' cotangents, so second derivatives are jax's, as first ones are
    (torch.func.grad too)."""
    names = list(double_backward_cases(lax.psum, jnp.sin))
    want = {n: jax_double_backward(n) for n in names}
    for got in worlds(4).run(cm_double_backward, names):
        for n in names:
            np.testing.assert_allclose(got[n][0], want[n][0], rtol=1e-5, atol=1e-5, err_msg=f"{n}: first")
            np.testing.assert_allclose(got[n][1], want[n][1], rtol=1e-5, atol=1e-5, err_msg=f"{n}: second")
            np.testing.assert_allclose(got[n][2], want[n][0], rtol=1e-5, atol=1e-5, err_msg=f"{n}: torch.func")
