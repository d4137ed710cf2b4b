"""shard_linears_fx (the torch.fx form) and replicated outputs, on real gloo worlds of 2, 3 and 4.

The oracle is the unsharded model, run in the same process on the same inputs: the sharded forward must match it,
and so must the gradients (a sharded weight's gradient is the matching ``torch.tensor_split`` slice). The models
run in float64 (cases.F64): a row-sharded Linear adds its input features' products in per-rank partial sums, and
the layers after it carry that difference on.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cases import F64, batch_sum_tolerance, linear_scale, randn, sum_tolerance
from torch import nn
from torch.fx.proxy import TraceError

import colossalai_cmap as cm
from colossalai_cmap import psum, shard_linears_fx

DEADLINE = 60  # seconds per distributed check (the harness kills the world past it)
pytestmark = pytest.mark.timeout(120)
TOL = F64
DOUBLE = torch.float64


def _rank_size():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# ------------------------------------------------------------------------------------------------------ models
class Functional(nn.Module):
    """F.linear on its own parameters (no nn.Linear), with an input of more than two dims."""

    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(fout, fin))
        self.b = nn.Parameter(torch.randn(fout))
        self.head = nn.Linear(fout, 2, bias=False)

    def forward(self, x):
        return self.head(torch.relu(F.linear(x, self.w, self.b)))


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # data-dependent control flow: fx cannot trace it
            h = h * 2
        return h


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Branchy()

    def forward(self, x):
        return self.block(x) + 1


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x) + self.fc.weight.sum()


class CalledAndFunctional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x) + F.linear(x, self.fc.weight, self.fc.bias)


def mlp(fin: int, hidden: int, fout: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)  # the same model on every rank
    layers = (nn.Linear(fin, hidden), nn.GELU(), nn.Linear(hidden, fout), nn.Tanh(), nn.Linear(fout, 3))
    return nn.Sequential(*layers).double()


def _parity(model: nn.Module, sharded: nn.Module, x: torch.Tensor, style: str, what: str, rename=None) -> None:
    """Forward and gradient parity of ``sharded`` against ``model`` on input ``x``.

    ``rename`` maps a sharded parameter's name to the unsharded one where they differ (``F.linear`` sites).
    """
    rank, size = _rank_size()
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    model.zero_grad(), sharded.zero_grad()
    ref, got = model(xr), sharded(xs)
    torch.testing.assert_close(got, ref, **TOL, msg=lambda m: f"{what}: forward: {m}")
    weights = randn(*ref.shape, seed=ref.numel(), dtype=ref.dtype)
    (ref.sin() * weights).sum().backward()
    (got.sin() * weights).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, **TOL, msg=lambda m: f"{what}: input grad: {m}")
    full = dict(model.named_parameters())
    shards = {
        f"{path}.{kind}" if path else kind
        for path, mod in sharded.named_modules()
        if type(mod).__name__ == "ShardedLinear"
        for kind in ("weight", "bias")
    }
    for name, p in sharded.named_parameters():
        g = full[(rename or {}).get(name, name)].grad
        if name in shards and name.endswith("weight"):
            g = g.tensor_split(size, dim=1 if style == "row" else 0)[rank]
        elif name in shards and style == "col":  # a col-style bias is split with its output features
            g = g.tensor_split(size)[rank]
        torch.testing.assert_close(p.grad, g, **TOL, msg=lambda m: f"{what}: grad of {name}: {m}")


# ---------------------------------------------------------------------------------------- distributed checks
def check_motivating_example():
    """The motivating example: Linear(64, 24) sharded by input features, batch 100, in float32; returns this rank's
    parameter bytes. Each output is a sum of 65 terms (64 products and the bias) that the ranks add in partial sums:
    it may move by sum_tolerance's bound, about 2e-5 here (a fixed atol of 1e-5 holds only by luck of the rounding)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 24)
    x = torch.rand(100, 64)
    expected = model(x)
    sharded = shard_linears_fx(model)
    tol = sum_tolerance(65, linear_scale(x, model.weight.detach(), model.bias.detach()))
    torch.testing.assert_close(sharded(x), expected, **tol)
    rank, size = _rank_size()
    cols = torch.arange(64).tensor_split(size)[rank].numel()
    assert dict((n, tuple(p.shape)) for n, p in sharded.named_parameters()) == {
        "weight_shard.weight": (24, cols),
        "weight_shard.bias": (24,),
    }
    return _param_bytes(sharded)


