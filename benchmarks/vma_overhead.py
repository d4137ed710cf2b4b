"""What ``shard_map``'s varying-axis types cost: ``check_vma=True`` against ``check_vma=False``, side by side in one run.

    python -m benchmarks.vma_overhead [--world 2] [--reps 9] [--quick]

With ``check_vma=True`` (the default) every torch op inside ``f`` passes through a ``TorchFunctionMode`` that joins
its inputs' types and records the result's; an invariant tensor that requires grad is cast to varying (a ``pcast``)
at its first meeting with a varying one. Two tables:

* **Per op**: the time of one op inside ``f`` (grad enabled, inputs that require grad), each mode, and the overhead
  of the types in µs per op: an elementwise product of two blocks; a matmul of a block with a closed-over weight
  (cast once per call, then found in the call's cache); a matmul with a fresh view of that weight (``w.t()``: a new
  tensor, so a new cast each time, the case of a weight cast before use); a ``psum`` of a block.
* **Per step**: a training step (forward, ``backward``, grads cleared) of a block under ``shard_map``:
  transformers' ``LlamaDecoderLayer`` (built from a config, no download) with the batch split over the mesh and
  its parameters closed over (data parallel: their gradients summed over the mesh), and a Megatron MLP (column-
  then row-parallel weights as ``in_specs`` blocks, one ``psum``). The ratio typed / untyped of the medians, and
  the range (min-max) of the repetitions' own ratios: the modes are interleaved, the first alternating.

Times are the slowest rank's. ``--quick`` is a smoke test (2 repetitions, a smaller layer). About 50 s on 2 shared
vCPUs.
"""

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

import colossalai_cmap as cm
from benchmarks import world
from benchmarks.compile import timed
from colossalai_cmap import P, shard_map

MODES = (False, True)  # check_vma
OP_MODES = (None, False, True)  # and None: plain torch, outside any map


def _slowest(seconds: float) -> float:
    """The slowest rank's value."""
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _op_cases(mesh: object, rows: int, cols: int, n_ops: int) -> Dict[str, Callable[[Optional[bool]], float]]:
    """Each op: for a mode, one shard_map call running the op ``n_ops`` times (mode None: the op on a block outside
    any map); returns seconds per op inside f, the slowest rank's."""
    size = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    b = torch.randn(rows * size, cols, generator=g).requires_grad_()
    c = torch.randn(rows * size, cols, generator=g).requires_grad_()
    w = torch.randn(cols, cols, generator=g).requires_grad_()

    def loop(op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def f(*blocks: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            for _ in range(n_ops):
                out = op(*blocks)
            f.seconds = (time.perf_counter() - start) / n_ops
            return out

        return f

    ops = {  # name: (op, its arguments, whether it runs outside a map too)
        "b * c (elementwise)": (lambda x, y: x * y, (b, c), True),
        "b @ w (w cast once)": (lambda x: x @ w, (b,), True),
        "b @ w.t() (a cast each)": (lambda x: x @ w.t(), (b,), True),
        "psum(b)": (lambda x: cm.psum(x, "i"), (b,), False),
    }

    def case(op: Callable[..., torch.Tensor], args: tuple, plain: bool) -> Callable[[Optional[bool]], float]:
        f = loop(op)
        mapped = {m: shard_map(f, mesh, (P("i"),) * len(args), P("i"), check_vma=m) for m in MODES}
        blocks = tuple(a[:rows] for a in args)

        def run(mode: Optional[bool]) -> float:
            if mode is None:  # plain torch on a block, outside any map (a collective has no such time)
                if not plain:
                    return float("nan")
                f(*blocks)
            else:
                mapped[mode](*args)
            return _slowest(f.seconds)

        return run

    return {name: case(*spec) for name, spec in ops.items()}


def _llama_step(mesh: object, quick: bool) -> Callable[[bool], Callable[[], None]]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hidden, heads, seq = (128, 4, 32) if quick else (512, 8, 128)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, layer_idx=0)
    positions = torch.arange(seq)[None]
    h = torch.randn(dist.get_world_size(), seq, hidden)
    cos, sin = LlamaRotaryEmbedding(config)(h, positions)

    def f(block: torch.Tensor) -> torch.Tensor:
        return layer(block, position_embeddings=(cos, sin), position_ids=positions)[0]

    def make(mode: bool) -> Callable[[], None]:
        mapped = shard_map(f, mesh, P("i"), P("i"), check_vma=mode)

        def step() -> None:
            mapped(h).square().mean().backward()
            layer.zero_grad(set_to_none=True)

        return step

    return make


def _megatron_step(mesh: object, quick: bool) -> Callable[[bool], Callable[[], None]]:
    hidden, tokens = (128, 32) if quick else (512, 256)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g)
    w1 = (torch.randn(hidden, 4 * hidden, generator=g) / hidden**0.5).requires_grad_()
    w2 = (torch.randn(4 * hidden, hidden, generator=g) / (4 * hidden) ** 0.5).requires_grad_()

    def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return cm.psum(torch.nn.functional.gelu(x @ w1) @ w2, "i")

    def make(mode: bool) -> Callable[[], None]:
        mapped = shard_map(mlp, mesh, (P(), P(None, "i"), P("i", None)), P(), check_vma=mode)

        def step() -> None:
            mapped(x, w1, w2).square().mean().backward()
            w1.grad = w2.grad = None

        return step

    return make


