"""shard_model at LLM scale, on real gloo worlds of 2, 3 and 4: transformers' own plans (``plan="auto"``),
grouped-query attention with fewer key/value heads than ranks, the vocabulary-parallel loss (``loss_parallel``),
and transformers' other styles (``rowwise_rep``, ``local_rowwise`` under ``gather``, ``sequence_parallel``).

The oracle is the unsharded model, built in the same process from the same seed, on the same inputs: logits (a
vocabulary slice of them under loss_parallel), loss, every gradient (a sharded parameter's its slice) and five AdamW
steps. The models run in float64, as in test_tp_plan.py: a row-parallel layer adds partial sums in another order.
The vocabulary (101, prime) divides by no group size.
"""

import pytest
import torch
import torch.distributed as dist
from cases import adam_drift_bound, randn
from torch import nn
from wire_tap import counting

import colossalai_cmap as cm
from colossalai_cmap.tp.styles import TRANSFORMERS_STYLES, RowwiseReplicated

DEADLINE = 120
pytestmark = pytest.mark.timeout(300)
VOCAB, BATCH, SEQ = 101, 2, 7
TOL = dict(atol=1e-7, rtol=1e-7)


def llama(heads: int = 4, kv_heads: int = 2, hidden: int = 64, seed: int = 0, kind: str = "llama") -> nn.Module:
    """A small transformers Llama (or Qwen2, whose q/k/v have biases) from a config: 2 layers; no download."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if kind == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden - 8,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        attn_implementation="eager",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return model_cls(config).to(torch.float64)


def batch(seed: int, seq: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    labels[0, 2] = labels[1, 5] = -100  # ignored, as transformers' collators pad
    return ids, labels


def float64_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kw):
    """transformers' ForCausalLMLoss without its cast of the logits to float32 (which would round the float64
    oracle): labels shifted left, then transformers' own fixed_cross_entropy."""
    from transformers.loss.loss_utils import fixed_cross_entropy

    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat = logits.reshape(-1, vocab_size)
    return fixed_cross_entropy(flat, shift_labels.reshape(-1), num_items_in_batch, ignore_index, **kw)


def vocab_slice(model: nn.Module, full: torch.Tensor) -> torch.Tensor:
    return cm.sharded_parameters(model)["lm_head.weight"].take(full.movedim(-1, 0)).movedim(0, -1)


def compare(tp: nn.Module, ref: nn.Module, loss_parallel: bool, what: str) -> None:
    """Logits, loss, every gradient, then five AdamW steps, against the unsharded model (its loss in float64)."""
    ref.loss_function = float64_loss
    if not loss_parallel:
        tp.loss_function = float64_loss
    ids, labels = batch(1)
    out_ref, out_tp = ref(input_ids=ids, labels=labels), tp(input_ids=ids, labels=labels)
    expected = vocab_slice(tp, out_ref.logits) if loss_parallel else out_ref.logits
    torch.testing.assert_close(out_tp.logits, expected, **TOL, msg=lambda m: f"{what}: logits: {m}")
    torch.testing.assert_close(out_tp.loss, out_ref.loss, **TOL, msg=lambda m: f"{what}: loss: {m}")
    out_ref.loss.backward(), out_tp.loss.backward()
    slices, full = cm.sharded_parameters(tp), dict(ref.named_parameters())
    assert set(dict(tp.named_parameters())) == set(full)
    for name, p in tp.named_parameters():
        want = slices[name].take(full[name].grad) if name in slices else full[name].grad
        torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m: f"{what}: grad of {name}: {m}")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, tp)]
    for step in range(5):
        ids, labels = batch(10 + step)
        losses = []
        for model, opt in zip((ref, tp), opts):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], **TOL, msg=lambda m: f"{what}: AdamW step {step}: {m}")
    drift = dict(rtol=TOL["rtol"], atol=TOL["atol"] + adam_drift_bound(1e-3, (0.9, 0.999), 5))
    for name, p in tp.named_parameters():
        want = slices[name].take(full[name]) if name in slices else full[name]
        torch.testing.assert_close(p, want, **drift, msg=lambda m: f"{what}: after AdamW: {name}: {m}")


