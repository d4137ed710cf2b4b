"""Every collective in every place a user can call it, against torch's own computation on the whole batch.

Places: func in modes vmap, batched and loop; cmap under an outer ``torch.vmap``; ``torch.func.grad``, ``jvp`` and
``jacrev`` inside func; backward and double backward through the cmap; a compiled func. Shares are uneven and
some ranks hold none (B < P). The oracle (``axis_cases``) is written with plain torch ops, so its gradients are
torch's: they check cmap's transpose rules rather than restate them.

The matrix runs in float64: a collective's sum over the axis adds the examples in another order than the oracle's
``X.sum(0)``, and gradients of gradients chain such sums. Every value here is a sum of at most 25 terms (B0 * B1 <= 15
examples, or B^2 for a double backward with B <= 5) of products of at most three inputs drawn from a normal
distribution (|x| < 6), so sum_tolerance bounds the difference by 2 * gamma_25(float64) * 25 * 6^3 < 3e-11: far
under the float64 tolerance (cases.F64). In float32 the same bound is 0.02.
"""

import pytest
import torch
import torch.distributed as dist
from axis_cases import BY_NAME, CASES, NESTED, Case, axis_size_of, nested_cmap
from cases import F64, batch_sum_tolerance, randn

import colossalai_cmap as cm

DOUBLE = torch.float64


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, **F64, msg=lambda m: f"{what}: {m}")


def _values(case: Case, B: int, X: torch.Tensor) -> int:
    f, want = case.f(B), case.ref(X)
    for mode in ("vmap", "batched", "loop"):
        _close(cm.cmap(f, axis_name="i", mode=mode)(X), want, f"{case.name} B={B} {mode}")
    # an outer torch.vmap: the collective runs over the cmap's axis, separately for each outer example
    stacked = torch.stack([X, 2 * X + 1])
    got = torch.vmap(cm.cmap(f, axis_name="i"))(stacked)
    _close(got, torch.stack([case.ref(s) for s in stacked]), f"{case.name} B={B} under torch.vmap")
    return 4


def _outer_grads(case: Case, B: int, X: torch.Tensor, W: torch.Tensor) -> int:
    """Backward and double backward through the cmap (the gradient of a gradient, contracted with V)."""
    V = randn(*X.shape, seed=B + 7, dtype=DOUBLE)

    def total(fn, x):
        g = torch.autograd.grad((fn(x).sin() * W).sum(), x, create_graph=True)[0]
        return g, torch.autograd.grad((g * V).sum(), x)[0]

    x_ref = X.clone().requires_grad_()
    want = total(case.ref, x_ref)
    for mode in ("vmap", "batched"):
        x = X.clone().requires_grad_()
        got = total(cm.cmap(case.f(B), axis_name="i", mode=mode), x)
        _close(got[0], want[0], f"{case.name} B={B} {mode} grad")
        _close(got[1], want[1], f"{case.name} B={B} {mode} double backward")
    return 4


def _inner_transforms(case: Case, B: int, X: torch.Tensor, W: torch.Tensor) -> int:
    """torch.func.grad, jvp and jacrev inside func: jax's meaning, the derivative of the sum over examples."""
    f = case.f(B)
    got = cm.cmap(lambda v, w: torch.func.grad(lambda u: (f(u).sin() * w).sum())(v), axis_name="i")(X, W)
    _close(got, torch.func.grad(lambda x: (case.ref(x).sin() * W).sum())(X), f"{case.name} B={B} grad in f")
    T = randn(*X.shape, seed=B + 11, dtype=DOUBLE)
    got = cm.cmap(lambda v, t: torch.func.jvp(f, (v,), (t,))[1], axis_name="i")(X, T)
    _close(got, torch.func.jvp(case.ref, (X,), (T,))[1], f"{case.name} B={B} jvp in f")
    got = cm.cmap(torch.func.jacrev(f), axis_name="i")(X)
    full = torch.func.jacrev(lambda x: case.ref(x).sum(0))(X)  # (*out, B, *in)
    out_dims = full.dim() - X.dim()
    _close(got, full.movedim(out_dims, 0), f"{case.name} B={B} jacrev in f")
    return 3