def check_uneven(style):
    """Feature counts that do not divide by P, fewer features than ranks, F.linear sites, 3-d inputs."""
    rank, size = _rank_size()
    done = 0
    for fin, fout in ((7, 5), (size - 1 or 1, size + 1), (1, 1)):
        torch.manual_seed(fin * 10 + fout)
        model = nn.Linear(fin, fout).double()
        sharded = shard_linears_fx(model, style=style)
        rename = {"weight_shard.weight": "weight", "weight_shard.bias": "bias"}  # the root Linear's F.linear call
        for B in (1, 3, size + 1, 0):
            x = randn(B, fin, seed=B, dtype=DOUBLE)
            _parity(model, sharded, x, style, f"Linear({fin}, {fout}) {style} B={B}", rename)
            done += 1
    torch.manual_seed(3)
    model = Functional(9, 6).double()
    sharded = shard_linears_fx(model, style=style)
    names = {n for n, _ in sharded.named_parameters()}
    assert names == {"w_shard.weight", "w_shard.bias", "head.weight"}, names
    assert not hasattr(sharded, "w") and not hasattr(sharded, "b")
    rename = {"w_shard.weight": "w", "w_shard.bias": "b"}
    _parity(model, sharded, randn(2, 3, 9, seed=4, dtype=DOUBLE), style, f"Functional {style}", rename)
    return done + 1


def check_mlp(style, batch_sizes):
    rank, size = _rank_size()
    model = mlp(10, 13, 7, seed=5)
    sharded = shard_linears_fx(model, style=style)
    for B in batch_sizes:
        _parity(model, sharded, randn(B, 10, seed=20 + B, dtype=DOUBLE), style, f"MLP {style} B={B}")
    full, mine = _param_bytes(model), _param_bytes(sharded)
    assert mine < full or size == 1
    # only the listed layers are sharded
    partial = shard_linears_fx(model, layers=["2"], style=style)
    assert isinstance(partial.get_submodule("0"), nn.Linear)
    assert type(partial.get_submodule("2")).__name__ == "ShardedLinear"
    _parity(model, partial, randn(4, 10, seed=40, dtype=DOUBLE), style, f"MLP {style} layers=['2']")
    return mine


def check_replicated_outputs(B):
    """out_dims=None in plain cmap use, and the check_inputs check that such an output really is replicated."""
    rank, size = _rank_size()
    x = randn(B, 4, seed=B)
    for mode in ("vmap", "batched"):
        for opts in ({}, {"check_inputs": True}):
            f = (lambda v: psum(v, "i")) if mode == "vmap" else (lambda v: psum(v, "i")[0])  # batched: rows
            total = cm.cmap(f, out_dims=None, axis_name="i", mode=mode, **opts)(x)
            torch.testing.assert_close(total, x.sum(0), **batch_sum_tolerance(x))  # x's rows in another order
    # a local sum declared replicated: caught by check_inputs, with every rank raising the same error
    local_sum = cm.cmap(lambda v: v.sum(0), out_dims=None, mode="batched", check_inputs=True)
    with pytest.raises(cm.CmapError, match=r"declared replicated \(out_dims=None\) is not the same on every rank"):
        local_sum(x)
    # src="local": per-rank shards may differ, the replicated output must not
    shard = x.tensor_split(size)[rank]
    out = cm.cmap(lambda v: psum(v, "i"), out_dims=None, axis_name="i", src="local", check_inputs=True)(shard)
    torch.testing.assert_close(out, x.sum(0), **batch_sum_tolerance(x))
    with pytest.raises(cm.CmapError, match="output leaf 1"):
        cm.cmap(lambda v: (v, v.sum(0) + rank), out_dims=(0, None), mode="batched", src="local", check_inputs=True)(
            shard
        )
    # src="local" with check_inputs: shards may differ, in_dims=None inputs may not
    scale = torch.tensor(1.0 + rank)
    with pytest.raises(cm.CmapError, match="in_dims=None inputs"):
        cm.cmap(torch.mul, in_dims=(0, None), src="local", check_inputs=True)(shard, scale)
    # a structure that differs across ranks still gets the general message
    with pytest.raises(cm.CmapError, match="different per-example shapes"):
        cm.cmap(lambda v: v.sum(0)[: 1 + rank], out_dims=None, mode="batched", check_inputs=True)(x)
    return True