def measure(args: argparse.Namespace) -> Dict[str, Dict[str, Dict[bool, List[float]]]]:
    """Every rank: both modes per case, interleaved; returns the slowest rank's seconds (per op, per step)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("i",))
    out: Dict[str, Dict[str, Dict[bool, List[float]]]] = {"op": {}, "step": {}}
    for name, run in _op_cases(mesh, 16, 64, args.ops).items():
        for mode in OP_MODES:
            run(mode)  # warm up
        out["op"][name] = _interleaved(run, args.reps, OP_MODES)
    blocks = {"LlamaDecoderLayer (DP)": _llama_step, "Megatron MLP (TP)": _megatron_step}
    for name, make in blocks.items():
        for_mode = make(mesh, args.quick)
        steps = {mode: for_mode(mode) for mode in MODES}
        for step in steps.values():
            step()  # warm up
        out["step"][name] = _interleaved(lambda mode: timed(steps[mode], args.inner), args.reps, MODES)
    return out


def _interleaved(run: Callable[[Any], float], reps: int, modes: Sequence[Any]) -> Dict[Any, List[float]]:
    times: Dict[Any, List[float]] = {mode: [] for mode in modes}
    for rep in range(reps):
        for k in range(len(modes)):  # the starting mode rotates
            mode = modes[(rep + k) % len(modes)]
            times[mode].append(run(mode))
    return times


def report(size: int, times: Dict[str, Dict[str, Dict[bool, List[float]]]]) -> None:
    med = statistics.median
    print(f"world {size}: per op inside f (median µs per op; overhead: median and min-max of the repetitions)")
    print(f"{'op':<26}{'plain torch':>12}{'check_vma=False':>16}{'check_vma=True':>16}{'overhead µs':>13}{'range':>20}")
    for name, by in times["op"].items():
        diffs = [(t - u) * 1e6 for t, u in zip(by[True], by[False])]
        print(
            f"{name:<26}{med(by[None]) * 1e6:>12.1f}{med(by[False]) * 1e6:>16.1f}{med(by[True]) * 1e6:>16.1f}"
            f"{med(diffs):>13.1f}"
            f"{f'{min(diffs):.1f} to {max(diffs):.1f}':>20}"
        )
    print(f"world {size}: per training step (median ms; ratio typed/untyped: of the medians, and min-max)")
    print(f"{'block':<26}{'check_vma=False':>16}{'check_vma=True':>16}{'ratio':>8}{'range':>14}")
    for name, by in times["step"].items():
        ratios = [t / u for t, u in zip(by[True], by[False])]
        print(
            f"{name:<26}{med(by[False]) * 1e3:>16.2f}{med(by[True]) * 1e3:>16.2f}"
            f"{med(by[True]) / med(by[False]):>8.3f}{f'{min(ratios):.3f}-{max(ratios):.3f}':>14}"
        )


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Parse the command line and time both modes on a fresh gloo world."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vma_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--inner", type=int, default=3, help="steps per timed repetition")
    parser.add_argument("--ops", type=int, default=200, help="ops per timed call")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 repetitions, smaller blocks")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.inner, args.ops = 2, 1, 20
    print("shard_map's varying-axis types: check_vma=True against check_vma=False (slowest rank)")
    report(args.world, world.spawn(measure, args.world, (args,))[0])


if __name__ == "__main__":
    main()