# ---------------------------------------------------------------------------------------- distributed checks
def check_auto(heads: int, kv_heads: int, hidden: int, kind: str, loss_parallel: bool):
    """plan="auto" against the unsharded model; returns the shapes this rank holds of k_proj and lm_head, and,
    under loss_parallel, the largest payload of any collective in a step against the logits' bytes."""
    P = dist.get_world_size()
    ref = llama(heads, kv_heads, hidden, kind=kind)
    tp = cm.shard_model(llama(heads, kv_heads, hidden, kind=kind), plan="auto", loss_parallel=loss_parallel)
    compare(tp, ref, loss_parallel, f"{kind} H={heads} K={kv_heads} TP={P} loss_parallel={loss_parallel}")
    ids, labels = batch(3)
    if loss_parallel:  # transformers' own loss, which rounds the logits to float32: equal to float32's precision
        del ref._loss_function
        torch.testing.assert_close(
            tp(input_ids=ids, labels=labels).loss.float(), ref(input_ids=ids, labels=labels).loss, rtol=2e-6, atol=0
        )
    with counting() as log:
        out = tp(input_ids=ids, labels=labels)
        out.loss.backward()
    with counting() as loss_log:  # the loss alone, from the logits this rank holds
        loss = tp.loss_function(logits=out.logits.detach().requires_grad_(), labels=labels, vocab_size=VOCAB)
    with counting() as loss_backward:
        loss.backward()
    attn = tp.model.layers[0].self_attn
    loss_wire = (loss_log.calls, loss_backward.calls)
    return tuple(attn.k_proj.weight.shape), tuple(tp.lm_head.weight.shape), loss_wire, log.names()


def layer_saved_bytes(model: nn.Module, ids, labels) -> int:
    """The bytes decoder layer 1 of ``model`` saves for backward in a training step (each storage once, the
    parameters' storages left out: F.linear saves a transposed view of its weight), read with
    torch.autograd.graph.saved_tensors_hooks around the layer's forward."""
    seen, hooks = {}, {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def enter(module, args, kwargs):
        hooks["ctx"] = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        hooks["ctx"].__enter__()

    def leave(module, args, out):
        hooks["ctx"].__exit__(None, None, None)

    layer = model.model.layers[1]
    handles = [layer.register_forward_pre_hook(enter, with_kwargs=True), layer.register_forward_hook(leave)]
    try:
        model(input_ids=ids, labels=labels).loss.backward()
    finally:
        for h in handles:
            h.remove()
    return sum(seen.values())


def check_sequence(loss_parallel: bool, vocab: bool, heads: int, kv_heads: int, hidden: int):
    """sequence_parallel=True against the unsharded model (sequence 7: uneven over 2, 3 and 4), with transformers'
    plan (a replicated embedding) or with the embedding split by vocabulary too; then, at a sequence of 12, the
    bytes of a training step against the same plan without sequence parallelism, and the bytes decoder layer 1
    saves for backward against the unsharded layer's."""
    P = dist.get_world_size()
    plan = "auto"
    if vocab:
        from colossalai_cmap.tp.plan import transformers_plan

        plan = {"model.embed_tokens": "vocab", **transformers_plan(llama(heads, kv_heads, hidden))}
    ref = llama(heads, kv_heads, hidden)
    tp = cm.shard_model(llama(heads, kv_heads, hidden), plan=plan, sequence_parallel=True, loss_parallel=loss_parallel)
    compare(tp, ref, loss_parallel, f"sequence parallel TP={P} loss_parallel={loss_parallel} vocab={vocab}")
    check_accumulated_norm_grads(tp, ref)
    plain = cm.shard_model(llama(heads, kv_heads, hidden), plan=plan, loss_parallel=loss_parallel)
    ids, labels = batch(4, 12)
    sent, names = [], []
    for model in (tp, plain):
        for _ in range(2):  # the second step is the steady state
            with counting() as log:
                model(input_ids=ids, labels=labels).loss.backward()
        sent.append(log.sent)
        names.append(log.names())
    layers = [layer_saved_bytes(model, ids, labels) for model in (ref, tp)]
    return sent, layers, names[0]


def check_accumulated_norm_grads(tp: nn.Module, ref: nn.Module) -> None:
    """The norms' gradients, summed over the group after each backward, accumulate over two backwards as
    unsharded; under torch.autograd.grad (nothing accumulates) the norm weight's gradient is whole too."""
    for model in (tp, ref):
        model.zero_grad()
        for seed in (5, 6):
            ids, labels = batch(seed)
            model(input_ids=ids, labels=labels).loss.backward()
    slices, full = cm.sharded_parameters(tp), dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        want = slices[name].take(full[name].grad) if name in slices else full[name].grad
        torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m: f"two backwards: grad of {name}: {m}")
    ids, labels = batch(7)
    got, want = (
        torch.autograd.grad(
            m(input_ids=ids, labels=labels).loss, [m.model.norm.weight, m.model.layers[0].input_layernorm.weight]
        )
        for m in (tp, ref)
    )
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"torch.autograd.grad of the norms: {m}")


