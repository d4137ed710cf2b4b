"""Training a transformers Llama with tensor parallelism, Megatron's sequence parallelism and the vocabulary-parallel
loss: ``shard_model(model, plan="auto", sequence_parallel=True, loss_parallel=True)``.

    colossalai run --nproc_per_node 2 examples/tp_sequence_parallel.py
    colossalai run --nproc_per_node 4 examples/tp_sequence_parallel.py

The plan is transformers' own (``config.base_model_tp_plan`` and the LM head's ``colwise_rep``), with the embedding
split by vocabulary too. The model has 4 query heads and 2 key/value heads, so at TP 4 the key/value projections
are replicated (each rank computes the head its query heads read). Between the tensor-parallel regions each rank
holds its rows of the sequence (11 positions: not a multiple of the ranks); the LM head's logits stay split by
vocabulary, and the loss comes from those slices. The loop trains the sharded model and the unsharded one side by
side with AdamW and checks every step's loss (float64, as in ``tensor_parallel_llama.py``: the comparison measures
the sharding, not the rounding).
"""

import colossalai
import torch
import torch.distributed as dist
from torch import nn

import colossalai_cmap as cm

VOCAB, BATCH, SEQ = 503, 2, 11
TOL = dict(atol=1e-7, rtol=1e-7)


def llama() -> nn.Module:
    """A small Llama from a config (2 layers, hidden 64, 4 heads, 2 key/value heads, vocabulary 503); no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=152,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)  # the same weights on every rank
    return LlamaForCausalLM(config).to(torch.float64)


def float64_loss(logits, labels, vocab_size, ignore_index=-100, **_):
    """The unsharded model's loss as transformers computes it, kept in float64 (transformers casts to float32)."""
    shifted = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shifted.reshape(-1), ignore_index=ignore_index)


def main(steps: int = 5) -> bool:
    if not dist.is_initialized():
        colossalai.launch_from_torch(verbose=False)
    rank, P = dist.get_rank(), dist.get_world_size()
    from colossalai_cmap.tp.plan import transformers_plan

    plan = {"model.embed_tokens": "vocab", **transformers_plan(llama())}
    model = cm.shard_model(llama(), plan=plan, sequence_parallel=True, loss_parallel=True)
    full = llama()
    full.loss_function = float64_loss
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, full)]
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        pair, logits = [], None
        for m, opt in zip((model, full), opts):
            opt.zero_grad()
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            pair.append(out.loss.item())
            logits = out.logits if m is model else logits
        if abs(pair[0] - pair[1]) > TOL["atol"] + TOL["rtol"] * abs(pair[1]):
            raise AssertionError(f"[rank {rank}] step {step}: loss {pair[0]} != unsharded {pair[1]}")
        losses.append(pair[0])
    mine = cm.sharded_parameters(model)["lm_head.weight"].sizes[rank]
    assert logits.shape == (BATCH, SEQ, mine)  # this rank's slice of the vocabulary only
    curve = " -> ".join(f"{v:.4f}" for v in losses)
    print(
        f"[rank {rank}] tp_sequence_parallel: OK at TP {P}: AdamW losses {curve} match the unsharded model; "
        f"logits {tuple(logits.shape)} of vocabulary {VOCAB}"
    )
    return True


if __name__ == "__main__":
    main()
