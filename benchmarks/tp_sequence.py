"""Sequence parallelism and the vocabulary-parallel loss side by side on one small transformers Llama:
shard_model plain / sequence_parallel / sequence_parallel + loss_parallel, torch's ``parallelize_module``
(ColwiseParallel / RowwiseParallel, then with SequenceParallel) where it runs on gloo/CPU in this torch, and
Colossal-AI's shardformer (its Llama policy, plain and with ``enable_sequence_parallelism`` in ``split_gather`` mode).

    python -m benchmarks.tp_sequence              # TP 2 and 4
    python -m benchmarks.tp_sequence --tp 2 --steps 3

Every variant is built from the same seed on every rank and runs the same batch (float32). Per variant: the
collectives of one training step (forward + backward, counted by the wire counter ``tests/wire_tap.py``: what each
rank sends under the ring algorithm), the bytes decoder layer 1 saves for backward on a rank (each storage once,
the parameters' storages left out, views of them too, read with ``torch.autograd.graph.saved_tensors_hooks``), the
largest difference of the loss and of every gradient from the unsharded model's, and the step time: the median and
range of its ratio to shard_model plain's over repetitions that interleave the variants (one step of each in turn).
The saved bytes are set next to Korthikanti et al.'s per-layer formulas: ``sbh(34 + 5as/h)`` unsharded,
``sbh(10 + 24/t + 5as/(ht))`` with TP and ``sbh(34/t + 5as/(ht))`` with TP + SP (16-bit activations with dropout
masks; this model has no dropout and runs in float32, so compare the ratios to the unsharded layer).
"""

import argparse
import statistics
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from benchmarks import world
from benchmarks.paths import test_support

wire_tap = test_support("wire_tap")
VOCAB, BATCH, SEQ, HIDDEN, HEADS, KV_HEADS, LAYERS = 1000, 2, 64, 256, 8, 4, 2


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=688,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        attn_implementation="eager",
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batch() -> Any:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def plan() -> Dict[str, str]:
    from colossalai_cmap.tp.plan import transformers_plan

    return {"model.embed_tokens": "vocab", **transformers_plan(llama())}


