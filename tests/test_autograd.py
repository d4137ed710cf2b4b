"""Gradients through cmap equal single-process torch.vmap's, never scaled by P, never a deadlock."""

import warnings

import pytest
import torch
import torch.distributed as dist
from cases import F64, Tiny, assert_same, batch_sum_tolerance, linear_scale, randn, sum_tolerance

import colossalai_cmap as cm


def _f(x, w):
    h = (x * w).sin()
    return h.sum(-1), h * 2


def _loss_of_one(x, w):
    """One example's share of the loss ``_grads`` differentiates."""
    a, b = _f(x, w)
    return a.square() + (b * torch.arange(b.shape[-1], dtype=b.dtype)).sum()


def _grads(fn, x, w, **opts):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    a, b = fn(_f, in_dims=(0, None), **opts)(x, w)
    (a.square().sum() + (b * torch.arange(b.shape[-1], dtype=b.dtype)).sum()).backward()
    return x.grad, w.grad


def check_grad_parity(batch_sizes, dtype=torch.float32):
    """x (mapped) and w (in_dims=None) gradients with two outputs, against vmap, for each B."""
    done = 0
    for B in batch_sizes:
        x, w = randn(B, 6, seed=1, dtype=dtype), randn(6, seed=2, dtype=dtype)
        exp = _grads(torch.vmap, x, w)
        got = _grads(cm.cmap, x, w)
        # the mapped input's gradient assembles each row from exactly one rank, computed by the same ops: exact
        assert torch.equal(got[0], exp[0]), f"x.grad B={B}"
        # w (in_dims=None) gets the sum of its per-example gradients: over each rank's rows, then over the ranks
        per_example = torch.vmap(torch.func.grad(_loss_of_one, argnums=1), in_dims=(0, None))(x, w)
        torch.testing.assert_close(
            got[1], exp[1], **batch_sum_tolerance(per_example), msg=lambda m: f"w.grad B={B}: {m}"
        )
        done += 1
    return done


def check_no_factor_of_p(B):
    """A replicated loss: w.grad / expected must be 1, not P (the torch.distributed.nn.all_gather trap)."""
    x, w = randn(B, 5, seed=3).abs() + 0.5, randn(5, seed=4).requires_grad_()  # x > 0: no column sums to about 0
    cm.cmap(torch.dot, in_dims=(0, None))(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0), **batch_sum_tolerance(x))  # the sum of x's rows, in another order
    return (w.grad / x.sum(0)).mean().item()


def check_module_params(B):
    """The parameters of an nn.Module passed as func get vmap's gradients (in float64: each shard's addmm may round
    its rows otherwise, and the parameters' gradients sum them over the ranks; see cases.F64)."""
    ref, mod = Tiny().double(), Tiny().double()
    x = randn(B, 5, seed=5, dtype=torch.float64)
    torch.vmap(ref)(x).pow(2).sum().backward()
    cm.cmap(mod)(x).pow(2).sum().backward()
    for (name, p), q in zip(ref.named_parameters(), mod.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **F64, msg=lambda m: f"{name}: {m}")
    batched = Tiny().double()
    cm.cmap(batched, mode="batched")(x).pow(2).sum().backward()
    for p, q in zip(ref.parameters(), batched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **F64)
    return True


def check_modes_and_chunks(B):
    """Gradients in 'batched' and 'loop' modes and with chunk_size equal vmap's (in float64: loop mode sums each
    example's 4 features on their own, and w's gradient sums the examples in another order; see cases.F64)."""
    x, w = randn(B, 4, seed=6, dtype=torch.float64), randn(4, seed=7, dtype=torch.float64)
    exp = _grads(torch.vmap, x, w)
    for opts in ({"mode": "loop"}, {"chunk_size": 2}, {"mode": "loop", "chunk_size": 3}):
        got = _grads(cm.cmap, x, w, **opts)
        torch.testing.assert_close(got[0], exp[0], **F64)
        torch.testing.assert_close(got[1], exp[1], **F64)

    def batched_f(xb, w):
        h = (xb * w).sin()
        return h.sum(-1), h * 2

    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    a, b = cm.cmap(batched_f, in_dims=(0, None), mode="batched", chunk_size=2)(xb, wb)
    (a.square().sum() + (b * torch.arange(4.0, dtype=b.dtype)).sum()).backward()
    torch.testing.assert_close(xb.grad, exp[0], **F64)
    torch.testing.assert_close(wb.grad, exp[1], **F64)
    return True


def check_dst_rank_not_differentiable(B):
    """dst=0 with inputs requiring grad: backward raises a clear error on rank 0, others get None; no hang."""
    rank = dist.get_rank()
    x = randn(B, 3, seed=10).requires_grad_()
    out = cm.cmap(torch.sin, dst=0)(x)
    if rank != 0:
        assert out is None
    else:
        assert out.requires_grad
        with pytest.raises(RuntimeError, match="not differentiable"):
            out.sum().backward()
    again = cm.cmap(torch.sin)(x.detach())  # the group is still usable
    assert torch.equal(again, torch.sin(x.detach()))
    return True


