"""A loss averaged over the batch (``reduction="mean"``) under ``cmap(..., mode="batched")`` is the mean over the
whole batch, as in one process: ``cmap(model, mode="batched", kwarg_dims=0)(..., labels=labels).loss`` is
``model(..., labels=labels).loss`` at P = 1, 2 and 3 (uneven batches, an empty share), and a model trained on it ends
where the model trained alone ends. Any other 0-dim output with an int out_dims is refused alike at every P.

float64 throughout: the mean adds each rank's sum, then divides (torch divides once), a few roundings apart."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_keywords import padded_batch
from test_real_models import VOCAB, tiny
from torch import nn

import colossalai_cmap as cm

CLOSE = {"rtol": 1e-10, "atol": 1e-10}
# transformers takes its labels= loss in float32 (``logits.float()``): a mean of ~30 token losses near 4 whose sum is
# added per rank, then over the ranks, is a few float32 roundings (6e-8 each) from torch's; SGD carries gradients
# that far apart through three steps of lr 0.1 into weights near 0.02.
FLOAT32_LOSS = {"rtol": 1e-5, "atol": 1e-6}


def _labels(ids, mask):
    """Next-token labels with the padding and every third position of row 0 ignored (-100)."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, ::3] = -100
    return labels


def check_models(B):
    """GPT-2 and Llama with ``labels=``: the loss and logits of the whole batch, and three SGD-with-momentum steps on
    ``out.loss.backward()`` give the single process's weights."""
    ids, mask = padded_batch(B)
    labels = _labels(ids, mask)
    for kind in ("gpt2", "llama"):
        got, want = tiny(kind), tiny(kind)
        mapped = cm.cmap(got, mode="batched", kwarg_dims=0)
        opt_got, opt_want = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (got, want))
        for step in range(3):
            out = mapped(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
            ref = want(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
            what = f"{kind} step {step}"
            torch.testing.assert_close(out.loss, ref.loss, **FLOAT32_LOSS, msg=lambda m: f"{what} loss: {m}")
            torch.testing.assert_close(out.logits, ref.logits, **FLOAT32_LOSS)  # the weights moved alike
            assert out.loss.shape == () and out.loss.requires_grad
            out.loss.backward()
            ref.loss.backward()
            opt_got.step(), opt_want.step()
            opt_got.zero_grad(), opt_want.zero_grad()
        for (n, p), q in zip(got.named_parameters(), want.parameters()):
            torch.testing.assert_close(p, q, **FLOAT32_LOSS, msg=lambda m: f"{kind} {n}: {m}")
    return True


@pytest.mark.parametrize("P", [1, 2, 3])
def test_models_loss_and_training(worlds, P):
    assert worlds(P).run(check_models, 5, deadline=600) == [True] * P


def test_models_empty_share(worlds):
    assert worlds(3).run(check_models, 2, deadline=600) == [True] * 3  # B < P: a share of none


def _loss_cases():
    """(name, func(x, y) of a batch, targets of a batch of B) for each loss mode="batched" takes over the batch."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).double()
    weight = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    classes = lambda B: torch.tensor([k % 3 if k % 4 != 1 else -100 for k in range(B)])  # noqa: E731
    seq = lambda B: torch.arange(B * 5).remainder(4).sub(1).view(B, 5)  # (B, 5): -1 ignored
    probabilities = lambda B: torch.randn(  # noqa: E731
        B, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2)
    ).softmax(-1)
    return lin, [
        ("cross_entropy", lambda x, y: F.cross_entropy(lin(x), y), classes),
        ("cross_entropy weight", lambda x, y: F.cross_entropy(lin(x), y, weight=weight), classes),
        ("label_smoothing", lambda x, y: F.cross_entropy(lin(x), y, weight=weight, label_smoothing=0.2), classes),
        ("nn.CrossEntropyLoss", lambda x, y: nn.CrossEntropyLoss(ignore_index=2)(lin(x), y.clamp_min(0)), classes),
        ("nll_loss", lambda x, y: F.nll_loss(lin(x).log_softmax(-1), y, weight=weight), classes),
        ("probabilities", lambda x, y: F.cross_entropy(lin(x), y, label_smoothing=0.1), probabilities),
        ("sequence", lambda x, y: F.cross_entropy(lin(x).unsqueeze(-1).expand(-1, -1, 5), y, ignore_index=-1), seq),
        ("mse_loss", lambda x, y: F.mse_loss(lin(x), y.double().unsqueeze(-1).expand(-1, 3)), classes),
        ("l1_loss", lambda x, y: F.l1_loss(lin(x)[:, 0], y.double()), classes),
        (
            "bce",
            lambda x, y: F.binary_cross_entropy(lin(x).sigmoid(), (y > 0).double().unsqueeze(-1).expand(-1, 3)),
            classes,
        ),
        ("bce_with_logits", lambda x, y: F.binary_cross_entropy_with_logits(lin(x)[:, 1], (y > 0).double()), classes),
    ]


def check_plain_losses(B):
    """Each loss inside a batched func, with the gradients of its input and of a module's parameters; with
    dst="local" too, where every rank's loss counts 1/P of the one global loss."""
    lin, cases = _loss_cases()
    x = torch.randn(B, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for (name, func, targets), dst in [(c, -1) for c in cases] + [(cases[1], "local")]:
        y = targets(B)
        xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        got = cm.cmap(func, mode="batched", dst=dst)(xs, y)
        grads = torch.autograd.grad(got, [xs, lin.weight])
        want = func(xr, y)
        torch.testing.assert_close(got, want, **CLOSE, msg=lambda m: f"{name}: {m}")
        for g, w in zip(grads, torch.autograd.grad(want, [xr, lin.weight])):
            torch.testing.assert_close(g, w, **CLOSE, msg=lambda m: f"{name} gradient: {m}")
    return True


@pytest.mark.parametrize("P", [1, 2, 3])
def test_plain_losses(worlds, P):
    assert worlds(P).run(check_plain_losses, 5, deadline=300) == [True] * P
    assert worlds(P).run(check_plain_losses, 2, deadline=300) == [True] * P


def check_other_scalars_refused():
    """A 0-dim output the mode did not make (a loss scaled after it, a sum-reduced loss, the logits' mean): refused
    with the same message at every P. The messages, for comparing across P."""
    ids, mask = padded_batch()
    model = tiny("gpt2")
    lin = nn.Linear(4, 3).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.arange(5) % 3
    calls = [
        lambda: cm.cmap(lambda a, b: F.cross_entropy(lin(a), b) * 2, mode="batched")(x, y),
        lambda: cm.cmap(lambda a, b: F.cross_entropy(lin(a), b, reduction="sum"), mode="batched")(x, y),
        lambda: cm.cmap(lambda **kw: model(**kw).logits.mean(), mode="batched", kwarg_dims=0)(
            input_ids=ids, attention_mask=mask
        ),
    ]
    texts = []
    for call in calls:
        with pytest.raises(cm.CmapError, match=r"output 0 is a scalar") as info:
            call()
        texts.append(str(info.value).split("raised IndexError: ")[1].splitlines()[0])
    return texts


def test_other_scalars_refused_alike_at_every_P(worlds):
    texts = {P: worlds(P).run(check_other_scalars_refused, deadline=300) for P in (1, 2, 3)}
    assert len({tuple(t) for ranks in texts.values() for t in ranks}) == 1, texts


def check_collectives():
    """The collectives of a batched call of a linear layer, forward and backward, without and with a loss."""
    lin = nn.Linear(4, 3).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.arange(6) % 3
    counts = []
    for func in (lambda a, b: lin(a) * b.unsqueeze(-1), lambda a, b: F.cross_entropy(lin(a), b)):
        with cm.record_collectives() as forward:
            out = cm.cmap(func, mode="batched")(x, y)
        with cm.record_collectives() as backward:
            out.sum().backward()
        counts += [forward.count, backward.count]
    return counts


@pytest.mark.parametrize("P", [1, 2, 3])
def test_one_collective_per_loss_each_way(worlds, P):
    """Nothing at P = 1; across ranks one more collective than the call without the loss, in forward and in
    backward."""
    for plain_fwd, plain_bwd, loss_fwd, loss_bwd in worlds(P).run(check_collectives, deadline=120):
        if P == 1:
            assert (plain_fwd, plain_bwd, loss_fwd, loss_bwd) == (0, 0, 0, 0)
        else:
            assert (loss_fwd - plain_fwd, loss_bwd - plain_bwd) == (1, 1), (plain_fwd, plain_bwd, loss_fwd, loss_bwd)