def check_styles():
    """transformers' rowwise_rep, local_rowwise under gather, local and sequence_parallel, on a hand-written model,
    against the unsharded one: outputs, input and parameter gradients."""

    class Experts(nn.Module):  # a region whose partial results its "gather" entry sums
        def __init__(self):
            super().__init__()
            self.down = nn.Linear(10, 12, bias=False)

        def forward(self, h):
            return self.down(torch.relu(h))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(12)
            self.up = nn.Linear(12, 10)
            self.experts = Experts()
            self.out = nn.Linear(12, 6)

        def forward(self, x):
            h = self.norm(x)
            h = self.experts(self.up(h))
            return self.out(h)

    plan = {
        "norm": "sequence_parallel",
        "up": "colwise",
        "experts": "gather",
        "experts.down": "local_rowwise",
        "out": "rowwise_rep",
    }
    torch.manual_seed(0)
    ref = Block().double()
    with torch.no_grad():
        ref.norm.weight.uniform_(0.5, 1.5), ref.norm.bias.uniform_(-0.5, 0.5)
    tp = cm.shard_model(__import__("copy").deepcopy(ref), plan=plan)
    x = randn(2, 5, 12, seed=1, dtype=torch.float64).requires_grad_()  # 5 positions: uneven over 2, 3 or 4
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = tp(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, **TOL)
    (y * y).sum().backward(), (y_ref * y_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    slices, full = cm.sharded_parameters(tp), dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        want = slices[name].take(full[name].grad) if name in slices else full[name].grad
        torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m: f"grad of {name}: {m}")
    return True


def check_dropout():
    """Dropout in a sharded region (between a colwise and a rowwise layer) draws a different mask on each rank;
    in the replicated region (after the rowwise layer) the same mask on every rank, reproducible from one seed, and
    the same as in a group of one. Returns the replicated-region output and this rank's sharded-region mask."""

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.5)

        def forward(self, x):
            h = self.drop(self.up(x))
            self.mask = (h == 0).detach()
            return self.down(h)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp, self.drop = Mlp(), nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.mlp(x))

    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        tp = cm.shard_model(Net().double(), plan={"mlp.up": "colwise", "mlp.down": "rowwise"})
        x = torch.ones(4, 8, dtype=torch.float64) + 1
        runs.append([(tp(x) == 0, tp.mlp.mask) for _ in range(2)])
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(*runs))  # one seed: reproducible
    (out0, mask0), (out1, _) = runs[0]
    assert not torch.equal(out0, out1)  # a new mask at each call
    return out0, mask0