def check_function_transforms(B):
    """torch.func.grad / jacrev inside func, a Jacobian from vector-Jacobian products, no_grad, double backward."""
    params = {"w": randn(3, 4, seed=11), "b": randn(3, seed=12)}
    xs, ys = randn(B, 4, seed=13), randn(B, 3, seed=14)

    def loss_fn(p, x, y):
        return ((x @ p["w"].T + p["b"] - y) ** 2).mean()

    per_ex = torch.func.grad(loss_fn)
    exp = torch.vmap(per_ex, in_dims=(None, 0, 0))(params, xs, ys)
    # vmap makes x @ w.T one matmul over the rows it gets, which BLAS may block otherwise for a shard: the residual
    # may move as a sum of 5 terms (4 products and the bias) added in another order; the gradients are 2/3 of the
    # residual, times x for w.
    residual = linear_scale(xs, params["w"], params["b"]) * (2 / 3) * max(float(xs.abs().max()), 1.0)
    tol = sum_tolerance(5, residual)
    assert_same(cm.cmap(per_ex, in_dims=(None, 0, 0))(params, xs, ys), exp, tol, "per-example grads")
    jac = torch.func.jacrev(lambda x: x.sin() * x.sum())
    assert_same(cm.cmap(jac)(xs), torch.vmap(jac)(xs), False, "jacrev")

    # vectorised vjp (as in examples/vjp_jacobian.py): rows of the Jacobian of f(x) = x ** 2
    n = max(B, 1)
    x = randn(n, seed=15).requires_grad_()
    y = x**2
    eye = torch.eye(n)

    def get_vjp(v):
        return torch.autograd.grad(y, x, v, retain_graph=True)

    assert_same(cm.cmap(get_vjp)(eye), torch.vmap(get_vjp)(eye), True, "vjp jacobian")

    # no_grad: no graph, and no more communication than a call whose inputs need no grad
    xg = xs.clone().requires_grad_()
    with cm.record_collectives() as plain:
        cm.cmap(torch.sin)(xs)
    with cm.record_collectives() as log, torch.no_grad():
        out = cm.cmap(torch.sin)(xg)
    assert not out.requires_grad and out.grad_fn is None
    assert log.entries == plain.entries

    # double backward through the cmap boundary: the same second-order gradient as vmap's
    got, ref = xs.clone().requires_grad_(), xs.clone().requires_grad_()
    for fn, x in ((cm.cmap, got), (torch.vmap, ref)):
        (g,) = torch.autograd.grad(fn(torch.sin)(x).sum(), x, create_graph=True)
        g.square().sum().backward()
    torch.testing.assert_close(got.grad, ref.grad)
    return True


def check_closure_capture(B):
    """Closure-captured tensors get vmap's gradient: the sum of every rank's rows, never P times it."""
    w = randn(4, seed=16).requires_grad_()
    x = randn(B, 4, seed=17).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and nothing to warn about
        out = cm.cmap(lambda r: (r * w).sum())(x)
    out.sum().backward()
    torch.testing.assert_close(w.grad, x.detach().sum(0), **batch_sum_tolerance(x.detach()))
    torch.testing.assert_close(x.grad, w.detach().expand(B, 4))
    return True


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_gradient_parity(worlds, P):
    sizes = [1, P + 1, 7, 16]
    assert worlds(P).run(check_grad_parity, sizes) == [len(sizes)] * P


def test_gradient_parity_bfloat16(worlds):
    assert worlds(3).run(check_grad_parity, [5, 8], torch.bfloat16) == [2] * 3


@pytest.mark.parametrize("P", [2, 4])
def test_gradient_never_scaled_by_p(worlds, P):
    ratios = worlds(P).run(check_no_factor_of_p, 9)
    assert all(abs(r - 1.0) < 0.5 for r in ratios), ratios  # 1 up to rounding, not P


@pytest.mark.parametrize("P,B", [(2, 5), (4, 3)])
def test_module_parameter_gradients(worlds, P, B):
    assert worlds(P).run(check_module_params, B) == [True] * P


def test_gradients_in_modes_and_chunks(worlds):
    assert worlds(3).run(check_modes_and_chunks, 7) == [True] * 3


def test_dst_rank_backward_raises_without_hanging(worlds):
    assert worlds(2).run(check_dst_rank_not_differentiable, 5, deadline=60) == [True] * 2


@pytest.mark.parametrize("P", [2, 3])
def test_function_transforms_inside_cmap(worlds, P):
    assert worlds(P).run(check_function_transforms, 5) == [True] * P


@pytest.mark.parametrize("P,B", [(2, 5), (3, 2)])
def test_closure_captured_tensors(worlds, P, B):
    assert worlds(P).run(check_closure_capture, B) == [True] * P


def check_large_outputs(P):
    """Large outputs (past the status round's payload: a data phase) in repeated calls, with a changing batch size:
    gradients still equal vmap's, and backward costs one round plus one data collective per input kind."""
    f = cm.cmap(lambda r, w: (r * w).sin(), in_dims=(0, None))
    for B in (1200, 1200, 1201):
        x, w = randn(B, 600, seed=B), randn(600, seed=1)
        with cm.record_collectives() as log:
            got = _grads_of(f, x, w)
        exp = _grads_of(torch.vmap(lambda r, w: (r * w).sin(), in_dims=(0, None)), x, w)
        assert torch.equal(got[0], exp[0]), B
        per_example = torch.vmap(torch.func.grad(_sin_square, argnums=1), in_dims=(0, None))(x, w)
        torch.testing.assert_close(got[1], exp[1], **batch_sum_tolerance(per_example))
        # forward: round + data all-gather; backward: round + rows all-gather + all-reduce of w's gradient
        assert log.ops("all_gather") == 4 and log.ops("all_reduce") == 1, log.entries
    return True


def _sin_square(r, w):
    """One example's share of the loss ``_grads_of`` differentiates."""
    return (r * w).sin().pow(2).sum()


def _grads_of(fn, x, w):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    fn(x, w).pow(2).sum().backward()
    return x.grad, w.grad


def test_gradients_of_large_outputs(worlds):
    assert worlds(2).run(check_large_outputs, 2) == [True] * 2
