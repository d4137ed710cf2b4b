"""psum, pmean, pmax, pmin, all_gather, axis_index and axis_size by axis_name, in every mode.

The oracle is a single-process computation of the same global quantity; the same checks run at P=1..4.
"""

import pytest
import torch
import torch.distributed as dist
from cases import F64, batch_sum_tolerance, linear_scale, randn, sum_tolerance

import colossalai_cmap as cm
from colossalai_cmap import all_gather, axis_index, axis_size, pmax, pmean, pmin, psum

MODES = ("vmap", "batched", "loop")


def _einsum_rows(g, x):
    return torch.einsum("...bf,...f->...b", g, x)


# (name, per-example-or-batch function, single-process reference on the whole batch, differentiable)
OPS = [
    ("psum", lambda x: x / psum(x.sum(-1), "i")[..., None], lambda x: x / x.sum(), True),
    ("pmean", lambda x: x - pmean(x, "i"), lambda x: x - x.mean(0), True),
    ("pmax", lambda x: x - pmax(x, "i"), lambda x: x - x.amax(0), False),
    ("pmin", lambda x: x - pmin(x, "i"), lambda x: x - x.amin(0), False),
    ("all_gather", lambda x: _einsum_rows(all_gather(x, "i"), x), lambda x: x @ x.T, True),
    ("axis_index", lambda x: x * axis_index("i")[..., None], lambda x: x * torch.arange(len(x))[:, None], False),
    ("axis_size", lambda x: x * axis_size("i"), lambda x: x * len(x), False),
]


def _tolerance(name, x):
    """How far cmap's result may be from the reference's on ``x``: the collectives add the examples in another order.

    psum: the total S of the 3B entries moves by at most dS = 2 gamma_3B sum|x|, so x / S by |x| dS / (S (S - dS)).
    pmean: a sum of B rows and a division by B (gamma_{B+2}). all_gather: each entry of x @ x.T is a dot of 3 terms
    that vmap's einsum may add in another order. The rest take a max, a min or multiply by an integer: the same
    roundings on the same values.
    """
    if name == "psum" and x.numel():
        total, d_total = float(x.double().sum()), sum_tolerance(x.numel(), x.double().abs().sum())["atol"]
        return {"atol": float(x.abs().max()) * d_total / (abs(total) * (abs(total) - d_total)), "rtol": 1.3e-6}
    if name == "pmean":
        return sum_tolerance(len(x) + 2, x.double().abs().sum(0) / max(len(x), 1))
    if name == "all_gather":
        return sum_tolerance(x.shape[-1], linear_scale(x, x))
    return {}


def check_ops(batch_sizes, modes=MODES):
    done = []
    for B in batch_sizes:
        x = randn(B, 3, seed=B) + 2.0
        for name, f, ref, _ in OPS:
            if B == 0 and name in ("pmax", "pmin"):
                continue  # the reference itself is undefined: the max of nothing
            expected, tol = ref(x), _tolerance(name, x)
            for mode in modes:
                if mode == "loop" and B == 0:
                    continue
                got = cm.cmap(f, axis_name="i", mode=mode)(x)
                torch.testing.assert_close(got, expected, **tol, msg=lambda m: f"{name} {mode} B={B}: {m}")
                done.append((name, mode, B))
    return len(done)


def check_grads(batch_sizes):
    """psum, pmean and all_gather gradients equal the single-process reference; pmax refuses clearly.

    In float64: each gradient chains sums over the batch (the total, then the cotangents' contraction with x) that
    cmap adds in another order (cases.F64)."""
    done = 0
    for B in batch_sizes:
        x0 = randn(B, 3, seed=100 + B, dtype=torch.float64) + 2.0
        for name, f, ref, diff in OPS:
            if not diff:
                continue
            x_ref = x0.clone().requires_grad_()
            r = ref(x_ref)
            weights = randn(*r.shape, seed=300 + B, dtype=torch.float64)
            (r * weights).sum().backward()
            for mode in ("vmap", "batched"):
                x = x0.clone().requires_grad_()
                (cm.cmap(f, axis_name="i", mode=mode)(x) * weights).sum().backward()
                torch.testing.assert_close(x.grad, x_ref.grad, **F64, msg=lambda m: f"grad {name} {mode} B={B}: {m}")
                done += 1
    x = x0.clone().requires_grad_()
    try:
        cm.cmap(lambda v: v - pmax(v, "i"), axis_name="i")(x).sum().backward()
    except cm.CmapError as exc:
        assert "not differentiable" in str(exc)
    except RuntimeError as exc:
        assert "not differentiable" in str(exc)
    else:
        raise AssertionError("pmax backward did not raise")
    return done