class DropoutBlock(nn.Module):
    """A residual MLP block with dropout in its sharded region (between up and down)."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8))

    def forward(self, x):
        return x + self.mlp(x)


def check_dropout_recomputed(checkpointed):
    """Two training steps of two checkpointed blocks (dropout in their sharded regions, and after them in the
    replicated one) under torch.utils.checkpoint with use_reentrant ``checkpointed`` (None: no checkpoint);
    returns every gradient, which must not depend on it: the recomputation replays the masks."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(5)
    blocks = nn.ModuleList([DropoutBlock(), DropoutBlock()]).double()
    plan = {"*.mlp.0": "colwise", "*.mlp.2": "rowwise"}
    blocks, drop = cm.shard_model(blocks, plan=plan), nn.Dropout(0.3)
    grads = []
    for step in range(2):
        x = randn(3, 8, seed=step, dtype=torch.float64).requires_grad_()
        h = x
        for block in blocks:
            h = block(h) if checkpointed is None else checkpoint(block, h, use_reentrant=checkpointed)
        drop(h).square().sum().backward()
        grads += [x.grad] + [p.grad.clone() for p in blocks.parameters()]
        blocks.zero_grad()
    return grads


def flat_mlp():
    """A user's own flat MLP: the dropout sits between the colwise [0] and the rowwise [3] in one nn.Sequential."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.5), nn.Linear(32, 8)).double()


def check_flat_dropout(checkpointed):
    """Two steps of a flat MLP with dropout on its sharded activation, run plainly (``checkpointed`` None) or
    through ``checkpoint_sequential`` in two segments with use_reentrant ``checkpointed`` (the boundary falls
    inside the sharded region). Per step: the output, this rank's dropout mask (of the forward), a draw after the
    step (the replicated stream), and every gradient with its parameter's slice."""
    from torch.utils.checkpoint import checkpoint_sequential

    model = cm.shard_model(flat_mlp(), plan={"0": "colwise", "3": "rowwise"})
    slices, masks, steps = cm.sharded_parameters(model), [], []
    model[2].register_forward_hook(lambda module, args, out: masks.append(out != 0))
    torch.manual_seed(11)
    for step in range(2):
        x = randn(4, 8, seed=step, dtype=torch.float64).requires_grad_()
        del masks[:]
        y = model(x) if checkpointed is None else checkpoint_sequential(model, 2, x, use_reentrant=checkpointed)
        mask = masks[0]
        (y * randn(4, 8, seed=9, dtype=torch.float64)).sum().backward()
        grads = {name: (p.grad.clone(), slices.get(name)) for name, p in model.named_parameters()}
        steps.append((y.detach(), mask, torch.rand(3), x.grad, grads))
        model.zero_grad()
    return steps


def flat_oracle(x, mask, weight):
    """The unsharded flat MLP with the dropout mask ``mask`` (every rank's columns, assembled): its output and its
    gradients for the output weights ``weight``."""
    ref = flat_mlp()
    x = x.detach().clone().requires_grad_()
    y = ref[3](ref[1](ref[0](x)) * mask / 0.5)
    (y * weight).sum().backward()
    return y.detach(), x.grad, dict(ref.named_parameters())


def check_gptj_dropout():
    """transformers' GPT-J, whose attention and MLP modules end with a dropout after their rowwise layer (on the
    replicated hidden state): one training forward and backward; returns the logits, the loss and the gradient of
    the input embedding, which are the same on every rank."""
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=24,
        n_layer=2,
        n_head=6,
        rotary_dim=4,
        resid_pdrop=0.5,
        embd_pdrop=0.5,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = GPTJForCausalLM(config).double().train()
    layer = "transformer.h.*."
    plan = {f"{layer}attn.[qkv]_proj": "colwise", f"{layer}attn.out_proj": "rowwise"}
    plan.update({f"{layer}mlp.fc_in": "colwise", f"{layer}mlp.fc_out": "rowwise"})
    model = cm.shard_model(model, plan=plan)
    ids, labels = batch(1)
    torch.manual_seed(7)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), model.transformer.wte.weight.grad


