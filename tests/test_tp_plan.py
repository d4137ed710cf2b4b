"""shard_model(model, plan=...): tensor parallelism from a sharding plan, on real gloo worlds of 2, 3 and 4.

The oracle is the unsharded model, built in the same process from the same seed and run on the same inputs: the
sharded model's outputs, loss and gradients must match it (a sharded parameter's gradient is its slice, read from
``sharded_parameters``), and so must an AdamW run. The models run in float64 (cases.F64, the example's TOL): a
row-parallel layer adds its input features' products in per-rank partial sums. The collective counts, which depend
on the bytes a round carries, are read with ``record_collectives`` on the float32 model.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cases import adam_drift_bound, randn
from torch import nn

import colossalai_cmap as cm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from tensor_parallel_llama import (  # noqa: E402  the example's model, plan and inputs
    BATCH,
    PLAN,
    SEQ,
    TOL,
    VOCAB,
    llama,
    param_bytes,
    token_ids,
)

DEADLINE = 120  # seconds per distributed check (the harness kills the world past it)
pytestmark = pytest.mark.timeout(300)


def assert_grads(sharded: nn.Module, full: nn.Module, what: str) -> None:
    """Every parameter's gradient: a sharded one equals its slice of the full gradient, the others all of it."""
    slices, ref = cm.sharded_parameters(sharded), dict(full.named_parameters())
    assert set(dict(sharded.named_parameters())) == set(ref)
    for name, p in sharded.named_parameters():
        expected = slices[name].take(ref[name].grad) if name in slices else ref[name].grad
        torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m: f"{what}: grad of {name}: {m}")