def check_matrix(sizes):
    done = 0
    for B in sizes:
        for k, case in enumerate(CASES):
            X = randn(B, *case.shape(B), seed=31 * B + k, dtype=DOUBLE)
            done += _values(case, B, X)
            if not case.differentiable:
                continue
            W = randn(*case.ref(X).shape, seed=B + k, dtype=DOUBLE)
            done += _outer_grads(case, B, X, W) + _inner_transforms(case, B, X, W)
    return done


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_collective_matrix(worlds, P):
    sizes = [1, 4] if P == 1 else [P - 1, P + 1]
    counts = worlds(P).run(check_matrix, sizes, deadline=240)
    assert counts[0] > 0 and len(set(counts)) == 1


def test_collective_matrix_without_distributed():
    """No process group: the same ops over the local batch."""
    assert check_matrix([3]) > 0


def check_refusals():
    """What jax leaves undefined fails on every rank with the reason; what is not differentiable says so."""
    x = randn(5, 7, 3, seed=1)
    expected = [
        (lambda v: cm.all_to_all(v, "i", 0, 1, tiled=True), "do not divide"),
        (lambda v: cm.all_to_all(v, "i", 0, 1), "must equal the axis size"),
        (lambda v: cm.psum_scatter(v, "i", scatter_dimension=1), "must equal the axis size"),
        (lambda v: cm.ppermute(v, "i", [(0, 1), (2, 1)]), "names a source or a destination twice"),
        (lambda v: cm.ppermute(v, "i", [(0, 5)]), "out of range"),
        (lambda v: cm.all_to_all(v, "i", 0, 3), "out of range"),
    ]
    for f, message in expected:
        for mode in ("vmap", "batched"):
            with pytest.raises((cm.CmapError, ValueError), match=message):
                cm.cmap(f, axis_name="i", mode=mode)(x)
    xg = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="not differentiable"):
        cm.cmap(lambda v: cm.pmax(v, "i"), axis_name="i")(xg).sum().backward()
    with pytest.raises((cm.CmapError, RuntimeError), match="not differentiable"):
        cm.cmap(lambda v: v * cm.psum(v, "i"), axis_name="i", mode="loop")(xg)
    # the group still works: psum adds the 5 examples in another order than x.sum(0)
    got = cm.cmap(lambda v: cm.psum(v, "i"), axis_name="i")(x)
    torch.testing.assert_close(got, x.sum(0).expand_as(x), **batch_sum_tolerance(x))
    return True


@pytest.mark.parametrize("P", [2, 3])
def test_refusals_on_every_rank(worlds, P):
    assert worlds(P).run(check_refusals) == [True] * P


# ----------------------------------------------------------------------------------------- nested and tuple axes
def nested_ref(case: Case, axis, X: torch.Tensor) -> torch.Tensor:
    """The oracle on the mesh of examples X (B0, B1, ...): over dim 1 ("j"), dim 0 ("i"), or both, "i" major."""
    if axis == "j":
        return torch.stack([case.ref(row) for row in X])
    if axis == "i":
        return torch.stack([case.ref(col) for col in X.movedim(1, 0)], 1)
    return case.ref(X.flatten(0, 1)).unflatten(0, X.shape[:2])


def check_nested(B0, B1):
    """jax's ``pmap(pmap(f, 'j'), 'i')`` on a 2x2 mesh, in the default mode, with values and gradients."""
    done = 0
    for k, (axis, name) in enumerate(NESTED):
        case = BY_NAME[name]
        X = randn(B0, B1, *case.shape(axis_size_of(axis, B0, B1)), seed=k, dtype=DOUBLE)
        nested = nested_cmap(case, axis, B0, B1)
        want = nested_ref(case, axis, X)
        _close(nested(X), want, f"nested {axis} {name}")
        if case.differentiable:
            W = randn(*want.shape, seed=50 + k, dtype=DOUBLE)
            x, x_ref = X.clone().requires_grad_(), X.clone().requires_grad_()
            (nested(x).sin() * W).sum().backward()
            (nested_ref(case, axis, x_ref).sin() * W).sum().backward()
            _close(x.grad, x_ref.grad, f"nested {axis} {name} grad")
        done += 1
    return done