def build(name: str, P: int) -> Any:
    """(model, this rank's slice of a full gradient by name) for a variant."""
    import colossalai_cmap as cm

    if name.startswith("shardformer"):
        return build_shardformer(P, sequence_parallel="split_gather" in name)
    if name.startswith("shard_model"):
        model = cm.shard_model(
            llama(), plan=plan(), sequence_parallel="SP" in name, loss_parallel="loss_parallel" in name
        )
        shards = cm.sharded_parameters(model)
        return model, lambda n, full: shards[n].take(full) if n in shards else full
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (P,))
    layer = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    top = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    if "SequenceParallel" in name:  # torch's recipe: the embedding's and rowwise outputs sharded on the sequence
        layer.update(
            {
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            }
        )
        top = {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    model = llama()
    for block in model.model.layers:
        parallelize_module(block, mesh, layer)
    parallelize_module(model, mesh, top)
    return model, None


def build_shardformer(P: int, sequence_parallel: bool) -> Any:
    """shardformer's Llama policy over the world, the vocabulary unpadded (1000 divides by t) and the logits gathered
    (``parallel_output=False``), so that transformers' loss runs as in the other variants. Two things are mended in
    this process only (as in ``benchmarks/tp_side_by_side.py``): colossalai's CPU accelerator passes a device to
    ``torch.get_rng_state()``, and its ``manual_seed`` raises on CPU; and without sequence parallelism a group of this
    rank alone is its sequence-parallel group (else it takes the world and gathers the outputs along the sequence)."""
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator
    from colossalai.shardformer import ShardConfig, ShardFormer

    CpuAccelerator.get_rng_state = lambda self, device=None: torch.get_rng_state()
    CpuAccelerator.manual_seed = lambda self, seed: torch.manual_seed(seed)
    alone = [dist.new_group([r]) for r in range(P)]  # every rank creates every group
    options: Dict[str, Any] = {
        "enable_sequence_parallelism": True,
        "sequence_parallelism_mode": "split_gather",
        "sequence_parallel_process_group": dist.group.WORLD,
    }
    if not sequence_parallel:
        options = {"sequence_parallel_process_group": alone[dist.get_rank()]}
    config = ShardConfig(
        tensor_parallel_process_group=dist.group.WORLD,
        enable_tensor_parallelism=True,
        parallel_output=False,
        make_vocab_size_divisible_by=1,
        **options,
    )
    model, _ = ShardFormer(config).optimize(llama())
    shapes = {n: p.shape for n, p in model.named_parameters()}
    return model, lambda n, full: full if full.shape == shapes[n] else _matching_slice(full, shapes[n])


def _matching_slice(full: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """This rank's equal chunk of ``full`` along the dim whose size differs (shardformer's rows or columns)."""
    rank = dist.get_rank()
    dim = next(d for d, (a, b) in enumerate(zip(full.shape, shape)) if a != b)
    return full.narrow(dim, rank * shape[dim], shape[dim])


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def saved_layer_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """What decoder layer 1 saves for backward: each storage once, the parameters' storages left out (``F.linear``
    saves a transposed view of its weight, which is no ``Parameter`` but holds no new memory)."""
    seen, ctx = {}, {}
    local_params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    params = {p.untyped_storage().data_ptr() for p in local_params}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.untyped_storage().data_ptr() not in params:
            seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return t

    def enter(*_: Any, **__: Any) -> None:
        ctx["hooks"] = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        ctx["hooks"].__enter__()

    def leave(*_: Any) -> None:
        ctx["hooks"].__exit__(None, None, None)

    layer = model.model.layers[1]
    handles = [layer.register_forward_pre_hook(enter, with_kwargs=True), layer.register_forward_hook(leave)]
    try:
        loss_of(model, ids).backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad()
    return sum(seen.values())


def run_variant(name: str, P: int, ref: torch.nn.Module) -> Dict[str, Any]:
    try:
        model, take = build(name, P)
        ids = batch()
        ref.zero_grad()
        ref_loss = loss_of(ref, ids)
        ref_loss.backward()
        import contextlib

        from torch.distributed.tensor.debug import CommDebugMode

        for _ in range(2):  # the second step is the steady state
            model.zero_grad()
            # CommDebugMode for DTensor only: under it, shard_model's layers that read one tensor stop sharing one
            # entry (measured: 16 all_reduces a step instead of 10, and sequence parallelism refused)
            dtensor_log = CommDebugMode() if take is None else contextlib.nullcontext()
            with wire_tap.counting() as log, dtensor_log:
                loss = loss_of(model, ids)
                loss.backward()
        full = dict(ref.named_parameters())
        grad_diff = 0.0
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            want = take(n, full[n].grad) if take else full[n].grad
            grad_diff = max(grad_diff, float((g - want).abs().max()))
        kinds: Dict[str, int] = {}
        for op in log.names():
            kinds[op] = kinds.get(op, 0) + 1
        if not kinds:  # DTensor issues functional collectives, which the wire counter does not see: their counts
            kinds = {
                f"{getattr(k, '__name__', str(k)).split('.')[-1]}*": n for k, n in dtensor_log.get_comm_counts().items()
            }
        saved = saved_layer_bytes(model, ids)
        return {
            "kinds": kinds,
            "count": log.count,
            "bytes": log.sent,
            "saved": saved,
            "loss_diff": abs(float(loss) - float(ref_loss)),
            "grad_diff": grad_diff,
            "step": training_step(model, ids),
        }
    except Exception as exc:  # a variant that cannot run says why
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}", "trace": traceback.format_exc()}


def training_step(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], None]:
    """One AdamW step of ``model`` on ``ids`` (its first call is the warm-up)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        loss_of(model, ids).backward()
        opt.step()

    step()
    return step


def time_steps(results: Dict[str, Any], reps: int) -> None:
    """Step times, the variants interleaved: repetition i times one step of each variant in turn (all ranks
    together, after a barrier), so that the load of a shared machine falls alike on all of them; rank 0's clock."""
    steps = {name: r.pop("step") for name, r in results.items() if "step" in r}
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        results[name]["times"] = ts