def check_local_src_grads(B):
    """src='local', dst=-1: a shard's gradient is its slice; an in_dims=None input's is summed over the group."""
    rank, size = _rank_size()
    x, w = randn(B, 4, seed=8), randn(4, seed=9)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (torch.vmap(torch.mul, in_dims=(0, None))(xr, wr).sin() * torch.arange(4.0)).sum().backward()
    xs = x.tensor_split(size)[rank].clone().requires_grad_()
    ws = w.clone().requires_grad_()
    out = cm.cmap(torch.mul, in_dims=(0, None), src="local")(xs, ws)
    (out.sin() * torch.arange(4.0)).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad.tensor_split(size)[rank])
    # w's gradient sums the examples' cos(x w) x k over the ranks' rows, in another order than vmap's
    per_example = (x * w).cos() * x * torch.arange(4.0)
    torch.testing.assert_close(ws.grad, wr.grad, **batch_sum_tolerance(per_example))
    return True


def check_empty_rows(B):
    """Per-example outputs of zero bytes with uneven shards (a zero-size gather buffer row)."""
    x = randn(B, 3, seed=1)
    out = cm.cmap(lambda v: v[:0])(x)
    assert out.shape == (B, 0)
    return True


# ------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("P", [2, 3, 4])
def test_motivating_example(worlds, P):
    got = worlds(P).run(check_motivating_example, deadline=DEADLINE)
    cols = [c.numel() for c in torch.arange(64).tensor_split(P)]
    assert got == [4 * (24 * c + 24) for c in cols]


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("style", ["row", "col"])
def test_uneven_features(worlds, P, style):
    assert len(set(worlds(P).run(check_uneven, style, deadline=DEADLINE))) == 1


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("style", ["row", "col"])
def test_mlp_forward_and_gradients(worlds, P, style):
    sizes = worlds(P).run(check_mlp, style, [1, 2, P + 1, 8], deadline=DEADLINE)
    assert max(sizes) < _param_bytes(mlp(10, 13, 7, seed=5))


@pytest.mark.parametrize("P", [2, 3, 4])
def test_replicated_outputs_and_check(worlds, P):
    assert worlds(P).run(check_replicated_outputs, P + 2, deadline=DEADLINE) == [True] * P


@pytest.mark.parametrize("P", [2, 3])
def test_local_src_gradients(worlds, P):
    assert worlds(P).run(check_local_src_grads, 2 * P + 1, deadline=DEADLINE) == [True] * P


def test_zero_byte_outputs_uneven(worlds):
    assert worlds(3).run(check_empty_rows, 4, deadline=DEADLINE) == [True] * 3


# ------------------------------------------------------------------------------------------ single process
@pytest.mark.parametrize("style", ["row", "col"])
def test_single_process(style):
    """Without torch.distributed the whole weight is this process's shard, and the result is unchanged."""
    model = mlp(6, 5, 4, seed=1)
    _parity(model, shard_linears_fx(model, style=style), randn(3, 6, seed=2, dtype=DOUBLE), style, f"single {style}")


def test_untraceable_model_names_the_call():
    with pytest.raises(TraceError) as info:
        shard_linears_fx(Outer())
    text = str(info.value)
    assert "torch.fx cannot trace Outer" in text
    assert "at the call `if h.sum() > 0:" in text and "test_tp_fx.py" in text
    assert "'block' (Branchy)" in text
    assert "control flow" in text


def test_bad_arguments():
    model = mlp(4, 4, 4, seed=0)
    with pytest.raises(ValueError, match="unknown style='diag'"):
        shard_linears_fx(model, style="diag")
    with pytest.raises(ValueError, match=r"layers \['fc9'\] are not shardable linear layers.*found: \['0', '2', '4'\]"):
        shard_linears_fx(model, layers=["fc9"])
    with pytest.raises(ValueError, match="parameter 'fc.weight' is also used outside the linear call"):
        shard_linears_fx(Tied())
    with pytest.raises(ValueError, match="it belongs to module 'fc', which the model also calls"):
        shard_linears_fx(CalledAndFunctional(), layers=["fc.weight"])
    assert isinstance(shard_linears_fx(Tied(), layers=[]).fc, nn.Linear)
