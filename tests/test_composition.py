"""cmap is torch.vmap in every composition where vmap works: closures, torch.func transforms, double backward,
nesting, no_grad and inference_mode, in-place updates, and every kind of output.

Each check computes the same thing twice on every rank, once with ``cmap`` and once with ``torch.vmap`` in this one
process, and compares values and gradients (exact where the math is exact). The matrix runs at P = 1 to 4, with an
uneven batch and with a batch smaller than P (empty shards run a stand-in example).
"""

import pytest
import torch
import torch.distributed as dist
from cases import batch_sum_tolerance, randn
from torch.func import functional_call, grad, grad_and_value, hessian, jacfwd, jacrev, jvp, vjp, vmap

import colossalai_cmap as cm

F64 = torch.float64


def _close(a, b, what):
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}")


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()


def _grads(module):
    return [p.grad.clone() for p in module.parameters()]


# -------------------------------------------------------------------------------------------- the checks
def closure_tensor(B):
    """A tensor read from a closure gets vmap's gradient (the sum over every rank's rows)."""
    x, w0 = randn(B, 3, seed=1, dtype=F64), randn(3, seed=2, dtype=F64)
    got, ref = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    cm.cmap(lambda v: (v @ got).sin())(x).pow(2).sum().backward()
    vmap(lambda v: (v @ ref).sin())(x).pow(2).sum().backward()
    _close(got.grad, ref.grad, "closure")


def closure_module(B):
    """``cmap(lambda x: model(x))``: the module's parameters are closures; a global module and a bound method too."""
    x = randn(B, 3, seed=3, dtype=F64)
    model, ref = _mlp(), _mlp()
    cm.cmap(lambda v: model(v))(x).square().sum().backward()
    vmap(lambda v: ref(v))(x).square().sum().backward()
    for g, r in zip(_grads(model), _grads(ref)):
        _close(g, r, "module in a lambda")
    model.zero_grad(), ref.zero_grad()
    cm.cmap(model.forward)(x).sum().backward()
    vmap(ref.forward)(x).sum().backward()
    for g, r in zip(_grads(model), _grads(ref)):
        _close(g, r, "bound forward")


def module_func(B):
    """An ``nn.Module`` as func, and a closure tensor next to an argument that requires grad."""
    x = randn(B, 3, seed=4, dtype=F64)
    model, ref = _mlp(), _mlp()
    cm.cmap(model)(x).sum().backward()
    vmap(ref)(x).sum().backward()
    for g, r in zip(_grads(model), _grads(ref)):
        _close(g, r, "module")
    c, cr = randn(2, seed=5, dtype=F64).requires_grad_(), randn(2, seed=5, dtype=F64).requires_grad_()
    xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    cm.cmap(lambda v: ref(v) * c)(xa).sum().backward()
    vmap(lambda v: ref(v) * cr)(xr).sum().backward()
    _close(c.grad, cr.grad, "closure next to an argument")
    _close(xa.grad, xr.grad, "mapped argument")  # not bitwise: a matmul over fewer rows may round differently


def func_transforms(B):
    """grad, grad_and_value, vjp, jvp, jacrev, jacfwd and hessian over cmap, and jacrev of jacrev."""
    x, w0, t = randn(B, 3, seed=6, dtype=F64), randn(3, seed=7, dtype=F64), randn(3, seed=8, dtype=F64)

    def loss(mapper):
        return lambda w: mapper(lambda v: (v @ w).sin() * v.sum())(x).sum()

    def vec(mapper):
        return lambda w: mapper(torch.dot, in_dims=(0, None))(x, w).cos()

    for name, transform in [("grad", grad), ("jacrev", jacrev), ("jacfwd", jacfwd), ("hessian", hessian)]:
        _close(transform(loss(cm.cmap))(w0), transform(loss(vmap))(w0), name)
    _close(grad_and_value(loss(cm.cmap))(w0), grad_and_value(loss(vmap))(w0), "grad_and_value")
    _close(jacrev(jacrev(vec(cm.cmap)))(w0), jacrev(jacrev(vec(vmap)))(w0), "jacrev(jacrev)")
    _close(jvp(vec(cm.cmap), (w0,), (t,)), jvp(vec(vmap), (w0,), (t,)), "jvp")
    out, pull = vjp(vec(cm.cmap), w0)
    ref_out, ref_pull = vjp(vec(vmap), w0)
    cot = randn(B, seed=9, dtype=F64)
    _close((out, pull(cot)), (ref_out, ref_pull(cot)), "vjp")
    mapped = lambda xx: cm.cmap(lambda v: v.sin() * v)(xx).sum()  # noqa: E731
    _close(grad(mapped)(x), grad(lambda xx: vmap(lambda v: v.sin() * v)(xx).sum())(x), "grad of a mapped input")