# ---------------------------------------------------------------------------------------- distributed checks
def check_llama():
    """Logits, loss and gradients equal the unsharded model's; five AdamW steps track it; bytes per rank."""
    P = dist.get_world_size()
    ref, tp = llama(), cm.shard_model(llama(), plan=PLAN)
    assert type(tp.model.layers[1].mlp.up_proj).__name__ == "ColumnParallelLinear"
    attn = tp.model.layers[0].self_attn
    assert attn.head_dim == 16 and attn.num_key_value_groups == 1  # what LlamaAttention reads: unchanged
    assert tuple(attn.q_proj.weight.shape) == (64 // P, 64) and tuple(attn.o_proj.weight.shape) == (64, 64 // P)
    with torch.inference_mode():  # evaluation first (greedy decoding with the KV cache), then training below
        prompt = token_ids(2)
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
        greedy = ref.generate(prompt, **kw, output_logits=True, return_dict_in_generate=True)
        # The same tokens only if no step's best logit is within the logits' tolerance of the runner-up (else
        # rounding could pick either): check that margin, then the tokens.
        top2 = torch.stack(greedy.logits).topk(2, dim=-1).values
        margin = float((top2[..., 0] - top2[..., 1]).min())
        assert margin > 2 * (TOL["atol"] + TOL["rtol"] * float(top2.abs().max())), margin
        assert torch.equal(tp.generate(prompt, **kw), greedy.sequences)
    ids = token_ids(1)
    out_ref, out_tp = ref(input_ids=ids, labels=ids), tp(input_ids=ids, labels=ids)
    torch.testing.assert_close(out_tp.logits, out_ref.logits, **TOL)
    torch.testing.assert_close(out_tp.loss, out_ref.loss, **TOL)
    out_ref.loss.backward(), out_tp.loss.backward()
    assert_grads(tp, ref, f"llama TP={P}")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_tp = torch.optim.AdamW(tp.parameters(), lr=1e-3)
    for step in range(5):
        ids = token_ids(10 + step)
        for model, opt in ((ref, opt_ref), (tp, opt_tp)):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            model.last = loss.detach()
        torch.testing.assert_close(tp.last, ref.last, **TOL, msg=lambda m: f"AdamW step {step}: loss: {m}")
    # The parameters: within what five AdamW updates can move an entry whose tiny gradient rounds differently.
    drift = dict(rtol=TOL["rtol"], atol=TOL["atol"] + adam_drift_bound(1e-3, (0.9, 0.999), 5))
    slices, full = cm.sharded_parameters(tp), dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        expected = slices[name].take(full[name]) if name in slices else full[name]
        torch.testing.assert_close(p, expected, **drift, msg=lambda m: f"after 5 AdamW steps: {name}: {m}")
    return param_bytes(tp), param_bytes(ref)


def _ops(log) -> list:
    return [op for op, _ in log.entries]


def check_llama_counts():
    """The collectives of one decoder layer and of a whole training step, in steady state (after a warm-up)."""
    tp = cm.shard_model(llama(dtype=torch.float32), plan=PLAN)  # the counts below are for float32 payloads
    layer, hidden = tp.model.layers[0], randn(BATCH, SEQ, 64, seed=3).requires_grad_()
    position = tp.model.rotary_emb(hidden, torch.arange(SEQ).expand(BATCH, SEQ))
    found = {}
    for _ in range(2):  # the first call sizes the rounds' payload; the second is the steady state
        with cm.record_collectives() as fwd:
            out = layer(hidden, position_embeddings=position)[0]
        with cm.record_collectives() as bwd:
            out.sum().backward()
        found["layer"] = (_ops(fwd), _ops(bwd))
    ids = token_ids(2)
    for _ in range(3):
        with cm.record_collectives() as fwd:
            loss = tp(input_ids=ids, labels=ids).loss
        with cm.record_collectives() as bwd:
            loss.backward()
        found["step"] = (_ops(fwd), _ops(bwd), fwd.bytes, bwd.bytes)
    with torch.no_grad(), cm.record_collectives() as inference:
        tp(input_ids=ids)
    found["inference"] = _ops(inference)
    return found


def check_checkpoint():
    """full_state_dict on every rank and on one; load_full_state_dict into a model sharded from other weights."""
    rank = dist.get_rank()
    ref, tp = llama(), cm.shard_model(llama(), plan=PLAN)
    expected = ref.state_dict()
    full = cm.full_state_dict(tp)
    assert list(full) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    on_one = cm.full_state_dict(tp, dst=1)
    assert (on_one is None) == (rank != 1)
    if on_one is not None:
        assert all(torch.equal(on_one[n], v) for n, v in expected.items())
    other = cm.shard_model(llama(seed=7), plan=PLAN)
    result = cm.load_full_state_dict(other, full)
    assert not result.missing_keys and not result.unexpected_keys
    ids = token_ids(4)
    torch.testing.assert_close(other(input_ids=ids).logits, ref(input_ids=ids).logits, **TOL)
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(10, 64\), but the sharded parameter"):
        cm.load_full_state_dict(other, {**full, "lm_head.weight": torch.zeros(10, 64)})
    return True


class HeadsAttention(nn.Module):
    """Attention that keeps its head count as an attribute and reshapes by it (as many models do)."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, width = heads, head_dim, heads * head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        def split(t):
            return t.view(*x.shape[:-1], self.num_heads, self.head_dim).transpose(-2, -3)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        attn = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim**0.5, -1) @ v
        return self.o(attn.transpose(-2, -3).reshape(*x.shape[:-1], self.num_heads * self.head_dim))


def _parity(sharded: nn.Module, full: nn.Module, x: torch.Tensor, what: str) -> None:
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, ref = sharded(xs), full(xr)
    torch.testing.assert_close(got, ref, **TOL, msg=lambda m: f"{what}: forward: {m}")
    weights = randn(*ref.shape, seed=ref.numel(), dtype=ref.dtype)
    (got.sin() * weights).sum().backward(), (ref.sin() * weights).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, **TOL, msg=lambda m: f"{what}: input grad: {m}")
    assert_grads(sharded, full, what)


def uneven_model(seed: int) -> nn.Module:
    """An MLP whose intermediate size (13) does not divide by 3, then a 3-head attention block (head_dim 4); float64."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 13), nn.GELU(), nn.Linear(13, 12), HeadsAttention(3, 4)).double()


MLP_PLAN = {"0": "colwise", "2": "rowwise"}
UNEVEN_PLAN = {**MLP_PLAN, "3.[qkv]": "colwise", "3.o": "rowwise"}
ALL_STYLES_PLAN = {
    "0": "vocab",
    "1": "colwise",
    "3": "rowwise",
    "4.[qkv]": "colwise",
    "4.o": "rowwise",
    "5": "colwise_gather",
}


def all_styles_model(seed: int) -> nn.Module:
    """Every style: a vocabulary of 13 (a padding row), an MLP 12 -> 13 -> 12, 6 heads of 2, a gathered head."""
    torch.manual_seed(seed)
    layers = [nn.Embedding(13, 12, padding_idx=6), nn.Linear(12, 13), nn.GELU(), nn.Linear(13, 12)]
    return nn.Sequential(*layers, HeadsAttention(6, 2), nn.Linear(12, 7))


def as_objects(plan: dict) -> dict:
    """The same plan with the style objects in place of their shorthand strings."""
    objects = {
        "colwise": cm.Colwise(),
        "rowwise": cm.Rowwise(),
        "colwise_gather": cm.ColwiseGather(),
        "vocab": cm.Vocab(),
    }
    return {pattern: objects[style] for pattern, style in plan.items()}


def check_uneven_mlp():
    """TP 3: the MLP's 13 features split 5/4/4; the attention keeps one whole head per rank (num_heads patched)."""
    rank = dist.get_rank()
    full, sharded = uneven_model(0), cm.shard_model(uneven_model(0), plan=UNEVEN_PLAN)
    assert tuple(sharded[0].weight.shape) == ((5, 4, 4)[rank], 12) and sharded[3].num_heads == 1
    for batch in (1, 4):
        _parity(sharded, full, randn(batch, 5, 12, seed=batch, dtype=torch.float64), f"uneven MLP B={batch}")
        full.zero_grad(), sharded.zero_grad()
    torch.manual_seed(1)  # 13 vocabulary rows over 3 ranks (5/4/4), with a padding row on rank 1
    table, vocab = nn.Embedding(13, 6, padding_idx=6), nn.Embedding(13, 6, padding_idx=6)
    vocab.load_state_dict(table.state_dict())
    vocab = cm.shard_model(nn.Sequential(vocab), plan={"0": "vocab"})
    ids = torch.tensor([[0, 4, 5, 6, 12], [6, 9, 1, 12, 3]])
    got, ref = vocab(ids), table(ids)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)  # a row, plus zeros from the other ranks: exact
    (got * randn(2, 5, 6, seed=2)).sum().backward(), (ref * randn(2, 5, 6, seed=2)).sum().backward()
    piece = cm.sharded_parameters(vocab)["0.weight"]
    # each row's gradient adds its id's occurrences (at most two here, which add alike in either order), plus zeros
    torch.testing.assert_close(vocab[0].weight.grad, piece.take(table.weight.grad), atol=0, rtol=0)
    return param_bytes(sharded)