class Fused(nn.Module):
    """A hand-written block with a fused qkv and a fused gate_up (6 heads of 4; intermediate 10)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(24, 72), nn.Linear(24, 24)
        self.gate_up, self.down = nn.Linear(24, 20), nn.Linear(10, 24)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = (t.view(B, S, -1, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        a = torch.softmax(q @ k.transpose(-1, -2) / 2, -1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(B, S, -1))
        gate, up = self.gate_up(x).chunk(2, -1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


FUSED_PLAN = {"qkv": cm.Colwise(parts=3), "o": "rowwise", "gate_up": cm.Colwise(parts=2), "down": "rowwise"}


def check_fused():
    """Packed parts split each alone: outputs and gradients as unsharded; full_state_dict and load round trip."""
    torch.manual_seed(0)
    ref = Fused().double()
    tp = cm.shard_model(__import__("copy").deepcopy(ref), plan=FUSED_PLAN)
    x = randn(2, 5, 24, seed=2, dtype=torch.float64)
    y, y_ref = tp(x), ref(x)
    torch.testing.assert_close(y, y_ref, **TOL)
    y.square().sum().backward(), y_ref.square().sum().backward()
    return _same_grads_and_state(tp, ref, cm.shard_model(Fused().double(), plan=FUSED_PLAN), x, y_ref)


def _same_grads_and_state(tp, ref, other, x, y_ref):
    """Every parameter's gradient is its slice of the unsharded one; full_state_dict is the unsharded state, and
    ``other`` (a fresh sharded model) loaded from it gives the unsharded output."""
    slices, full = cm.sharded_parameters(tp), dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        want = slices[name].take(full[name].grad) if name in slices else full[name].grad
        torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m: f"grad of {name}: {m}")
    state = cm.full_state_dict(tp)
    assert all(torch.equal(state[n], v) for n, v in ref.state_dict().items())
    cm.load_full_state_dict(other, state)
    torch.testing.assert_close(other(x), y_ref, **TOL)
    return True


class PackedRows(nn.Module):
    """A hand-written block whose row-parallel weights are packed along their input features: ``mix`` takes the
    unequal parts (8, 12) that ``up`` leaves; ``out`` takes a replicated input in parts (5, 7)."""

    def __init__(self):
        super().__init__()
        self.up, self.mix, self.out = nn.Linear(12, 20), nn.Linear(20, 12), nn.Linear(12, 6)

    def forward(self, x):
        return self.out(x + self.mix(torch.nn.functional.gelu(self.up(x))))


PACKED_ROWS_PLAN = {
    "up": cm.Colwise(parts=(8, 12)),
    "mix": cm.Rowwise(parts=(8, 12)),
    "out": RowwiseReplicated(parts=(5, 7)),
}


def check_packed_rows():
    """Rowwise(parts=...): outputs, the input's and every parameter's gradient as unsharded; full_state_dict and
    load_full_state_dict round trip."""
    torch.manual_seed(0)
    ref = PackedRows().double()
    tp = cm.shard_model(__import__("copy").deepcopy(ref), plan=PACKED_ROWS_PLAN)
    x = randn(2, 5, 12, seed=3, dtype=torch.float64).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = tp(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, **TOL)
    y.square().sum().backward(), y_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    other = cm.shard_model(PackedRows().double(), plan=PACKED_ROWS_PLAN)
    return _same_grads_and_state(tp, ref, other, x, y_ref)


class HandAttention(nn.Module):
    """Attention over 6 heads of 4 (whole heads over 2 and 3 ranks)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(24, 24) for _ in range(4))

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = (f(x).view(B, S, -1, 4).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-1, -2) / 2, -1) @ v
        return self.o(a.transpose(1, 2).reshape(B, S, -1))


class HandLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(24), HandAttention(), nn.LayerNorm(24)
        self.mlp = nn.Sequential(nn.Linear(24, 36), nn.GELU(), nn.Linear(36, 24))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class HandLM(nn.Module):
    """A hand-written decoder (no transformers, no ``_no_split_modules``): embedding, 2 layers, norm, LM head."""

    def __init__(self):
        super().__init__()
        self.embed, self.layers = nn.Embedding(VOCAB, 24), nn.ModuleList([HandLayer(), HandLayer()])
        self.norm, self.head = nn.LayerNorm(24), nn.Linear(24, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


HAND_PLAN = {
    "layers.*.attn.[qkv]": "colwise",
    "layers.*.attn.o": "rowwise",
    "layers.*.mlp.0": "colwise",
    "layers.*.mlp.2": "rowwise",
    "head": "colwise_gather",
}


def check_hand_written_sequence_parallel():
    """sequence_parallel=True on a model naming no decoder layers: logits and every gradient as unsharded."""
    torch.manual_seed(0)
    ref = HandLM().double()
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5), m.bias.uniform_(-0.5, 0.5)
    tp = cm.shard_model(__import__("copy").deepcopy(ref), plan=HAND_PLAN, sequence_parallel=True)
    ids, _ = batch(1)
    with counting() as log:
        y = tp(ids)
        y.square().sum().backward()
    y_ref = ref(ids)
    torch.testing.assert_close(y, y_ref, **TOL)
    y_ref.square().sum().backward()
    slices, full = cm.sharded_parameters(tp), dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        want = slices[name].take(full[name].grad) if name in slices else full[name].grad
        torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m: f"grad of {name}: {m}")
    return log.names().count("reduce_scatter_tensor")


# ------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize(
    "P, heads, kv_heads, hidden, kind, loss_parallel",
    [
        (2, 4, 2, 64, "llama", True),  # key/value heads split, one each
        (4, 4, 2, 64, "llama", True),  # fewer key/value heads than ranks: replicated
        (3, 6, 3, 48, "llama", False),
        (2, 4, 1, 64, "qwen2", False),  # one key/value head with a bias, replicated
    ],
)
def test_auto_plan(worlds, P, heads, kv_heads, hidden, kind, loss_parallel):
    got = worlds(P).run(check_auto, heads, kv_heads, hidden, kind, loss_parallel, deadline=DEADLINE)
    head_dim = hidden // heads
    for rank, (k_shape, lm_shape, (loss_fwd, loss_bwd), names) in enumerate(got):
        kv_rows = kv_heads * head_dim if kv_heads < P else kv_heads * head_dim // P
        assert k_shape == (kv_rows, hidden)
        if loss_parallel:
            assert lm_shape == (len(torch.tensor_split(torch.arange(VOCAB), P)[rank]), hidden)
            # the loss: two all_reduces of one and two float64 values per token (the max; the sum of exponentials and
            # the target's logit), none backward; and no collective of the step gathers the logits
            ring = 2 * (P - 1) / P * BATCH * SEQ * 8
            assert loss_fwd == [("all_reduce", ring), ("all_reduce", 2 * ring)] and loss_bwd == []
            assert "all_gather_into_tensor" not in names and "all_gather" not in names
        else:
            assert lm_shape[0] == len(torch.tensor_split(torch.arange(VOCAB), P)[rank])


