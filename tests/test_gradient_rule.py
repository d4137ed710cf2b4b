"""The one gradient rule: with ``dst="local"`` (and in ``shard_map``), every rank's ``.grad`` is the gradient of one
global loss, the ranks' losses of their own rows summed, where an ``out_dims=None`` (replicated) output counts once.

jax's shard_map data-parallel example (the loss ``pmean``'d, ``out_specs=P()``) is written three ways, with
``cmap(src="local", dst="local")``, with ``cm.shard_map`` on global arguments and with ``cm.shard_map(local=True)``;
each must give jax's gradient of the same loss on the full batch on every rank at P = 1 to 4 (jax 0.10 in this
process when it imports, else ``torch.func.grad``), and a few steps of a real optimizer must land where single-process
training on the full batch lands. Then the first errors users meet: a mapped loop bound under vmap, and a backward
through a ``src=r``/``dst=r`` output on the receiving rank.

Tolerances: everything runs in float64; the loss chains two small matrix products (sums of at most 4 terms) and a
mean of 12 examples, added per rank and then over the ranks in another order than the oracle's, far inside
``cases.F64``.
"""

import functools

import pytest
import torch
import torch.distributed as dist
from cases import F64, assert_same
from torch.distributed.device_mesh import init_device_mesh

import colossalai_cmap as cm
from colossalai_cmap import CmapError, P

B, D_IN, D_H, D_OUT = 12, 3, 4, 2  # 12 rows: even blocks at every P from 1 to 4, as jax's shard_map requires


def _data():
    gen = torch.Generator().manual_seed(7)
    shapes = [(D_IN, D_H), (D_H,), (D_H, D_OUT), (D_OUT,)]
    flat = [torch.randn(s, generator=gen, dtype=torch.float64) * 0.5 for s in shapes]
    params = [(flat[0], flat[1]), (flat[2], flat[3])]
    x = torch.randn(B, D_IN, generator=gen, dtype=torch.float64)
    t = torch.randn(B, D_OUT, generator=gen, dtype=torch.float64)
    return params, x, t


def predict(params, inputs):
    """The tutorial's MLP, as written."""
    for W, b in params:
        outputs = inputs @ W + b
        inputs = torch.relu(outputs)
    return outputs


def loss(params, batch):
    """The tutorial's loss on a batch (a mean of the examples' squared errors)."""
    inputs, targets = batch
    predictions = predict(params, inputs)
    return torch.mean(torch.sum((predictions - targets) ** 2, dim=-1))


def _leaves(params):
    return [v for layer in params for v in layer]


def _fresh(params):
    return [tuple(v.detach().clone().requires_grad_() for v in layer) for layer in params]


def _mine(x):
    rank, size = dist.get_rank(), dist.get_world_size()
    return x.tensor_split(size)[rank]


def _ways():
    """The data-parallel loss, three ways: each ``(params, x, t) -> replicated loss`` on every rank, and whether it
    takes this rank's rows (True) or the global batch."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("i",))

    def one(params, x, t):  # one example; pmean over the whole global batch
        return cm.pmean(torch.sum((predict(params, x) - t) ** 2, dim=-1), "i")

    cmapped = cm.cmap(one, in_dims=(None, 0, 0), out_dims=None, axis_name="i", src="local", dst="local")

    def loss_dp(params, batch):  # the tutorial's block function, as written
        local_loss = loss(params, batch)
        return cm.pmean(local_loss, "i")

    dp = cm.shard_map(loss_dp, mesh=mesh, in_specs=(P(), P("i")), out_specs=P())
    dp_local = cm.shard_map(loss_dp, mesh=mesh, in_specs=(P(), P("i")), out_specs=P(), local=True)
    return {
        "cmap": (cmapped, True),
        "shard_map": (lambda p, x, t: dp(p, (x, t)), False),
        "shard_map_local": (lambda p, x, t: dp_local(p, (x, t)), True),
    }


def gradients(name):
    """One way's loss and gradient on this rank."""
    params, x, t = _data()
    fn, local = _ways()[name]
    p = _fresh(params)
    args = (_mine(x), _mine(t)) if local else (x, t)
    value = fn(p, *args)
    return value.detach(), torch.autograd.grad(value, _leaves(p))


