"""BatchNorm in training mode under ``cmap(model, mode="batched")`` sees the whole batch, as ``model(x)`` does in one
process: the same outputs, gradients and running statistics at P = 1, 2 and 3, for uneven batches and empty shares;
a model trained through cmap ends where the model trained alone ends. ``mode="vmap"`` keeps vmap's refusal, with
both ways out, and ``mode="loop"``, chunks and ``SyncBatchNorm`` are refused alike at every P.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wire_tap
from cases import assert_same
from torch import nn

import colossalai_cmap as cm
from colossalai_cmap.errors import CmapError

# float64: the statistics add a channel's B * spatial values (at most a few hundred here) in another order (per rank,
# then over the ranks), and take the variance as the mean of squares less the squared mean, where torch takes
# Welford's: each is within n * eps * sum|x| of the exact value, about 1e-13 relative, and normalising divides by a
# standard deviation near 1. Three SGD steps carry that along. 1e-10 leaves a hundredfold margin; float32 would not
# come near it, and per-rank statistics miss it by ten orders.
TIGHT = dict(atol=1e-10, rtol=1e-10)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64)


def _affine(bn, seed):
    with torch.no_grad():
        bn.weight.copy_(torch.rand(bn.num_features, generator=_gen(seed), dtype=torch.float64) + 0.5)
        bn.bias.copy_(_randn(bn.num_features, seed=seed + 1))
    return bn


def _same_state(got, want, what):
    """Parameters, their gradients and buffers (running statistics, num_batches_tracked) alike."""
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m: f"{what}: {name}: {m}")
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, **TIGHT, msg=lambda m: f"{what}: {name}.grad: {m}")
    for (name, a), (_, b) in zip(got.named_buffers(), want.named_buffers()):
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m: f"{what}: buffer {name}: {m}")


# ------------------------------------------------------------------------------------- BatchNorm1d, F.batch_norm
def check_batchnorm1d(B):
    """BatchNorm1d on (B, C) and (B, C, L), momentum=0.1 and momentum=None (the cumulative average, over two
    calls), and F.batch_norm called by func itself: outputs, input and parameter gradients, running statistics."""
    cases = [
        (_affine(nn.BatchNorm1d(3).double(), 1), (B, 3)),
        (_affine(nn.BatchNorm1d(4, momentum=None).double(), 2), (B, 4, 5)),
        (nn.BatchNorm1d(4, affine=False, track_running_stats=False).double(), (B, 4, 2)),
    ]
    for k, (bn, shape) in enumerate(cases):
        ref = copy.deepcopy(bn)
        mapped = cm.cmap(bn, mode="batched")
        for step in range(2):
            x = _randn(*shape, seed=10 * k + step) * 3 + 1
            cotangent = _randn(*shape, seed=100 + step)
            xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
            got, want = mapped(xs), ref(xr)
            (got * cotangent).sum().backward()
            (want * cotangent).sum().backward()
            torch.testing.assert_close(got, want, **TIGHT)
            torch.testing.assert_close(xs.grad, xr.grad, **TIGHT)
            _same_state(bn, ref, f"case {k} step {step}")

    # dst="local": each rank keeps its rows; the gradient is the one global loss's, the ranks' losses summed
    bn = _affine(nn.BatchNorm1d(3).double(), 12)
    ref = copy.deepcopy(bn)
    x, cotangent = _randn(B, 3, seed=13), _randn(B, 3, seed=14)
    rows = torch.arange(B).tensor_split(dist.get_world_size())[dist.get_rank()]
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = cm.cmap(bn, mode="batched", dst="local")(xs)
    (got * cotangent[rows]).sum().backward()
    want = ref(xr)
    (want * cotangent).sum().backward()
    torch.testing.assert_close(got, want[rows], **TIGHT)
    torch.testing.assert_close(xs.grad, xr.grad, **TIGHT)
    _same_state(bn, ref, "dst='local'")

    mean, var = _randn(3, seed=5), _randn(3, seed=6).abs() + 0.5
    mean_ref, var_ref = mean.clone(), var.clone()
    w = _randn(3, seed=7).requires_grad_()
    x = _randn(B, 3, seed=8).requires_grad_()

    def functional(v):
        return F.batch_norm(v, mean, var, w, None, training=True, momentum=0.3, eps=1e-3).tanh()

    got = cm.cmap(functional, mode="batched")(x)
    gx, gw = torch.autograd.grad(got.sum(), (x, w))
    want = F.batch_norm(x, mean_ref, var_ref, w, None, training=True, momentum=0.3, eps=1e-3).tanh()
    wx, ww = torch.autograd.grad(want.sum(), (x, w))
    for a, b in [(got, want), (gx, wx), (gw, ww), (mean, mean_ref), (var, var_ref)]:
        torch.testing.assert_close(a, b, **TIGHT)
    return True


@pytest.mark.parametrize("P", [1, 2, 3])
def test_batchnorm1d_over_the_whole_batch(worlds, P):
    # 7 rows split unevenly at 2 and 3; 2 rows at 3 leave one share empty
    assert worlds(P).run(check_batchnorm1d, 7) == [True] * P
    assert worlds(P).run(check_batchnorm1d, 2) == [True] * P


# ------------------------------------------------------------------------------------ a CNN trained through cmap
class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):
        return self.fc(F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1))


def _train(model, forward, B, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outs = []
    for step in range(steps):
        x = _randn(B, 2, 4, 4, seed=20 + step) * 2 + 0.5
        y = torch.randint(0, 3, (B,), generator=_gen(30 + step))
        opt.zero_grad()
        out = forward(x)
        F.cross_entropy(out, y).backward()
        opt.step()
        outs.append(out.detach())
    return outs


def check_cnn_training(B):
    """conv-bn-relu-pool-linear, three SGD steps with momentum through ``cmap(model, mode="batched")`` (dst=-1):
    the outputs, weights and running statistics of the model trained alone."""
    torch.manual_seed(0)
    model = SmallCNN().double().train()
    ref, held = copy.deepcopy(model), copy.deepcopy(model)
    want = _train(ref, ref, B)
    got = _train(model, cm.cmap(model, mode="batched"), B)
    holder = _Holder(held)  # reached through an attribute: its parameters' gradients found by the closure machinery
    got_held = _train(held, cm.cmap(lambda v: holder.net(v), mode="batched"), B)
    for a, b, c in zip(got, got_held, want):
        torch.testing.assert_close(a, c, **TIGHT)
        torch.testing.assert_close(b, c, **TIGHT)
    _same_state(model, ref, "after training")
    _same_state(held, ref, "after training, reached through an attribute")
    return True


class _Holder:
    def __init__(self, net):
        self.net = net


@pytest.mark.parametrize("P", [1, 2, 3])
def test_cnn_trained_through_cmap_matches_the_model_alone(worlds, P):
    assert worlds(P).run(check_cnn_training, 5) == [True] * P
    assert worlds(P).run(check_cnn_training, 2) == [True] * P  # B < P at 3: an empty share


class CheckpointedCNN(SmallCNN):
    """SmallCNN with its bn-relu recomputed in backward (``torch.utils.checkpoint``): the recomputed BatchNorm
    sees the whole batch again, and updates the running statistics a second time, as it does in one process."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x):
        block = lambda v: F.relu(self.bn(v))  # noqa: E731
        h = torch.utils.checkpoint.checkpoint(block, self.conv(x), use_reentrant=self.reentrant)
        return self.fc(F.max_pool2d(h, 2).flatten(1))