@pytest.mark.parametrize(
    "P, loss_parallel, vocab, heads, kv_heads, hidden",
    [(2, True, False, 4, 2, 64), (3, False, True, 6, 3, 48), (4, True, True, 4, 2, 64)],
)
def test_sequence_parallel(worlds, P, loss_parallel, vocab, heads, kv_heads, hidden):
    """Values and gradients as unsharded, also accumulated over two backwards; the norms' gradients in one
    all-reduce per backward; bytes within 1.3x of the plan without it (Megatron's count is 1.25x per
    layer); what a decoder layer saves for backward within 1.06x of the unsharded layer's, times ceil(S/t)/S."""
    for (sp, plain), (unsharded, sharded), names in worlds(P).run(
        check_sequence, loss_parallel, vocab, heads, kv_heads, hidden, deadline=DEADLINE
    ):
        assert sp <= 1.3 * plain, (sp, plain)
        # the 5 norms' gradients (2 per layer, the final norm) summed in one all-reduce; the loss's 2; with fewer
        # key/value heads than ranks, the sums of the replicated k and v weights' gradients (2 per layer)
        assert names.count("all_reduce") == 1 + 2 * loss_parallel + 4 * (kv_heads < P), names
        assert sharded <= 1.06 * unsharded * -(-12 // P) / 12, (sharded, unsharded)


@pytest.mark.parametrize("P", [2, 3])
def test_sequence_parallel_without_no_split_modules(worlds, P):
    """The decoder layers are the modules above the attention and MLP; forward makes one reduce-scatter per
    rowwise layer (4), backward one per gathered sequence (attention, MLP: 4; the head: 1)."""
    assert worlds(P).run(check_hand_written_sequence_parallel, deadline=DEADLINE) == [9] * P


def test_sequence_parallel_refuses_a_model_with_no_decoder_layers():
    flat = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16))
    with pytest.raises(ValueError, match=r"Sequential names no decoder layers in _no_split_modules, .* set Sequential"):
        cm.shard_model(flat, plan={"1": "colwise", "3": "rowwise"}, sequence_parallel=True)
    blocks = nn.Sequential(nn.Embedding(VOCAB, 16), nn.ModuleList([nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 16))]))
    with pytest.raises(ValueError, match=r"colwise layer '1.0.0' sits in module '1.0', with no decoder layer above"):
        cm.shard_model(blocks, plan={"1.0.0": "colwise", "1.0.1": "rowwise"}, sequence_parallel=True)


@pytest.mark.parametrize("P", [2, 3])
def test_transformers_styles(worlds, P):
    assert worlds(P).run(check_styles, deadline=DEADLINE) == [True] * P


@pytest.mark.parametrize("P", [2, 3])
def test_packed_parts(worlds, P):
    assert worlds(P).run(check_fused, deadline=DEADLINE) == [True] * P


@pytest.mark.parametrize("P", [2, 3])
def test_packed_row_parts(worlds, P):
    assert worlds(P).run(check_packed_rows, deadline=DEADLINE) == [True] * P


def test_packed_parts_refused_by_name():
    with pytest.raises(ValueError, match=r"gives 'mix' \(20 input features\) Rowwise\(parts=\(8, 8\)\)"):
        cm.shard_model(PackedRows(), plan={"up": "colwise", "mix": cm.Rowwise(parts=(8, 8))})
    with pytest.raises(ValueError, match=r"Rowwise\(parts=0\): parts is a positive count"):
        cm.Rowwise(parts=0)


def test_packed_column_parts_refused_by_name():
    with pytest.raises(ValueError, match=r"gives 'qkv' \(72 output features\) Colwise\(parts=\(24, 24\)\)"):
        cm.shard_model(Fused(), plan={"qkv": cm.Colwise(parts=(24, 24))})