def ratio(grads, want_grads):
    """The gradient over the oracle's, averaged over every element (P where a replicated loss counts P times)."""
    return float(torch.cat([(g / w).flatten() for g, w in zip(grads, want_grads)]).mean())


def check_data_parallel(want_loss, want_grads):
    """Each way's loss and gradient against the oracle's; returns each way's gradient ratio."""
    ratios = {}
    for name in _ways():
        value, grads = gradients(name)
        assert_same(value, want_loss, F64, f"{name}: loss")
        ratios[name] = ratio(grads, want_grads)
        for k, (g, w) in enumerate(zip(grads, want_grads)):
            assert_same(g, w, F64, f"{name}: gradient of params leaf {k} (ratio {ratios[name]:.3f})")
    return ratios


def check_training(steps, lr):
    """A few steps of torch.optim.SGD (momentum) on the data-parallel loss, each way, against the same steps on the
    full batch in one process: every rank's params after each step."""
    params, x, t = _data()
    ref = _fresh(params)
    ref_opt = torch.optim.SGD(_leaves(ref), lr=lr, momentum=0.9)
    ref_after = []
    for _ in range(steps):
        ref_opt.zero_grad()
        loss(ref, (x, t)).backward()
        ref_opt.step()
        ref_after.append([v.detach().clone() for v in _leaves(ref)])
    for name, (fn, local) in _ways().items():
        p = _fresh(params)
        opt = torch.optim.SGD(_leaves(p), lr=lr, momentum=0.9)
        args = (_mine(x), _mine(t)) if local else (x, t)
        for step in range(steps):
            opt.zero_grad()
            fn(p, *args).backward()
            opt.step()
            for k, (got, want) in enumerate(zip(_leaves(p), ref_after[step])):
                assert_same(got.detach(), want, F64, f"{name}: params leaf {k} after step {step + 1}")
    return steps


@functools.lru_cache(maxsize=None)
def _oracle():
    """The loss and its gradient on the full batch in this process: jax's when jax imports, else torch.func's."""
    params, x, t = _data()
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        value, grads = torch.func.grad_and_value(lambda ps: loss(ps, (x, t)))(params)
        return value, _leaves(grads)

    def jax_loss(ps, batch):  # the tutorial's, as written
        inputs, targets = batch
        for W, b in ps:
            outputs = jnp.dot(inputs, W) + b
            inputs = jax.nn.relu(outputs)
        return jnp.mean(jnp.sum((outputs - targets) ** 2, axis=-1))

    with jax.enable_x64(True):  # scoped: the process's other jax cases keep jax's default dtypes
        jp = [tuple(jnp.asarray(v.numpy()) for v in layer) for layer in params]
        value, grads = jax.value_and_grad(jax_loss)(jp, (jnp.asarray(x.numpy()), jnp.asarray(t.numpy())))
        value, grads = jax.device_get(value), jax.device_get(grads)
    as_torch = lambda a: torch.tensor(jax.device_get(a).tolist(), dtype=torch.float64)  # noqa: E731
    return as_torch(value), [as_torch(g) for layer in grads for g in layer]


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_data_parallel_gives_jax_gradients(worlds, P):
    """cmap(src="local", dst="local") and shard_map (global and local=True) give jax's loss and gradients on every
    rank: the replicated loss counts once (ratio 1, not P)."""
    want_loss, want_grads = _oracle()
    ratios = worlds(P).run(check_data_parallel, want_loss, want_grads)
    assert all(abs(r - 1.0) < 1e-9 for per_rank in ratios for r in per_rank.values()), ratios


def test_training_loop_matches_full_batch(worlds):
    assert worlds(3).run(check_training, 3, 0.1) == [3] * 3