def check_checkpointed(B, reentrant):
    torch.manual_seed(0)
    model = CheckpointedCNN(reentrant).double().train()
    ref = copy.deepcopy(model)
    want = _train(ref, ref, B, steps=2)
    got = _train(model, cm.cmap(model, mode="batched"), B, steps=2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TIGHT)
    _same_state(model, ref, f"checkpointed, use_reentrant={reentrant}")
    return True


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("P", [1, 3])
def test_checkpointed_batchnorm(worlds, P, reentrant):
    assert worlds(P).run(check_checkpointed, 5, reentrant) == [True] * P


def check_resnet(B):
    """transformers' ResNet (BatchNorm2d after every convolution), called as its users call it, two SGD steps."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)
    model = ResNetForImageClassification(config).double().train()
    ref = copy.deepcopy(model)
    mapped = cm.cmap(model, mode="batched")
    for step in range(2):
        x = _randn(B, 3, 16, 16, seed=40 + step)
        for m, call in ((model, mapped), (ref, ref)):
            m.zero_grad()
            call(x).logits.square().mean().backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
    _same_state(model, ref, "resnet")
    return True


@pytest.mark.parametrize("P", [1, 3])
def test_transformers_resnet(worlds, P):
    assert worlds(P).run(check_resnet, 5) == [True] * P


# ---------------------------------------------------------------------------------------------- one value per channel
def check_one_value(B):
    """One value per channel in the whole batch: torch's error, on every rank, at every P."""
    bn = nn.BatchNorm1d(3).train()
    with pytest.raises(ValueError) as caught:
        cm.cmap(bn, mode="batched")(torch.randn(B, 3))
    assert isinstance(caught.value, CmapError)
    return caught.value.failures[0].message


@pytest.mark.parametrize("P", [1, 2, 3])
def test_one_value_per_channel_raises_torchs_error(worlds, P):
    with pytest.raises(ValueError) as caught:
        nn.BatchNorm1d(3).train()(torch.randn(1, 3))
    assert worlds(P).run(check_one_value, 1) == [str(caught.value)] * P


# ----------------------------------------------------------------------------------------------------- eval mode
def check_collectives():
    """Per call, the collectives besides the call's own: none in eval mode; per BatchNorm in training mode, one in
    forward and one in backward."""
    x = _randn(6, 3, seed=3).requires_grad_()
    plain = cm.cmap(lambda v: v * 2, mode="batched")
    bn = _affine(nn.BatchNorm1d(3).double(), 4)
    ref = copy.deepcopy(bn).eval()
    counts = {}
    for name, fn in [("plain", plain), ("eval", cm.cmap(bn.eval(), mode="batched"))]:
        fn(x)  # the fast path's cache filled
        with wire_tap.counting() as log:
            out = fn(x)
        counts[name] = log.count
    assert_same(out, ref(x), exact=True, what="eval mode")  # elementwise: each rank's rows alone, bit for bit
    bn.train()
    for name, fn in [("plain", plain), ("train", cm.cmap(bn, mode="batched"))]:
        fn(x)
        with wire_tap.counting() as log:
            out = fn(x)
        counts[name + " forward"] = log.count
        with wire_tap.counting() as log:
            out.sum().backward()
        counts[name + " backward"] = log.count
    return counts


