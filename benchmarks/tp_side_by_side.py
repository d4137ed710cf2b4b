"""Tensor parallelism side by side on one small transformers Llama: shard_model's plan, torch's ``parallelize_module``
(DTensor ``ColwiseParallel`` / ``RowwiseParallel``) and Colossal-AI's shardformer, against the unsharded model.

    python -m benchmarks.tp_side_by_side            # TP 2 and 4 on gloo (CPU), 127.0.0.1
    python -m benchmarks.tp_side_by_side --tp 2 --steps 20
    python -m benchmarks.tp_side_by_side --quick    # smoke test: TP 2, 2 timed steps

Each variant is built from the same seed on every rank, runs the same token ids, and is measured in the same
process: the largest difference of its logits, loss and gradients from the unsharded model's (a sharded gradient
compared with its slice), the collectives of one training step (forward + backward), the wall time of one step
(forward, backward, AdamW), and the parameter bytes per rank. A variant that cannot run says why, with the error.

Collectives are counted by what each one issues: cmap's own log (``record_collectives``) for shard_model; torch's
``CommDebugMode`` for DTensor; for shardformer, wrappers around the ``torch.distributed`` functions it calls (this
script only; nothing in the package is patched).
"""

import argparse
import json
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import world
from benchmarks.paths import load_example

_example = load_example("tensor_parallel_llama")  # the example's model, plan and inputs
BATCH, PLAN, SEQ, VOCAB = _example.BATCH, _example.PLAN, _example.SEQ, _example.VOCAB
llama, token_ids = _example.llama, _example.token_ids


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> Any:
    """The causal LM loss from the logits (the same formula for every variant, whatever loss it installs)."""
    logits = model(input_ids=ids).logits[..., :VOCAB]  # shardformer pads the vocabulary to a multiple of 64 * TP
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
    return logits, loss


# ------------------------------------------------------------------------------------------------ the variants
def build_shard_model(P: int) -> Any:
    import colossalai_cmap as cm

    model = cm.shard_model(llama(), plan=PLAN)
    shards = cm.sharded_parameters(model)
    return model, lambda name, full: shards[name].take(full) if name in shards else full, lambda p: p


def build_dtensor(P: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (P,))
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    model = parallelize_module(llama(), mesh, plan)

    def whole(p: torch.Tensor) -> torch.Tensor:  # DTensor gradients are compared whole
        return p.full_tensor() if hasattr(p, "full_tensor") else p

    return model, lambda name, full: full, whole


def build_shardformer(P: int, mended: bool = False) -> Any:
    """shardformer's Llama policy, with the logits gathered (``parallel_output=False``) for the same loss formula.

    ``mended``: first mend two things, in this process only. colossalai's CPU accelerator passes a device to
    ``torch.get_rng_state()``, which takes none, and its ``manual_seed`` raises on CPU (both are called when the
    vocabulary-parallel embedding is built). And with ``parallel_output=False`` and no sequence-parallel group,
    ``ShardConfig`` takes the world as that group, so the model gathers the final hidden states along the sequence
    over it (``gather_sp_output``) and returns P times the tokens: a group of this rank alone avoids it.
    """
    from colossalai.shardformer import ShardConfig, ShardFormer

    options: Dict[str, Any] = {}
    if mended:
        from colossalai.accelerator.cpu_accelerator import CpuAccelerator

        CpuAccelerator.get_rng_state = lambda self, device=None: torch.get_rng_state()
        CpuAccelerator.manual_seed = lambda self, seed: torch.manual_seed(seed)
        alone = [dist.new_group([r]) for r in range(P)]  # every rank creates every group
        options["sequence_parallel_process_group"] = alone[dist.get_rank()]
    config = ShardConfig(
        tensor_parallel_process_group=dist.group.WORLD, enable_tensor_parallelism=True, parallel_output=False, **options
    )
    model, _ = ShardFormer(config).optimize(llama())
    return model, lambda name, full: full, lambda p: p  # a sharded gradient is compared with its slice below


def build_shardformer_mended(P: int) -> Any:
    return build_shardformer(P, mended=True)


VARIANTS: Dict[str, Callable[[int], Any]] = {
    "shard_model (plan)": build_shard_model,
    "parallelize_module (DTensor)": build_dtensor,
    "shardformer": build_shardformer,
    "shardformer, mended (see build_shardformer)": build_shardformer_mended,
}