VARIANTS = (
    "shard_model plain",
    "shard_model SP",
    "shard_model SP+loss_parallel",
    "parallelize_module plain",
    "parallelize_module SequenceParallel",
    "shardformer plain",
    "shardformer SP split_gather",
)


def measure(P: int, steps: int) -> Dict[str, Any]:
    ref = llama()
    results = {"unsharded": {"saved": saved_layer_bytes(ref, batch())}}
    for name in VARIANTS:
        results[name] = run_variant(name, P, ref)
        dist.barrier()
    time_steps(results, steps)
    return results


def formula(t: int) -> Dict[str, float]:
    s, b, h, a = SEQ, BATCH, HIDDEN, HEADS
    return {
        "unsharded": s * b * h * (34 + 5 * a * s / h),
        "TP": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
        "TP+SP": s * b * h * (34 / t + 5 * a * s / (h * t)),
    }


def report(P: int, results: Dict[str, Any]) -> None:
    base, f = results["unsharded"]["saved"], formula(P)
    plain = results["shard_model plain"].get("bytes")
    plain_times = results["shard_model plain"].get("times", [])
    print(
        f"\nTP {P}: Llama {LAYERS} layers, h={HIDDEN}, a={HEADS} (kv {KV_HEADS}), s={SEQ}, b={BATCH}, V={VOCAB}, fp32"
    )
    print(
        f"{'variant':38} {'collectives per step':44} {'bytes/rank':>10} {'vs plain':>8} {'saved L1':>9} "
        f"{'vs 1 proc':>9} {'loss diff':>9} {'grad diff':>9} {'ms':>7} {'step time vs plain':>20}"
    )
    print(f"{'unsharded (1 process)':38} {'':44} {'':>10} {'':>8} {base:>9,} {1:>9.3f}")
    for name in VARIANTS:
        r = results[name]
        if "error" in r:
            print(f"{name:38} does not run: {r['error']}")
            continue
        kinds = ", ".join(f"{n} {k.replace('_into_tensor', '').replace('_tensor', '')}" for k, n in r["kinds"].items())
        sent = f"{r['bytes']:>10,.0f} {r['bytes'] / plain:>8.3f}" if r["bytes"] else f"{'n/a*':>10} {'':>8}"
        print(
            f"{name:38} {kinds:44} {sent} {r['saved']:>9,} "
            f"{r['saved'] / base:>9.3f} {r['loss_diff']:>9.1e} {r['grad_diff']:>9.1e} "
            f"{1e3 * statistics.median(r['times']):>7.1f} {step_ratio(r['times'], plain_times):>20}"
        )
    print(
        f"step times: median of {len(plain_times)} interleaved repetitions (one AdamW step of each variant in turn), "
        f"rank 0's clock; the ratio to shard_model plain in the same repetition: median [min, max]. A shared "
        f"2-vCPU CPU machine (gloo), {P} processes: compare ratios, not milliseconds."
    )
    print("* DTensor's functional collectives (counted by torch's CommDebugMode; the wire counter sees no bytes)")
    print(
        f"Korthikanti per layer (16-bit, bytes): unsharded {f['unsharded']:,.0f}; TP {f['TP']:,.0f} "
        f"({f['TP'] / f['unsharded']:.3f}); TP+SP {f['TP+SP']:,.0f} ({f['TP+SP'] / f['unsharded']:.3f}); "
        f"ceil(s/t)/s = {-(-SEQ // P) / SEQ:.3f}"
    )


def step_ratio(times: List[float], plain: List[float]) -> str:
    """The median and range of a variant's step time over shard_model plain's in the same repetition."""
    ratios = sorted(t / p for t, p in zip(times, plain))
    return f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}, {ratios[-1]:.2f}]"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tp_sequence", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5, help="timed repetitions (one step of every variant each)")
    args = parser.parse_args(argv)
    for P in args.tp:
        report(P, world.spawn(measure, P, (P, args.steps), timeout_s=600)[0])


if __name__ == "__main__":
    main()