def functional_call_params(B):
    """``torch.func.grad`` over ``functional_call`` of a module inside cmap: the parameters come in as a dict."""
    x, model = randn(B, 3, seed=10, dtype=F64), _mlp()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(mapper):
        return lambda p: mapper(lambda v: functional_call(model, p, (v,)))(x).square().sum()

    _close(grad(loss(cm.cmap))(params), grad(loss(vmap))(params), "functional_call")


def double_backward(B):
    """create_graph=True and a gradient penalty: the second-order term is there, as with vmap."""
    x, w0 = randn(B, 3, seed=11, dtype=F64), randn(3, seed=12, dtype=F64)
    results = []
    for mapper in (cm.cmap, vmap):
        xx, w = x.clone().requires_grad_(), w0.clone().requires_grad_()
        out = mapper(lambda v: (v * w).sin().sum())(xx)
        (g,) = torch.autograd.grad(out.sum(), xx, create_graph=True)
        assert g.requires_grad
        ((g**2).sum() + xx.sum()).backward()
        results.append((xx.grad, w.grad))
    _close(results[0], results[1], "double backward")


def retain_graph_twice(B):
    x, w0 = randn(B, 3, seed=13, dtype=F64), randn(3, seed=14, dtype=F64)
    results = []
    for mapper in (cm.cmap, vmap):
        w = w0.clone().requires_grad_()
        loss = mapper(torch.dot, in_dims=(0, None))(x, w).exp().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        results.append(w.grad)
    _close(results[0], results[1], "backward twice")


def outer_vmap(B):
    """torch.vmap(cmap(f)), with and without gradients, and per-sample gradients of a cmap."""
    x, W = randn(B, 3, seed=15, dtype=F64), randn(4, 3, seed=16, dtype=F64)

    def inner(mapper):
        return lambda w: mapper(torch.dot, in_dims=(0, None))(x, w).sin()

    _close(vmap(inner(cm.cmap))(W), vmap(inner(vmap))(W), "vmap(cmap)")
    per_sample = lambda mapper: vmap(grad(lambda w: inner(mapper)(w).sum()))(W)  # noqa: E731
    _close(per_sample(cm.cmap), per_sample(vmap), "vmap(grad(cmap))")
    total = lambda mapper: grad(lambda ws: vmap(inner(mapper))(ws).sum())(W)  # noqa: E731
    _close(total(cm.cmap), total(vmap), "grad(vmap(cmap))")


def nested_same_group(B):
    """cmap(cmap(f)) on one group: the inner map runs locally as vmap; values and gradients exact."""
    a = torch.arange(B * 8, dtype=F64).reshape(B, 4, 2)
    b = torch.ones(B, 4, 2, dtype=F64)
    assert torch.equal(cm.cmap(cm.cmap(torch.dot))(a, b), vmap(vmap(torch.dot))(a, b))
    w, wr = torch.ones(2, dtype=F64, requires_grad=True), torch.ones(2, dtype=F64, requires_grad=True)
    cm.cmap(cm.cmap(lambda v: (v * w).sum()))(a).sum().backward()
    vmap(vmap(lambda v: (v * wr).sum()))(a).sum().backward()
    _close(w.grad, wr.grad, "nested closure")