# ---------------------------------------------------------------------------------------------- measurements
class Counter:
    """Counts the torch.distributed collectives called while open (for code that calls them directly)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "broadcast", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter")  # fmt: skip

    def __init__(self) -> None:
        self.ops: List[str] = []
        self.bytes = 0  # what this rank sends: the first tensor argument (or list of them) of each call
        self.saved: Dict[str, Any] = {}

    def __enter__(self) -> "Counter":
        for name in self.NAMES:
            original = self.saved[name] = getattr(dist, name)

            def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                self.ops.append(_name)
                sent = args[1] if _name.startswith(("all_gather", "reduce_scatter", "all_to_all")) else args[0]
                for t in sent if isinstance(sent, (list, tuple)) else [sent]:
                    self.bytes += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self.saved.items():
            setattr(dist, name, original)


def count_step(name: str, model: torch.nn.Module, ids: torch.Tensor) -> Dict[str, Any]:
    """The collectives of one forward and one backward, by kind."""
    if name.startswith("shard_model"):
        import colossalai_cmap as cm

        with cm.record_collectives() as fwd:
            _, loss = loss_of(model, ids)
        with cm.record_collectives() as bwd:
            loss.backward()
        ops = {"forward": [op for op, _ in fwd.entries], "backward": [op for op, _ in bwd.entries]}
        return {**ops, "bytes": fwd.bytes + bwd.bytes}
    if name.startswith("parallelize_module"):
        from torch.distributed.tensor.debug import CommDebugMode

        with CommDebugMode() as fwd:
            _, loss = loss_of(model, ids)
        with CommDebugMode() as bwd:
            loss.backward()
        return {"forward": _comm_ops(fwd), "backward": _comm_ops(bwd)}
    with Counter() as fwd:
        _, loss = loss_of(model, ids)
    with Counter() as bwd:
        loss.backward()
    return {"forward": fwd.ops, "backward": bwd.ops, "bytes": fwd.bytes + bwd.bytes}


def _comm_ops(mode: Any) -> List[str]:
    return [f"{op.__name__.split('.')[-1]}" for op, n in mode.get_comm_counts().items() for _ in range(n)]


def differences(name: str, model: torch.nn.Module, ref: torch.nn.Module, take: Any, local: Any) -> Dict[str, float]:
    """Largest absolute differences from the unsharded model: logits, loss, gradients (after one backward each)."""
    ids = token_ids(1)
    model.zero_grad(), ref.zero_grad()
    logits, loss = loss_of(model, ids)
    ref_logits, ref_loss = loss_of(ref, ids)
    loss.backward(), ref_loss.backward()
    full = dict(ref.named_parameters())
    worst = 0.0
    for pname, p in model.named_parameters():
        grad = local(p.grad)
        expected = take(pname, full[pname].grad)
        if grad.shape != expected.shape:  # shardformer: this rank's rows or columns of the full gradient
            expected = _matching_slice(expected, grad.shape)
        worst = max(worst, (grad - expected).abs().max().item())
    return {
        "logits": (logits - ref_logits).abs().max().item(),
        "loss": abs(loss.item() - ref_loss.item()),
        "grads": worst,
    }


def _matching_slice(full: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """This rank's equal chunk along the dim that differs, of ``full`` zero-padded to P chunks (a padded vocabulary)."""
    rank, P = dist.get_rank(), dist.get_world_size()
    dim = next(d for d, (a, b) in enumerate(zip(full.shape, shape)) if a != b)
    pad = [0, 0] * (full.dim() - 1 - dim) + [0, P * shape[dim] - full.shape[dim]]
    return F.pad(full, pad).narrow(dim, rank * shape[dim], shape[dim])


def time_steps(model: torch.nn.Module, steps: int) -> float:
    """Median wall time of one training step (forward, backward, AdamW), the slowest rank's."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 3):
        ids = token_ids(100 + step)
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        loss_of(model, ids)[1].backward()
        opt.step()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if step >= 3:
            times.append(took.item())
    return statistics.median(times)


def param_bytes(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def run_variant(name: str, P: int, steps: int) -> Dict[str, Any]:
    try:
        model, take, local = VARIANTS[name](P)
        ref = llama()
        found: Dict[str, Any] = {"bytes_per_rank": param_bytes(model), "unsharded_bytes": param_bytes(ref)}
        found["max_abs_diff"] = differences(name, model, ref, take, local)
        model.zero_grad()
        count_step(name, model, token_ids(2))  # warm-up: cmap's rounds size their payload on the first step
        model.zero_grad()
        found["collectives"] = count_step(name, model, token_ids(2))
        found["step_ms"] = 1e3 * time_steps(model, steps)
        return found
    except Exception as exc:  # reported, not raised: the other variants still run
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}


def unsharded_ms(steps: int) -> float:
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 3):
        ids = token_ids(100 + step)
        start = time.perf_counter()
        opt.zero_grad()
        loss_of(model, ids)[1].backward()
        opt.step()
        if step >= 3:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(P: int, steps: int) -> Dict[str, Any]:
    """Every rank: run each variant; rank 0 also times the unsharded model in its own process alone."""
    results = {name: run_variant(name, P, steps) for name in VARIANTS}
    if dist.get_rank() == 0:
        results["unsharded (1 process)"] = {"step_ms": unsharded_ms(steps)}
    return results


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Parse the command line; for each TP size, run :func:`measure` on a fresh world and print its table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tp_side_by_side", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="smoke test: TP 2 only, 2 timed steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.tp, args.steps = [2], 2
    everything = {}
    for P in args.tp:
        everything[P] = world.spawn(measure, P, (P, args.steps), launch="colossalai")[0]
        report(P, everything[P])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


def report(P: int, results: Dict[str, Any]) -> None:
    print(f"\nTP = {P}, batch {BATCH} x {SEQ} tokens, float64 (the example's model), gloo on CPU")
    print(
        "| variant | logits / loss / grads max abs diff | collectives fwd + bwd | bytes sent | step ms | param bytes |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | did not run: {r['error'][:300]} | | | | |")
            continue
        if "collectives" not in r:
            print(f"| {name} | (the reference) | 0 | 0 | {r['step_ms']:.2f} | |")
            continue
        d, c = r["max_abs_diff"], r["collectives"]
        print(
            f"| {name} | {d['logits']:.1e} / {d['loss']:.1e} / {d['grads']:.1e} | {len(c['forward'])} + "
            f"{len(c['backward'])} ({_kinds(c)}) | {_bytes(c)} | {r['step_ms']:.2f} | {r['bytes_per_rank']:,} |"
        )
    sys.stdout.flush()


def _bytes(c: Dict[str, Any]) -> str:
    return f"{c['bytes']:,}" if "bytes" in c else "(not counted)"


def _kinds(c: Dict[str, List[str]]) -> str:
    kinds: Dict[str, int] = {}
    for op in c["forward"] + c["backward"]:
        kinds[op] = kinds.get(op, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in kinds.items())


if __name__ == "__main__":
    main()