@pytest.mark.parametrize("B0,B1", [(2, 2), (3, 5)])
def test_nested_mesh_axes(worlds, B0, B1):
    assert worlds(4).run(check_nested, B0, B1, deadline=180) == [len(NESTED)] * 4


# ---------------------------------------------------------------------------------------------------- compiled
COMPILED = ["psum", "all_gather tiled", "psum_scatter", "all_to_all 0,1", "ppermute ring", "axis_index"]


def check_compiled(B):
    """``cmap(torch.compile(f, fullgraph=True), mode="batched")``: one graph, no break, values and gradients."""
    for k, name in enumerate(COMPILED):
        case = BY_NAME[name]
        torch._dynamo.reset()
        f = case.f(B)
        explained = {}

        def explain(v, f=f):
            explained["out"] = torch._dynamo.explain(f)(v)
            return f(v)

        X = randn(B, *case.shape(B), seed=k, dtype=DOUBLE)
        x, x_ref = X.clone().requires_grad_(), X.clone().requires_grad_()
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        got = cm.cmap(compiled, axis_name="i", mode="batched")(x)
        want = case.ref(x_ref)
        _close(got, want, f"compiled {name}")
        W = randn(*want.shape, seed=k, dtype=DOUBLE)
        (got.sin() * W).sum().backward()
        (want.sin() * W).sum().backward()
        _close(x.grad, x_ref.grad, f"compiled {name} grad")
        cm.cmap(explain, axis_name="i", mode="batched")(X)
        assert (explained["out"].graph_count, explained["out"].graph_break_count) == (1, 0), explained["out"]
        # vmap mode maps the original function: torch.vmap cannot run a compiled one
        _close(cm.cmap(compiled, axis_name="i")(X), want, f"compiled {name} in vmap mode")
        # torch.compile around the cmap: its orchestration runs eagerly, func's ops the same
        _close(torch.compile(cm.cmap(f, axis_name="i"), backend="aot_eager")(X), want, f"compile(cmap) {name}")
    return len(COMPILED)


@pytest.mark.parametrize("B", [5, 2])
def test_compiled_func(worlds, B):
    assert worlds(3).run(check_compiled, B, deadline=300) == [len(COMPILED)] * 3


# aot_autograd refuses double backward ("does not currently support double backward"); when func's input is a view
# (a shard is one), its first backward even comes back without a graph, so the second one has nothing to follow.
NO_DOUBLE_BACKWARD = "double backward|does not require grad"


def check_compiled_double_backward():
    """A compiled func is differentiable once, a limit of torch.compile itself (pinned here)."""
    x = randn(4, 3, seed=2).requires_grad_()
    compiled = torch.compile(lambda v: cm.psum(v, "i").sin(), fullgraph=True, backend="aot_eager")
    y = cm.cmap(compiled, axis_name="i", mode="batched")(x)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=NO_DOUBLE_BACKWARD):
        g.sum().backward()
    return True


def test_compiled_double_backward_is_torchs_limit(worlds):
    assert worlds(2).run(check_compiled_double_backward, deadline=120) == [True] * 2


@pytest.mark.parametrize("view", [False, True])
def test_torch_itself_refuses_double_backward_through_compile(view):
    """The minimal reproduction, with no cmap."""
    x = torch.randn(4, 3, requires_grad=True)
    compiled = torch.compile(torch.sin, backend="aot_eager")
    (g,) = torch.autograd.grad(compiled(x[:2] if view else x * 1).sum(), x, create_graph=True)
    assert g.requires_grad is not view
    with pytest.raises(RuntimeError, match="does not require grad" if view else "double backward"):
        g.sum().backward()


def test_rank_count_is_not_the_axis_size(worlds):
    assert worlds(2).run(_axis_size_check) == [True, True]


def _axis_size_check():
    got = cm.cmap(lambda v: v * 0 + cm.axis_size("i"), axis_name="i")(torch.zeros(5))
    return bool(torch.equal(got, torch.full((5,), 5.0))) and dist.get_world_size() == 2