def modes_of_grad(B):
    """no_grad and inference_mode give vmap's values and leave later calls working."""
    x = randn(B, 3, seed=17, dtype=F64).requires_grad_()
    with torch.no_grad():
        out = cm.cmap(torch.sin)(x)
        assert not out.requires_grad
    with torch.inference_mode():
        out = cm.cmap(lambda v: v.exp() * 2)(x)
        assert out.is_inference() and torch.equal(out, vmap(lambda v: v.exp() * 2)(x))
        assert torch.equal(cm.cmap(torch.sin)(x), torch.sin(x))
    assert torch.equal(cm.cmap(torch.sin)(x.detach()), torch.sin(x.detach()))
    # Shapes first seen under inference_mode, then called again outside it, with and without grad.
    y = randn(B, 7, 5, seed=22, dtype=F64)
    f = cm.cmap(lambda v: v * cm.psum(v.sum(), "i"), axis_name="i")
    big = randn(B, 200, 700, seed=23, dtype=F64)  # over a round's payload: the data travels in its own collective
    with torch.inference_mode():
        _close(f(y), y * y.sum(), "psum under inference_mode")
        assert torch.equal(cm.cmap(torch.cos)(y), y.cos())
        assert torch.equal(cm.cmap(torch.neg)(big), -big)
        got = cm.cmap(torch.neg, dst=0)(big)
        assert torch.equal(got, -big) if dist.get_rank() == 0 else got is None
    assert torch.equal(cm.cmap(torch.cos)(y), y.cos()) and not f(y).is_inference()
    yg, yr = y.clone().requires_grad_(), y.clone().requires_grad_()
    f(yg).pow(2).sum().backward()
    (yr * yr.sum()).pow(2).sum().backward()
    _close(yg.grad, yr.grad, "after inference_mode")


def in_place(B):
    """func changes a mapped input in place: every rank's tensor gets every row's change, as vmap's would."""
    x = randn(B, 3, seed=18, dtype=F64)
    got, ref = x.clone(), x.clone()
    out = cm.cmap(lambda v: v.mul_(2).add_(1).sum())(got)
    ref_out = vmap(lambda v: v.mul_(2).add_(1).sum())(ref)
    assert torch.equal(got, ref) and torch.equal(out, ref_out)


def outputs_of_every_kind(B):
    """Conjugate and negative bits, non-contiguous and expanded outputs, complex, bool and bfloat16."""
    z = torch.complex(randn(B, 4, seed=19), randn(B, 4, seed=20))
    x = randn(B, 4, seed=21)
    cases = [
        ("fft.ifft", torch.fft.ifft, (z,), {}),
        ("fft.ihfft", torch.fft.ihfft, (x,), {}),
        ("conj", torch.conj, (z,), {}),
        ("negative bit", lambda v: torch.conj(v).imag, (z,), {"mode": "batched"}),  # vmap has no rule for it
        ("non-contiguous", lambda v: v.outer(v).t(), (x,), {}),
        ("expanded", lambda v: v[:1].expand(3, 1), (x,), {}),
        ("bool", lambda v: v > 0, (x,), {}),
        ("bfloat16", lambda v: (v * 3).bfloat16(), (x,), {}),
        ("mixed", lambda v: (v.sum(), v.to(torch.complex128), v.long()), (x,), {}),
    ]
    for name, f, args, opts in cases:
        got = cm.cmap(f, **opts)(*args)
        ref = f(*args) if opts else vmap(f)(*args)
        for g, r in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(ref)):
            assert g.dtype == r.dtype and g.shape == r.shape, name
            assert torch.equal(g.resolve_conj().resolve_neg(), r.resolve_conj().resolve_neg()), name


def forward_mode_ad(B):
    """Under ``torch.autograd.forward_ad`` (dual tensors, no torch.func transform): vmap's tangents, from the mapped
    input's and a closure's."""
    import torch.autograd.forward_ad as fwAD

    x, t = randn(B, 3, seed=40, dtype=F64), randn(B, 3, seed=41, dtype=F64)
    w, tw = randn(3, seed=42, dtype=F64), randn(3, seed=43, dtype=F64)
    with fwAD.dual_level():
        dual_w = fwAD.make_dual(w, tw)
        got = fwAD.unpack_dual(cm.cmap(lambda v: (v * dual_w).sin().sum())(fwAD.make_dual(x, t))).tangent
        want = fwAD.unpack_dual(vmap(lambda v: (v * dual_w).sin().sum())(fwAD.make_dual(x, t))).tangent
    assert got is not None, "no tangent came out"
    _close(got, want, "forward-mode AD")