def check_styles_match_shorthands():
    """A plan of style objects and the same plan of strings: the same layers, bits, gradients and collectives.

    Each model gets a fresh group, so that both start from the same payload size (it adapts per group).
    """
    P, ids = dist.get_world_size(), torch.tensor([[0, 4, 5, 6, 12], [6, 9, 1, 12, 3]])
    runs = []
    for plan in (ALL_STYLES_PLAN, as_objects(ALL_STYLES_PLAN)):
        model = cm.shard_model(all_styles_model(4), group=dist.new_group(list(range(P))), plan=plan)
        outs, logs = [], []
        for step in range(3):
            with cm.record_collectives() as fwd:
                out = model(ids)
            with cm.record_collectives() as bwd:
                (out.sin() * randn(*out.shape, seed=step)).sum().backward()
            outs.append(out.detach())
            logs.append((fwd.entries, bwd.entries))
        runs.append((repr(model), outs, {n: p.grad for n, p in model.named_parameters()}, logs))
    (text, outs, grads, logs), (text_o, outs_o, grads_o, logs_o) = runs
    assert "style=ColwiseGather()" in text and text == text_o
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_o))
    assert grads.keys() == grads_o.keys() and all(torch.equal(g, grads_o[n]) for n, g in grads.items())
    assert logs == logs_o and logs[-1][0] and logs[-1][1]
    return [len(fwd) + len(bwd) for fwd, bwd in logs]


def check_large_activation_counts():
    """A sum of any size is one all_reduce, forward and backward, with no status round, as in Megatron."""
    torch.manual_seed(0)
    sharded = cm.shard_model(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 64)), plan=MLP_PLAN)
    x = randn(4200, 64, seed=1).requires_grad_()  # 4200 x 64 float32 = 1.03 MiB
    found = []
    for _ in range(2):
        with cm.record_collectives() as fwd:
            out = sharded(x)
        with cm.record_collectives() as bwd:
            out.square().sum().backward()
        found.append((_ops(fwd), _ops(bwd)))
    return found


def check_inputs_differ():
    """check_inputs=True, both forms: ranks that pass different inputs raise the same CmapError; equal inputs pass."""
    rank = dist.get_rank()
    model = cm.shard_model(uneven_model(1), plan=MLP_PLAN, check_inputs=True)
    x = randn(2, 12, seed=5, dtype=torch.float64)
    model(x)
    with pytest.raises(cm.CmapError, match=r"check_inputs=True: the inputs of Sequential differ across the ranks"):
        model(x + rank)
    model(x)  # the group is still in step
    traced = cm.shard_linears_fx(
        nn.Linear(12, 5).double(), check_inputs=True
    )  # the torch.fx form: cmap's own input check
    traced(x)
    with pytest.raises(cm.CmapError, match="in_dims=None inputs"):
        traced(x + rank)
    return True