def measure_one(name, want_grads):
    """This rank's gradient ratio for one way (for reports)."""
    return ratio(gradients(name)[1], want_grads)


def check_second_order():
    """A gradient penalty through a replicated ``dst="local"`` output (``create_graph=True``, then backward): both
    orders count the replicated value once, equal to one process (src=None and src="local")."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    w0 = torch.randn(3, generator=gen, dtype=torch.float64)

    def penalised(y, w):
        (g,) = torch.autograd.grad(y.square(), w, create_graph=True)
        return y + g.square().sum()

    w = w0.clone().requires_grad_()
    penalised((x * w).sin().sum(-1).mean(), w).backward()
    for src, xs in ((None, x), ("local", _mine(x))):
        wc = w0.clone().requires_grad_()
        one = lambda v, u: cm.pmean((v * u).sin().sum(), "i")  # noqa: E731
        mapped = cm.cmap(one, in_dims=(0, None), out_dims=None, axis_name="i", src=src, dst="local")
        penalised(mapped(xs, wc), wc).backward()
        assert_same(wc.grad, w.grad, F64, f"src={src}: the second-order gradient")
    return True


def test_second_order_counts_once(worlds):
    assert worlds(3).run(check_second_order) == [True] * 3


# ----------------------------------------------------------------------------------- the first errors users meet
def lorentz(state, t, sigma=10.0, beta=8.0 / 3, rho=28.0):
    x, y, z = state
    return torch.stack([sigma * (y - x), x * (rho - z) - y, x * y - beta * z])


def rk4(ys, dt, N):
    """jax's Lorentz ODE notebook's integrator, ported as written (its ``fori_loop(1, N, step, ys)``)."""
    f = lorentz
    ys = ys.clone()
    for i in range(1, N):
        h = dt
        t = dt * i
        k1 = h * f(ys[i - 1], t)
        k2 = h * f(ys[i - 1] + k1 / 2.0, dt * i + h / 2.0)
        k3 = h * f(ys[i - 1] + k2 / 2.0, t + h / 2.0)
        k4 = h * f(ys[i - 1] + k3, t + h)
        ys[i] = ys[i - 1] + 1.0 / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return ys


def check_mapped_loop_bound():
    """``cmap(rk4)(ys, dts, Ns)``: vmap's refusal, with cmap's way out; then both ways out give the loop's answer."""
    n, steps = 5, 6
    ys = torch.zeros(n, steps, 3, dtype=torch.float64)
    ys[:, 0] = torch.linspace(1.0, 2.0, n, dtype=torch.float64)[:, None]
    dts = torch.full((n,), 0.01, dtype=torch.float64)
    Ns = torch.tensor([2, 3, 4, 5, 6])
    with pytest.raises(CmapError) as caught:
        cm.cmap(rk4)(ys, dts, Ns)
    text = str(caught.value)
    assert "vmap: It looks like you're calling .item() on a Tensor" in text, text  # vmap's own sentence, kept
    assert "mode='loop'" in text and "in_dims=None" in text, text
    want = torch.stack([rk4(ys[k], dts[k], int(Ns[k])) for k in range(n)])
    assert torch.equal(cm.cmap(rk4, mode="loop")(ys, dts, Ns), want)
    shared = torch.stack([rk4(ys[k], dts[k], 4) for k in range(n)])
    torch.testing.assert_close(cm.cmap(rk4, in_dims=(0, 0, None))(ys, dts, torch.tensor(4)), shared)
    return True


@pytest.mark.parametrize("P", [1, 3])
def test_mapped_loop_bound_says_what_to_do(worlds, P):
    assert worlds(P).run(check_mapped_loop_bound) == [True] * P