CHECKS = [
    closure_tensor,
    closure_module,
    module_func,
    func_transforms,
    functional_call_params,
    double_backward,
    retain_graph_twice,
    outer_vmap,
    nested_same_group,
    modes_of_grad,
    in_place,
    outputs_of_every_kind,
    forward_mode_ad,
]


def run_checks(batch_sizes):
    """Every check at every batch size; returns {check: "pass" or the error} (the matrix the closing note gives)."""
    found = {}
    for check in CHECKS:
        for B in batch_sizes:
            try:
                check(B)
            except Exception as exc:
                found[f"{check.__name__} B={B}"] = f"{type(exc).__name__}: {exc}"
                raise
        found[check.__name__] = "pass"
    # every rank must still be in step: one more call on the world
    assert torch.equal(cm.cmap(torch.sin)(torch.ones(5, 2)), torch.ones(5, 2).sin())
    return found


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_composition_matrix(worlds, P):
    sizes = [7] if P == 1 else [7, P - 1]
    results = worlds(P).run(run_checks, sizes, deadline=240)
    assert all(r == {c.__name__: "pass" for c in CHECKS} for r in results), results


def check_issue_examples():
    """The reported failures, each as stated, at the P of the world."""
    size = dist.get_world_size()
    # cmap(cmap(f)) on one group: (2, 4, 2) and (3, 4, 2)
    for shape in [(2, 4, 2), (3, 4, 2)]:
        a, b = torch.arange(float(shape[0] * 8)).reshape(shape), torch.ones(shape)
        assert torch.equal(cm.cmap(cm.cmap(torch.dot))(a, b), vmap(vmap(torch.dot))(a, b)), shape
    # closure-captured tensor, no argument requiring grad (the same inputs on every rank: src=None)
    w, x = randn(3, seed=30).requires_grad_(), randn(4, 3, seed=31)
    cm.cmap(lambda v: v @ w)(x).sum().backward()
    rows = batch_sum_tolerance(x)  # both gradients are the sum of x's rows, added in another order
    torch.testing.assert_close(w.grad, x.sum(0), **rows, msg=lambda m: f"closure: {m}")
    # torch.func.grad over cmap; jvp of cmap(sin)
    w0 = randn(3, seed=32)
    got = grad(lambda w: cm.cmap(torch.dot, in_dims=(None, 0))(w, x).sum())(w0)
    torch.testing.assert_close(got, x.sum(0), **rows, msg=lambda m: f"grad: {m}")
    t = randn(4, 3, seed=33)
    _close(jvp(lambda v: cm.cmap(torch.sin)(v), (x,), (t,))[1], x.cos() * t, "jvp")
    # fft at B=1: conjugate outputs pack on every rank
    z = torch.complex(randn(1, 4, seed=34), randn(1, 4, seed=35))
    assert torch.equal(cm.cmap(torch.fft.ifft)(z), vmap(torch.fft.ifft)(z))
    assert torch.equal(cm.cmap(torch.fft.ihfft)(z.real), vmap(torch.fft.ihfft)(z.real))
    return size


@pytest.mark.parametrize("P", [2, 3])
def test_issue_examples(worlds, P):
    assert worlds(P).run(check_issue_examples) == [P] * P


def check_meta():
    """Meta tensors carry shapes only: cmap gives vmap's shapes with no communication, and so does a Join."""
    from colossalai_cmap.integration.groups import resolve_group
    from colossalai_cmap.wire.exchange import JoinSpec, join_values
    from colossalai_cmap.wire.link import Link
    from colossalai_cmap.wire.roles import COPY, Rows

    x, w = torch.empty(7, 3, device="meta"), torch.empty(3, device="meta")
    with cm.record_collectives() as log:
        out = cm.cmap(lambda v, u: (v * u, v.sum()), in_dims=(0, None))(x, w)
        link = Link(resolve_group("check_meta", None), torch.device("meta"), "check_meta", None)
        rows, total = join_values(JoinSpec(link, (Rows(0, (4, 3)), COPY)), [torch.empty(4, 2, device="meta"), w])
    assert [t.shape for t in out] == [(7, 3), (7,)] and all(t.is_meta for t in out)
    assert rows.shape == (7, 2) and total.shape == (3,) and rows.is_meta
    assert log.count == 0, log.entries
    return True


def test_meta_tensors(worlds):
    assert worlds(2).run(check_meta) == [True, True]