def plan_errors():
    """Every plan error, each raised before any module is replaced; returns the messages (equal on every rank)."""
    cases = [
        ({"0": "diagonal"}, r"plan pattern '0' has unknown style 'diagonal'; expected one of colwise, rowwise"),
        ({"0": "colwise", "9": "rowwise"}, r"plan pattern '9' matches no module of Sequential"),
        ({"1": "colwise"}, r"gives style 'colwise' to module '1', a GELU; 'colwise' shards an nn.Linear"),
        ({"0": "vocab"}, r"gives style 'vocab' to module '0', a Linear; 'vocab' shards an nn.Embedding"),
        ({"0": "colwise", "[0]": "rowwise"}, r"module '0' is matched by plan pattern '0' as 'colwise' and by '\[0\]'"),
        ({"1": cm.Colwise()}, r"plan pattern '1' gives style 'colwise' to module '1', a GELU; 'colwise' shards an nn"),
        ({"3.q": cm.Vocab()}, r"gives style 'vocab' to module '3.q', a Linear; 'vocab' shards an nn.Embedding"),
        ({"3": cm.ColwiseGather()}, r"style 'colwise_gather' to module '3', a HeadsAttention; 'colwise_gather' shards"),
        ({"[02]": cm.Rowwise(), "2": "colwise"}, r"module '2' is matched by plan pattern '\[02\]' as 'rowwise' and by"),
        ({"0": cm.Colwise}, r"unknown style <class .*Colwise'>; .* or a style object: Colwise\(\), Rowwise\(\)"),
        ({}, r"plan must be a non-empty mapping"),
        ({"3.[qk]": "colwise", "3.o": "rowwise"}, None),  # fine at TP 3: one whole head per rank
        ({"0": cm.Colwise(), "[0]": "colwise"}, None),  # one style, as an object and by its shorthand
    ]
    messages = []
    for plan, pattern in cases:
        model = uneven_model(2)
        before = {n: p.clone() for n, p in model.named_parameters()}
        if pattern is None:
            cm.shard_model(model, plan=plan)
            continue
        with pytest.raises(ValueError, match=pattern) as info:
            cm.shard_model(model, plan=plan)
        assert all(type(m) in (nn.Linear, nn.GELU, nn.Sequential, HeadsAttention) for m in model.modules())
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        messages.append(str(info.value))
    four_heads = llama()  # 4 heads of 16 over 3 ranks: 22/21/21 features
    with pytest.raises(ValueError, match=r"splits attention projection 'model.layers.0.self_attn.q_proj' \(64 output"):
        cm.shard_model(four_heads, plan=PLAN)
    tied = nn.Sequential(nn.Embedding(12, 4), nn.Linear(4, 12, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match=r"parameter '1.weight' of module '1' is tied to \['0.weight', '1.weight'\]"):
        cm.shard_model(tied, plan={"1": "colwise_gather"})
    with pytest.raises(ValueError, match="uses max_norm or scale_grad_by_freq"):
        cm.shard_model(nn.Sequential(nn.Embedding(12, 4, max_norm=1.0)), plan={"0": "vocab"})
    with pytest.raises(ValueError, match=r"module '0', a Custom with its own forward; 'colwise' replaces a plain"):
        cm.shard_model(nn.Sequential(type("Custom", (nn.Linear,), {"forward": torch.sin})(2, 2)), plan={"0": "colwise"})
    no_plan = r"pass the plan as plan=\{module-name pattern: style\}.* use the torch.fx form, shard_linears_fx\(model"
    for call in (lambda m: cm.shard_model(m), lambda m: cm.shard_model(m, MLP_PLAN)):  # no plan=; a plan as group
        model = uneven_model(2)
        with pytest.raises(TypeError, match=no_plan) as info:
            call(model)
        assert all(type(m) in (nn.Linear, nn.GELU, nn.Sequential, HeadsAttention) for m in model.modules())
        messages.append(str(info.value))
    assert "(the second positional argument is the group)" in messages[-1]
    return messages


def check_2d():
    """Data parallel with cmap over mesh axis 0 around a model tensor-parallel over axis 1 (a 2 x 2 mesh)."""
    from colossalai.cluster import ProcessGroupMesh

    mesh = ProcessGroupMesh(2, 2)
    ref, tp = llama(), cm.shard_model(llama(), group=(mesh, 1), plan=PLAN)
    ids = token_ids(6, batch=4)

    def per_example_loss(model, batch):
        logits = model(input_ids=batch).logits[:, :-1]
        losses = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1), reduction="none")
        return losses.view(len(batch), -1).mean(1)

    losses = cm.cmap(lambda batch: per_example_loss(tp, batch), group=(mesh, 0), mode="batched")(ids)
    expected = per_example_loss(ref, ids)
    torch.testing.assert_close(losses, expected, **TOL)
    losses.mean().backward(), expected.mean().backward()
    assert_grads(tp, ref, "2-D data x tensor parallel")
    return [s.rank for s in cm.sharded_parameters(tp).values()][0]