@pytest.mark.parametrize("P", [2, 3])
def test_eval_mode_adds_no_collective(worlds, P):
    for counts in worlds(P).run(check_collectives):
        assert counts["eval"] == counts["plain"], counts
        assert counts["train forward"] == counts["plain forward"] + 1, counts
        assert counts["train backward"] == counts["plain backward"] + 1, counts


# -------------------------------------------------------------------------------------------- a failure on one rank
def check_failure_before_the_statistics():
    """A rank that fails before its BatchNorm leaves no peer waiting in the statistics' collective: every rank
    raises the failure, and the next call runs."""
    bn = nn.BatchNorm1d(3).double().train()

    def f(v):
        if dist.get_rank() == 1:
            raise KeyError("no such layer")
        return bn(v)

    with pytest.raises(CmapError) as caught:
        cm.cmap(f, mode="batched")(_randn(6, 3, seed=15))
    assert "group rank 1" in str(caught.value) and "no such layer" in str(caught.value), caught.value
    ref = copy.deepcopy(bn)
    x = _randn(6, 3, seed=16)
    torch.testing.assert_close(cm.cmap(bn, mode="batched")(x), ref(x), **TIGHT)
    return True


@pytest.mark.parametrize("P", [2, 3])
def test_failure_before_the_statistics_reaches_every_rank(worlds, P):
    assert worlds(P).run(check_failure_before_the_statistics) == [True] * P


# --------------------------------------------------------------------------------------- what is refused, alike at P
def refusal(mode, **options):
    """The message a training BatchNorm meets under ``mode`` (and ``options``)."""
    bn = nn.BatchNorm1d(3).train()
    x = torch.randn(4, 2, 3) if mode in ("vmap", "loop") else torch.randn(4, 3)
    with pytest.raises(Exception) as caught:
        cm.cmap(bn, mode=mode, **options)(x)
    exc = caught.value
    if isinstance(exc, CmapError):
        return exc.failures[0].exc_type, exc.failures[0].message
    return type(exc).__name__, str(exc)


def check_refusals():
    sync = nn.SyncBatchNorm(3).train()
    with pytest.raises(ValueError) as caught:
        cm.cmap(sync, mode="batched")(torch.randn(4, 3))
    return {
        "vmap": refusal("vmap"),
        "loop": refusal("loop"),
        "chunks": refusal("batched", chunk_size=2),
        "per_example": refusal("batched", randomness="per_example"),
        "sync": caught.value.failures[0].message,
    }


def test_refusals_are_the_same_at_every_P(worlds):
    alone = {
        "vmap": refusal("vmap"),
        "loop": refusal("loop"),
        "chunks": refusal("batched", chunk_size=2),
        "per_example": refusal("batched", randomness="per_example"),
    }  # no torch.distributed in this process
    found = [worlds(P).run(check_refusals) for P in (1, 2, 3)]
    for per_rank in found:
        assert per_rank == [found[0][0]] * len(per_rank)
    first = found[0][0]
    assert {k: first[k] for k in alone} == alone
    kind, vmap = first["vmap"]
    assert kind == "RuntimeError" and vmap.startswith("Batch norm got a batched tensor"), vmap  # torch's, kept
    assert "mode='batched'" in vmap and "torch.func.replace_all_batch_norm_modules_" in vmap, vmap
    assert "mode='batched'" in first["loop"][1], first["loop"]
    assert "chunk_size=None" in first["chunks"][1] and "another randomness" in first["per_example"][1], first
    assert "SyncBatchNorm" in first["sync"] and "BatchNorm1d/2d/3d" in first["sync"], first["sync"]


# -------------------------------------------------------------------------------------------------- torch.compile
def check_compiled(B):
    """``torch.compile(cmap(model, mode="batched"))``: a training BatchNorm runs eagerly (a graph break), over the
    whole batch, here where nothing else sends the call out of the graph (no gradient is taken)."""
    bn = _affine(nn.BatchNorm1d(3).double(), 9)
    ref = copy.deepcopy(bn)
    x = _randn(B, 3, seed=11) * 2 - 1
    with torch.no_grad():
        got = torch.compile(cm.cmap(bn, mode="batched"), backend="aot_eager")(x)
        want = ref(x)
    torch.testing.assert_close(got, want, **TIGHT)
    _same_state(bn, ref, "compiled")
    return True


@pytest.mark.parametrize("P", [1, 2])
def test_compiled_batchnorm_sees_the_whole_batch(worlds, P):
    assert worlds(P).run(check_compiled, 5) == [True] * P