def check_errors():
    x = torch.ones(5, 2)
    with pytest.raises(NameError, match="unbound axis name 'i'"):
        psum(x, "i")
    with pytest.raises(cm.CmapError, match="unbound axis name 'j'"):
        cm.cmap(lambda v: psum(v, "j"), axis_name="i")(x)
    with pytest.raises(ValueError, match="chunk_size cannot be combined with axis_name"):
        cm.cmap(torch.sin, axis_name="i", chunk_size=2)

    # one rank fails before its psum while the others wait in it: all raise, nobody hangs, the group survives
    def f(v):
        if dist.get_rank() == 1:
            raise KeyError("before psum")
        return v / psum(v.sum(), "i")

    with pytest.raises(cm.CmapError, match="KeyError"):
        cm.cmap(f, axis_name="i")(x)

    # ranks calling a different number of collectives (loop mode, data-dependent) are told so
    def g(v):
        y = psum(v, "i")
        if dist.get_rank() == 0:
            y = y + psum(v, "i")
        return y

    with pytest.raises(cm.CmapError, match="same collective calls"):
        cm.cmap(g, axis_name="i")(x)
    assert torch.equal(cm.cmap(lambda v: psum(v, "i"), axis_name="i")(x), torch.full((5, 2), 5.0))
    return True


def check_nested(B0, B1):
    """Outer axis 'i' over mesh axis 0, inner axis 'j' over mesh axis 1: each reduces over its own axis (in float64:
    a mean over the inner axis, then a sum of all entries over the outer one, each added in another order)."""
    from colossalai.cluster import ProcessGroupMesh

    mesh = ProcessGroupMesh(2, 2)
    x = randn(B0, B1, 3, seed=5, dtype=torch.float64)
    inner = cm.cmap(lambda v: v - pmean(v, "j"), group=(mesh, 1), axis_name="j")

    def outer_f(rows):
        y = torch.stack([inner(r) for r in rows]) if len(rows) else rows
        return y / psum(y.abs().sum((-1, -2)), "i")[:, None, None]

    got = cm.cmap(outer_f, group=(mesh, 0), axis_name="i", mode="batched")(x)
    y = x - x.mean(1, keepdim=True)
    torch.testing.assert_close(got, y / y.abs().sum(), **F64)
    return True


def check_replicated_output(B):
    """out_dims=None returns a value every example shares once, e.g. after a psum (used by shard_linears_fx)."""
    x = randn(B, 4, seed=9)
    total, centred = cm.cmap(lambda v: (psum(v, "i"), v - pmean(v, "i")), out_dims=(None, 0), axis_name="i")(x)
    torch.testing.assert_close(total, x.sum(0), **batch_sum_tolerance(x))
    torch.testing.assert_close(centred, x - x.mean(0), **_tolerance("pmean", x))
    xg = x.clone().requires_grad_()
    w = randn(4, seed=10)
    t = cm.cmap(lambda v: psum(v * v, "i"), out_dims=None, axis_name="i")(xg)
    (t * w).sum().backward()
    torch.testing.assert_close(xg.grad, 2 * x * w)  # never scaled by P
    return True


def test_collectives_single_process():
    """Without torch.distributed, the same ops reduce over the local batch."""
    assert check_ops([1, 5]) > 0


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_each_op_each_mode(worlds, P):
    sizes = sorted({1, max(P - 1, 1), 5, 8} | ({0} if P > 1 else set()))
    counts = worlds(P).run(check_ops, sizes)
    assert counts[0] > 0 and len(set(counts)) == 1


@pytest.mark.parametrize("P", [2, 3])
def test_gradients(worlds, P):
    assert worlds(P).run(check_grads, [1, P + 1, 6]) == [3 * 2 * 3] * P


def test_errors_and_mismatched_collectives(worlds):
    assert worlds(2).run(check_errors) == [True] * 2


def test_nested_axis_names(worlds):
    assert worlds(4).run(check_nested, 5, 3) == [True] * 4


@pytest.mark.parametrize("P", [2, 3])
def test_replicated_outputs(worlds, P):
    assert worlds(P).run(check_replicated_output, 5) == [True] * P


def check_local_dst_backward_with_empty_shards():
    """dst='local' with psum and B < P: every rank (the empty one too) backprops through its own outputs, so the
    psum backward meets on every rank (no hang); the gradient of one global loss: the per-rank losses summed, the
    replicated (out_dims=None) output counted once."""
    rank, size = dist.get_rank(), dist.get_world_size()
    x = randn(size - 1, 4, seed=3).requires_grad_()
    total, doubled = cm.cmap(lambda v: (psum(v, "i"), v * 2), out_dims=(None, 0), axis_name="i", dst="local")(x)
    torch.testing.assert_close(total, x.detach().sum(0), **batch_sum_tolerance(x.detach()))
    (total.sum() + doubled.sum()).backward()
    if rank < size - 1:  # this rank's row: 2 from its own output, plus 1 from the psum, counted once (not P times)
        torch.testing.assert_close(x.grad[rank], torch.full((4,), 3.0))
    return True


def test_local_dst_backward_with_empty_shards(worlds):
    assert worlds(3).run(check_local_dst_backward_with_empty_shards, deadline=60) == [True] * 3