# ------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("P", [2, 4])
def test_llama_plan(worlds, P):
    got = worlds(P).run(check_llama, deadline=DEADLINE)
    mine, full = got[0]
    assert full == 8 * 222528 and mine == (full - 8 * 320) // P + 8 * 320  # float64; the norms' 320 are replicated
    assert len(set(got)) == 1


@pytest.mark.parametrize("P", [2, 4])
def test_llama_collective_counts(worlds, P):
    """One decoder layer: 2 rounds forward (the attention and MLP sums), 2 backward (the sums of their inputs'
    gradients, q/k/v and gate/up sharing one each); each sum of 4 KiB rides in its round, one all_gather.

    A training step: forward 6 rounds (embedding sum, 2 per layer, the LM head's gather) and backward 5 (the LM
    head's input gradient, 2 per layer). The LM head's logits (BATCH * SEQ * VOCAB / P floats per rank) outgrow
    the round's small payload, so the first three steps gather them in a second all_gather after the round; by then
    the group has seen an LM-head round follow an LM-head round twice, so the next one (the inference forward) is
    sized for the logits and carries them: 5 sums and that one round.
    """
    for found in worlds(P).run(check_llama_counts, deadline=DEADLINE):
        assert found["layer"] == (["all_reduce"] * 2, ["all_reduce"] * 2)  # Megatron's count, and its collective
        fwd, bwd, fwd_bytes, bwd_bytes = found["step"]
        # the embedding's sum, 2 per layer, then the LM head's gather: a round and the logits' all_gather
        assert fwd == ["all_reduce"] * 5 + ["all_gather"] * 2 and bwd == ["all_reduce"] * 5
        assert found["inference"] == ["all_reduce"] * 5 + ["all_gather"]


@pytest.mark.parametrize("P", [2, 4])
def test_checkpoint_round_trip(worlds, P):
    assert worlds(P).run(check_checkpoint, deadline=DEADLINE) == [True] * P


def test_uneven_mlp_and_heads_at_tp3(worlds):
    got = worlds(3).run(check_uneven_mlp, deadline=DEADLINE)
    assert got[0] > got[1] == got[2]  # rank 0 holds 5 of the 13 intermediate features, the others 4


def test_plan_errors_on_every_rank(worlds):
    messages = worlds(3).run(plan_errors, deadline=DEADLINE)
    assert messages[0] == messages[1] == messages[2] and all(m.startswith("shard_model: ") for m in messages[0])


@pytest.mark.parametrize("P", [2, 3])
def test_style_objects_match_shorthands(worlds, P):
    counts = worlds(P).run(check_styles_match_shorthands, deadline=DEADLINE)
    assert len(set(map(tuple, counts))) == 1  # every rank made the same collectives


def test_large_activation_counts(worlds):
    for steps in worlds(2).run(check_large_activation_counts, deadline=DEADLINE):
        assert steps[-1] == (["all_reduce"], ["all_reduce"])


def test_check_inputs(worlds):
    assert worlds(2).run(check_inputs_differ, deadline=DEADLINE) == [True, True]


def test_data_and_tensor_parallel_on_a_2x2_mesh(worlds):
    assert worlds(4).run(check_2d, deadline=DEADLINE) == [0, 1, 0, 1]  # group rank on the tensor-parallel axis


def test_single_process():
    """Without torch.distributed the group is this process alone: every shard is the whole tensor."""
    full, sharded = uneven_model(3), cm.shard_model(uneven_model(3), plan=UNEVEN_PLAN)
    _parity(sharded, full, randn(3, 12, seed=1, dtype=torch.float64), "single process")
    assert cm.full_state_dict(sharded).keys() == full.state_dict().keys()
