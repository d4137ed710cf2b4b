"""cmap where third-party code looks: the cases found by running vmap's own behaviours, random calls and jax's
shard_map tutorial through cmap. The oracle is single-process ``torch.vmap`` / ``torch.func`` (or the math), on the
same inputs, at P = 1 to 4."""

import pytest
import torch
import torch.distributed as dist
from cases import randn

import colossalai_cmap as cm

WORLDS = [1, 2, 3, 4]


def _rows(B: int) -> slice:
    """This rank's rows under dst="local" / src="local": ``torch.tensor_split``'s share."""
    rank, size = dist.get_rank(), dist.get_world_size()
    sizes = [len(c) for c in torch.arange(B).tensor_split(size)]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


# ------------------------------------------------------------------------------- gradients taken inside func
def check_grad_inside_func():
    """``torch.autograd.grad`` inside func with respect to a captured tensor is per example, as in vmap (a vjp
    against each row of the identity is the Jacobian); only the gradient into the caller's graph sums over ranks."""
    x, y = randn(3, seed=1).requires_grad_(), randn(3, seed=2)

    def vjp_mul(v):
        return torch.autograd.grad([x * y], [x], grad_outputs=[v])[0]

    expected = torch.vmap(vjp_mul)(torch.eye(3))
    got = cm.cmap(vjp_mul)(torch.eye(3))
    assert torch.equal(expected, torch.diagflat(y)) and torch.equal(got, expected), got

    def vjp_square(v):  # a second-order use: the inner gradient is part of the outer graph
        return torch.autograd.grad([x * x * y], [x], grad_outputs=[v], create_graph=True)[0]

    for B in (2, 5, 7):
        v = randn(B, 3, seed=B)
        torch.vmap(vjp_square)(v).sum().backward()
        x_grad, x.grad = x.grad, None
        out = cm.cmap(vjp_square)(v)
        torch.testing.assert_close(out, 2 * x.detach() * y * v)
        out.sum().backward()
        # sum over B rows of 2*y*v: the same terms, summed in another order across ranks
        torch.testing.assert_close(x.grad, x_grad, atol=B * 4 * torch.finfo(torch.float32).eps * 16, rtol=0)
        x.grad = None
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_grad_inside_func_is_per_example(worlds, P):
    assert worlds(P).run(check_grad_inside_func) == [True] * P


# ---------------------------------------------------------------------- replicated inputs under dst="local"
def check_data_parallel_local(B):
    """Data parallelism as in jax's shard_map tutorial: each rank maps its own examples (src="local",
    dst="local"), the weights are unmapped and the same on every rank, the loss is taken from the local outputs.
    After backward every rank holds the full gradient (the transpose of using a replicated value is a psum of the
    cotangents), equal to single-process autograd of the loss summed over every rank's examples."""
    x_all, t_all = randn(B, 6, seed=11), randn(B, 2, seed=12)
    w0, b0 = randn(6, 2, seed=13), randn(2, seed=14)
    rows = _rows(B)

    def predict(w, b, xi):
        return torch.tanh(xi @ w + b)

    w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    out = cm.cmap(predict, in_dims=(None, None, 0), src="local", dst="local")(w, b, x_all[rows])
    ((out - t_all[rows]) ** 2).sum().backward()
    wr, br = w0.clone().requires_grad_(), b0.clone().requires_grad_()
    ((torch.vmap(predict, in_dims=(None, None, 0))(wr, br, x_all) - t_all) ** 2).sum().backward()
    # a sum over B examples split over ranks, then summed in another order: n * eps * sum|terms|
    for got, exp in ((w.grad, wr.grad), (b.grad, br.grad)):
        torch.testing.assert_close(got, exp, atol=B * torch.finfo(torch.float32).eps * 64, rtol=1e-5)
    # the same with an optimizer: every rank's model stays the same as the single-process one
    opt_w = torch.optim.SGD([w, b], lr=0.1)
    opt_w.step()
    torch.testing.assert_close(w, wr.detach() - 0.1 * wr.grad, atol=B * 1e-6, rtol=1e-5)
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_replicated_inputs_get_full_gradient_with_local_dst(worlds, P):
    assert worlds(P).run(check_data_parallel_local, 7) == [True] * P


def check_mapped_full_input_local_dst(B):
    """src=None, dst="local": the mapped input is one global value every rank holds whole, so its gradient is the
    total derivative of the per-rank losses summed: every row filled, on every rank, equal to vmap's."""
    x, w = randn(B, 4, seed=8), randn(4, seed=9)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    cm.cmap(torch.mul, in_dims=(0, None), dst="local")(xl, wl).sin().sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.vmap(torch.mul, in_dims=(0, None))(xr, wr).sin().sum().backward()
    assert torch.equal(xl.grad, xr.grad)  # each row's gradient comes from exactly one rank: exact
    torch.testing.assert_close(wl.grad, wr.grad, atol=B * torch.finfo(torch.float32).eps * 8, rtol=1e-5)
    return True


@pytest.mark.parametrize("P", WORLDS)
def test_mapped_input_gradient_with_local_dst(worlds, P):
    assert worlds(P).run(check_mapped_full_input_local_dst, 7) == [True] * P
