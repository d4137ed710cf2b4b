"""Real models through cmap, called the way their users call them: tiny transformers models (BERT, GPT-2, Llama,
Qwen2) built from configs, at P = 1, 2 and 3, against the same model in one process on the same inputs.

- data-parallel inference with ``mode="batched"``: the ``ModelOutput`` comes back whole, every field gathered;
- per-example gradients: ``torch.func.grad`` of a ``functional_call`` under cmap (the default ``mode="vmap"``);
- data-parallel training with a real optimizer, ``dst=-1`` (the loss over the gathered logits) and ``dst="local"``
  (each rank's loss over its own rows; the ranks' gradients are one global loss's).

Keyword batches, BatchNorm, gradient checkpointing and generation have files of their own (``test_keywords.py``,
``test_batchnorm.py``, ``test_checkpointing.py``, ``test_real_model_errors.py``).

The models run in float64 with dropout off: a share's rows go through the same kernels as the whole batch's, but a
matmul over fewer rows may block its sums differently, which moves a result by a few ulps of its terms' magnitude;
float64 keeps that far under the tolerances below, which then catch any real difference (a wrong row, a gradient
counted twice or P times).
"""

from typing import Callable, Dict, Tuple

import pytest
import torch
from torch import nn

import colossalai_cmap as cm

DEADLINE = 180
pytestmark = pytest.mark.timeout(600)
VOCAB, SEQ = 61, 6
TOL = dict(atol=1e-10, rtol=1e-9)
KINDS = ("bert", "gpt2", "llama", "qwen2")


def tiny(kind: str, seed: int = 0) -> nn.Module:
    """A two-layer transformers model from a config, no download, float64, dropout off."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4)
    if kind == "bert":
        config = tf.BertConfig(
            hidden_size=32, intermediate_size=48, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common
        )
        model_cls = tf.BertForMaskedLM
    elif kind == "gpt2":
        config = tf.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
        )
        model_cls = tf.GPT2LMHeadModel
    else:
        config_cls, model_cls = (
            (tf.LlamaConfig, tf.LlamaForCausalLM) if kind == "llama" else (tf.Qwen2Config, tf.Qwen2ForCausalLM)
        )
        config = config_cls(hidden_size=32, intermediate_size=48, num_key_value_heads=2, **common)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return model_cls(config).to(torch.float64).eval()


def token_batch(batch: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g)


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction=reduction)


# ------------------------------------------------------------------------------------------------ the rank checks
def check_inference(kind: str, batch: int) -> bool:
    """``cmap(model, mode="batched")(ids)`` is ``model(ids)``: the same ModelOutput type, every field."""
    model = tiny(kind)
    ids, _ = token_batch(batch, seed=1)
    with torch.no_grad():
        expected = model(ids)
        got = cm.cmap(model, mode="batched")(ids)
    assert type(got) is type(expected), (type(got), type(expected))
    assert list(got.keys()) == list(expected.keys()), (list(got.keys()), list(expected.keys()))
    torch.testing.assert_close(got.logits, expected.logits, **TOL)
    if getattr(expected, "past_key_values", None) is not None:  # the cache, gathered along its batch dim
        got_cache, expected_cache = cache_tensors(got.past_key_values), cache_tensors(expected.past_key_values)
        assert len(got_cache) == len(expected_cache)
        for a, b in zip(got_cache, expected_cache):
            torch.testing.assert_close(a, b, **TOL)
    return True


def cache_tensors(cache) -> list:
    from torch.utils._pytree import tree_flatten

    if hasattr(cache, "to_legacy_cache"):
        cache = cache.to_legacy_cache()
    return [t for t in tree_flatten(cache)[0] if isinstance(t, torch.Tensor)]


def check_per_example_grads(kind: str, batch: int) -> bool:
    """Per-example gradients of every parameter, as ``torch.vmap(torch.func.grad(...))`` gives them in one process."""
    from torch.func import functional_call, grad

    model = tiny(kind)
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids, labels = token_batch(batch, seed=2)

    def loss(p: Dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return next_token_loss(functional_call(model, p, (x.unsqueeze(0),)).logits[0], y)

    expected = torch.vmap(grad(loss), in_dims=(None, 0, 0))(params, ids, labels)
    got = cm.cmap(grad(loss), in_dims=(None, 0, 0))(params, ids, labels)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **TOL, msg=lambda m: f"{name}: {m}")
    return True


def train(model: nn.Module, step: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor], batch: int) -> list:
    """Three SGD-with-momentum steps on three batches; returns the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    losses = []
    for seed in range(3):
        ids, labels = token_batch(batch, seed=10 + seed)
        opt.zero_grad()
        loss = step(model, ids, labels)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def whole_batch_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return next_token_loss(model(ids).logits, labels)


def gathered_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """dst=-1: every rank gets the whole batch's logits, and the loss is the single process's."""
    return next_token_loss(cm.cmap(model, mode="batched")(ids).logits, labels)


def local_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """dst="local": each rank's loss over its own rows, scaled by the global count, so the ranks' losses sum to the
    single process's mean and their gradients are its gradient."""

    def row_losses(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return next_token_loss(model(x).logits, y, reduction="none").view(len(x), -1).sum(1)

    return cm.cmap(row_losses, mode="batched", dst="local")(ids, labels).sum() / labels.numel()


def check_training(kind: str, batch: int, dst: str) -> bool:
    """Weights after three steps equal the single process's; with dst=-1 the losses too."""
    ref, model = tiny(kind), tiny(kind)
    expected = train(ref, whole_batch_step, batch)
    got = train(model, gathered_step if dst == "all" else local_step, batch)
    if dst == "all":
        torch.testing.assert_close(torch.stack(got), torch.stack(expected), **TOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{name}: {m}")
    return True


# ------------------------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("P", [1, 2, 3])
def test_inference_returns_model_outputs_whole(worlds, P):
    for kind in KINDS:
        for batch in (5, 2):  # uneven at P = 2 and 3; fewer rows than ranks at P = 3
            assert worlds(P).run(check_inference, kind, batch, deadline=DEADLINE) == [True] * P, (kind, batch)


@pytest.mark.parametrize("P", [1, 3])
def test_per_example_gradients(worlds, P):
    for kind in ("gpt2", "llama"):
        assert worlds(P).run(check_per_example_grads, kind, 4, deadline=DEADLINE) == [True] * P, kind


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("dst", ["all", "local"])
def test_data_parallel_training(worlds, P, dst):
    for kind in ("bert", "llama"):
        assert worlds(P).run(check_training, kind, 5, dst, deadline=DEADLINE) == [True] * P, kind