def check_scattered_output_refuses_backward(src, dst):
    """``src=r``: every receiving rank's output refuses backward with cmap's message, even where no argument here
    requires grad (the receiving rank was given nothing)."""
    rank = dist.get_rank()
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    w = torch.linspace(-1, 1, 3, dtype=torch.float64)
    out = cm.cmap(lambda a, b: (a * b).sin(), in_dims=(0, None), src=src, dst=dst)(x if rank == src else None, w)
    if out is None:
        return "none"
    assert torch.equal(out.detach(), (x * w).sin().detach())
    with pytest.raises(RuntimeError, match="is not differentiable") as caught:
        out.sum().backward()
    assert "src=None" in str(caught.value) and (dst == -1 or "dst=-1" in str(caught.value)), caught.value
    return "refused"


@pytest.mark.parametrize("src,dst", [(0, 1), (1, 1), (0, -1)])
def test_scattered_output_refuses_backward(worlds, src, dst):
    got = worlds(2).run(check_scattered_output_refuses_backward, src, dst)
    assert got.count("refused") == (2 if dst == -1 else 1), got


# ------------------------------------------------ an empty batch, and fewer rows than ranks, in every mode
W_CLOSED = torch.tensor([[1.0, -2.0], [3.0, 0.5]], dtype=torch.float64)


def closure_outputs(W):
    """f of one example (or of a batch, in mode="batched"): a mapped output and an ``out_dims=None`` one computed
    from the closure weight ``W``."""
    return lambda x: (x @ W, W.t().relu() * 2)


def decay(W):
    """A weight-decay term of the loss, outside the map: a backward runs even where the map's outputs have no graph."""
    return W.square().sum() / 2


def short_batch(B, x_grad):
    gen = torch.Generator().manual_seed(B)
    x = torch.randn(B, 2, generator=gen, dtype=torch.float64).requires_grad_(x_grad)
    ca, cb = torch.randn(B, 2, generator=gen, dtype=torch.float64), torch.randn(
        2, 2, generator=gen, dtype=torch.float64
    )
    return x, ca, cb


def check_replicated_output_of_a_short_batch(B, mode, x_grad):
    """``dst="local"``: this rank's rows of the mapped output and the replicated one, backward of the global loss
    (this rank's rows' part, the replicated output's counted once, and a weight decay); returns ``W.grad`` and
    ``x.grad``, or the error of a backward that found no graph."""
    W = W_CLOSED.clone().requires_grad_()
    x, ca, cb = short_batch(B, x_grad)
    a, b = cm.cmap(closure_outputs(W), out_dims=(0, None), mode=mode, dst="local")(x)
    rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    try:
        ((a * ca.tensor_split(size)[rank]).sum() + (b * cb).sum() + decay(W)).backward()
    except RuntimeError as exc:
        return str(exc)
    return W.grad, x.grad


@pytest.mark.parametrize("P", [1, 2, 3])
def test_a_replicated_output_keeps_its_gradient_when_the_batch_is_short(worlds, P):
    """B = 0 and B < P, in every mode, with the mapped input requiring grad or not: the out_dims=None output's
    gradient reaches the closure weight, and every gradient is torch.vmap's in one process."""
    wrong = {}
    for B in sorted({0, max(P - 1, 1)}):
        for x_grad in (False, True):
            W = W_CLOSED.clone().requires_grad_()
            x, ca, cb = short_batch(B, x_grad)
            a, b = torch.vmap(closure_outputs(W), out_dims=(0, None))(x)
            ((a * ca).sum() + (b * cb).sum() + decay(W)).backward()
            for mode in ("vmap", "batched", "loop"):
                run = check_replicated_output_of_a_short_batch
                got = worlds(P).run(run, B, mode, x_grad, deadline=60) if P > 1 else [run(B, mode, x_grad)]
                for rank, grads in enumerate(got):
                    if isinstance(grads, str) or not torch.allclose(grads[0], W.grad, **F64):
                        wrong[B, mode, x_grad, rank] = grads
                    elif x_grad and (grads[1] is None or not torch.allclose(grads[1], x.grad, **F64)):
                        wrong[B, mode, x_grad, rank] = grads
    assert not wrong, f"want W.grad {W.grad.tolist()}, got {wrong}"
