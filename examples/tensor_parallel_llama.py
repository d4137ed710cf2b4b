"""Tensor parallelism on a transformers Llama with a sharding plan: ``shard_model(model, plan=...)``.

    colossalai run --nproc_per_node 2 examples/tensor_parallel_llama.py
    colossalai run --nproc_per_node 4 examples/tensor_parallel_llama.py

A small ``LlamaForCausalLM`` (2 layers, hidden 64, intermediate 160, 4 heads, vocabulary 1000) is built from a
config on every rank with the same seed, so nothing is downloaded. The plan shards the embedding by vocabulary rows,
q/k/v and gate/up by output features (their outputs stay sharded), o_proj and down_proj by input features (their
sums make the activations whole again) and the LM head by output features, gathered. Each rank then holds 1/P of
every sharded weight. The example checks the logits, the loss and every gradient against the unsharded model,
trains both with AdamW for five steps, counts the collectives of a step, and gathers the full state dict back.

The models run in float64, so that the comparison measures the sharding, not the rounding: a row-parallel layer adds
its input features' products in per-rank partial sums, in another order than the unsharded matmul. A sum of n terms
added in another order moves by at most about n * eps * sum|terms|: in float64 (eps 2.2e-16) that stays under 3e-10
for every sum here, far under TOL, whereas in float32 (eps 1.2e-7) no fixed tolerance would bound it.
"""

import colossalai
import torch
import torch.distributed as dist
from torch import nn

import colossalai_cmap as cm

VOCAB, BATCH, SEQ = 1000, 2, 8

PLAN = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.[qkv]_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather",
}
TOL = dict(atol=1e-7, rtol=1e-7)  # torch's float64 defaults: see the module docstring


def llama(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    """The small Llama: 2 layers, hidden 64, intermediate 160, 4 heads, vocabulary 1000; no download."""
    from transformers import LlamaConfig, LlamaForCausalLM  # here, so that importing PLAN stays cheap

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)  # the same weights on every rank
    return LlamaForCausalLM(config).to(dtype)


def token_ids(seed: int, batch: int = BATCH) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def check_gradients(sharded: nn.Module, full: nn.Module) -> None:
    """A sharded parameter's gradient is its slice of the unsharded gradient; the others are the whole one."""
    shards = cm.sharded_parameters(sharded)
    reference = dict(full.named_parameters())
    for name, p in sharded.named_parameters():
        expected = reference[name].grad
        expected = shards[name].take(expected) if name in shards else expected
        torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m: f"gradient of {name}: {m}")


def main(steps: int = 5) -> bool:
    """Returns True when the sharded Llama matches the unsharded one: values, gradients, AdamW steps, checkpoint."""
    if not dist.is_initialized():
        colossalai.launch_from_torch(verbose=False)
    rank, P = dist.get_rank(), dist.get_world_size()
    full, sharded = llama(), cm.shard_model(llama(), plan=PLAN)
    ids = token_ids(1)

    out_full, out_sharded = full(input_ids=ids, labels=ids), sharded(input_ids=ids, labels=ids)
    torch.testing.assert_close(out_sharded.logits, out_full.logits, **TOL)
    out_full.loss.backward()
    out_sharded.loss.backward()
    check_gradients(sharded, full)

    losses = []
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (full, sharded)]
    for step in range(steps):
        ids = token_ids(10 + step)
        pair = []
        for model, opt in zip((full, sharded), opts):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            pair.append(loss.item())
        if abs(pair[0] - pair[1]) > TOL["atol"] + TOL["rtol"] * abs(pair[0]):
            raise AssertionError(f"[rank {rank}] AdamW step {step}: loss {pair[1]} != unsharded {pair[0]}")
        losses.append(pair[1])

    with cm.record_collectives() as forward:
        loss = sharded(input_ids=ids, labels=ids).loss
    with cm.record_collectives() as backward:
        loss.backward()
    # The full state dict puts the shards back together: each rank's parameters are exactly their slices of it.
    state, shards = cm.full_state_dict(sharded), cm.sharded_parameters(sharded)
    assert list(state) == list(full.state_dict())
    for name, p in sharded.named_parameters():
        expected = shards[name].take(state[name]) if name in shards else state[name]
        if not torch.equal(p.detach(), expected):
            raise AssertionError(f"[rank {rank}] full_state_dict: {name} is not this rank's parameter")

    curve = " -> ".join(f"{v:.4f}" for v in losses)
    print(
        f"[rank {rank}] tensor_parallel_llama: OK at TP {P}: logits, loss and gradients match the unsharded model; "
        f"AdamW losses {curve} match to {TOL['atol']:g}; a step makes {forward.count} + {backward.count} "
        f"collectives; parameter bytes {param_bytes(sharded):,} of {param_bytes(full):,}; full_state_dict matches"
    )
    return True


if __name__ == "__main__":
    main()