@pytest.mark.parametrize("P", [2, 3])
def test_dropout_in_and_out_of_the_tensor_parallel_region(worlds, P):
    got = worlds(P).run(check_dropout, deadline=DEADLINE)
    alone = check_dropout()  # a group of one
    for out, _ in got:
        assert torch.equal(out, alone[0])  # the replicated region's mask: the same on every rank, for any size
    masks = [mask[:, : 16 // P] for _, mask in got]  # the columns every rank holds (16 features split over P)
    assert all(not torch.equal(masks[i], masks[j]) for i in range(P) for j in range(i))  # one mask per rank


@pytest.mark.parametrize("P", [2])
def test_dropout_replayed_under_activation_checkpointing(worlds, P):
    plain = worlds(P).run(check_dropout_recomputed, None, deadline=DEADLINE)
    for use_reentrant in (False, True):
        got = worlds(P).run(check_dropout_recomputed, use_reentrant, deadline=DEADLINE)
        for rank, (a, b) in enumerate(zip(got, plain)):
            assert all(torch.equal(g, want) for g, want in zip(a, b)), f"use_reentrant={use_reentrant} rank {rank}"


@pytest.mark.parametrize("P", [2, 3])
def test_dropout_between_colwise_and_rowwise_of_a_flat_sequential(worlds, P):
    """The sharded region is where the activation is sharded (after the colwise layer, before its rowwise one),
    whatever the modules' nesting: each rank draws its own columns' mask; the result is the unsharded model's with
    the ranks' masks assembled, gradients included; the stream after the region is the same on every rank and at
    every group size; and checkpoint_sequential, whose boundary falls inside the region, replays the masks."""
    alone = check_flat_dropout(None)
    plain = worlds(P).run(check_flat_dropout, None, deadline=DEADLINE)
    for step in range(2):
        masks = [ranks[step][1] for ranks in plain]
        width = min(m.shape[1] for m in masks)
        assert all(not torch.equal(masks[i][:, :width], masks[j][:, :width]) for i in range(P) for j in range(i))
        weight = randn(4, 8, seed=9, dtype=torch.float64)
        y_ref, dx_ref, ref = flat_oracle(randn(4, 8, seed=step, dtype=torch.float64), torch.cat(masks, -1), weight)
        for y, _, after, dx, grads in (ranks[step] for ranks in plain):
            torch.testing.assert_close(y, y_ref, **TOL)
            torch.testing.assert_close(dx, dx_ref, **TOL)
            for name, (grad, piece) in grads.items():
                want = ref[name].grad if piece is None else piece.take(ref[name].grad)
                torch.testing.assert_close(grad, want, **TOL, msg=lambda m: f"grad of {name}: {m}")
            assert torch.equal(after, alone[step][2])  # the replicated stream: alike on every rank, for any size
    for use_reentrant in (False, True):
        got = worlds(P).run(check_flat_dropout, use_reentrant, deadline=DEADLINE)
        for rank, (a, b) in enumerate(zip(got, plain)):
            for step in range(2):
                assert torch.equal(a[step][0], b[step][0]) and torch.equal(a[step][3], b[step][3]), (rank, step)
                assert all(torch.equal(a[step][4][n][0], b[step][4][n][0]) for n in b[step][4]), (rank, step)


@pytest.mark.parametrize("P", [2, 3])
def test_dropout_after_the_rowwise_layer_inside_the_region_module_is_replicated(worlds, P):
    """GPT-J's resid_dropout follows out_proj inside the attention module (and fc_out inside the MLP): its input is
    replicated, so its mask is the same on every rank and at every group size, and so are the logits."""
    alone = check_gptj_dropout()
    for got in worlds(P).run(check_gptj_dropout, deadline=DEADLINE):
        for value, want in zip(got, alone):
            torch.testing.assert_close(value, want, **TOL)


def test_every_transformers_style_is_mapped_or_refused():
    from transformers.integrations.tensor_parallel import SUPPORTED_TP_STYLES

    assert set(SUPPORTED_TP_STYLES) - set(TRANSFORMERS_STYLES) == {"local_packed_rowwise"}
    model = llama()
    model.config.base_model_tp_plan = {
        **model.config.base_model_tp_plan,
        "layers.*.mlp.up_proj": "local_packed_rowwise",
    }
    before = model.model.layers[0].mlp.up_proj
    with pytest.raises(ValueError, match=r"gives 'model.layers.\*.mlp.up_proj' style 'local_packed_rowwise'"):
        cm.shard_model(model, plan="auto")
    assert model.model.layers[0].mlp.up_proj is before  # refused before any weight is touched
    model.config.base_model_tp_plan = None
    with pytest.raises(ValueError, match=r"plan='auto' .* LlamaForCausalLM has none"):
        cm.shard_model(model, plan="auto")
    with pytest.raises(ValueError, match=r"plan='automatic'"):
        cm.shard_model(model, plan="automatic")


def test_single_process_loss_parallel():
    """A group of one: the loss is transformers' own, the logits whole."""
    ref, tp = llama(), cm.shard_model(llama(), plan="auto", loss_parallel=True)
    compare(tp, ref, True, "single process")
