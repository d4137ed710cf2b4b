"""torch.compile and cmap side by side: the three ways to combine them, timed in one run on a gloo world.

    python -m benchmarks.compile [--world 2] [--backend aot_eager] [--batch 64] [--quick]

The function is a per-example MLP whose hidden activations are normalised over the whole global batch (``pmean``
of the mean and of the variance: two collectives per call), with a backward. Variants, interleaved in every
repetition:

* ``eager batched``: ``cmap(f, mode="batched")``, the reference.
* ``compiled f, batched``: ``cmap(torch.compile(f, fullgraph=True), mode="batched")``: func is one graph, its
  collectives functional collectives.
* ``compile(cmap)``: ``torch.compile(cmap(f, mode="batched"))``: the whole call is one graph (cmap lowers itself
  to traceable ops and functional collectives while dynamo traces it; no status round).
* ``eager vmap`` and ``compiled f, vmap``: mode "vmap" maps the original function of a compiled f.
* ``compile(cmap) fullgraph``: ``torch.compile(cmap(f), fullgraph=True)`` in mode "vmap": one graph, against
  ``eager vmap``.
* ``eager shard_map`` and ``compile(shard_map) fullgraph``: a Megatron MLP block (columns of the first weight and
  rows of the second over the mesh axis "tp", one ``psum``) under ``shard_map``, eagerly and as one graph
  (``torch.compile(shard_map(f), fullgraph=True)``; ``check_vma`` is not tracked inside the graph).

It prints the median time per call (max over ranks), each variant's ratio to its eager reference (of the medians, and
the range of the repetitions' own ratios), and the first
call's time (the compile). With ``aot_eager`` (the CPU default here) the graph runs the same ops, so the ratios
show what the orchestration costs, not what a code generator would gain. ``--quick`` is a smoke test (3
repetitions of 2 calls).
"""

import argparse
import statistics
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

import colossalai_cmap as cm
from benchmarks import world
from colossalai_cmap import P


def make_f(w1: torch.Tensor, w2: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-example MLP whose hidden activations are normalised over the global batch (two ``pmean``)."""

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x @ w1
        mean = cm.pmean(h, "i")
        var = cm.pmean((h - mean) ** 2, "i")
        return torch.tanh((h - mean) / torch.sqrt(var + 1e-5)) @ w2

    return f


def timed(fn: Callable[[], None], inner: int) -> float:
    """Seconds per call of ``inner`` calls after a barrier, the slowest rank's."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    elapsed = torch.tensor([(time.perf_counter() - start) / inner])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def measure(args: argparse.Namespace) -> None:
    """Every rank: time the variants, interleaved; rank 0 prints the table."""
    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(32, 64, generator=g) / 6, torch.randn(64, 8, generator=g) / 8
    x = torch.randn(args.batch, 32, generator=g).requires_grad_()
    f = make_f(w1, w2)
    compiled = torch.compile(f, fullgraph=True, backend=args.backend)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    t1, t2 = torch.randn(32, 64, generator=g) / 6, torch.randn(64, 32, generator=g) / 8

    def block(v: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return cm.psum(torch.tanh(v @ a) @ b, "tp")

    megatron = cm.shard_map(block, mesh=mesh, in_specs=(P(), P(None, "tp"), P("tp", None)), out_specs=P())
    mlp_block = torch.compile(megatron, fullgraph=True, backend=args.backend)
    variants = {
        "eager batched": cm.cmap(f, axis_name="i", mode="batched"),
        "compiled f, batched": cm.cmap(compiled, axis_name="i", mode="batched"),
        "compile(cmap)": torch.compile(cm.cmap(f, axis_name="i", mode="batched"), backend=args.backend),
        "eager vmap": cm.cmap(f, axis_name="i"),
        "compiled f, vmap": cm.cmap(compiled, axis_name="i"),
        "compile(cmap) fullgraph": torch.compile(cm.cmap(f, axis_name="i"), fullgraph=True, backend=args.backend),
        "eager shard_map": lambda v: megatron(v, t1, t2),
        "compile(shard_map) fullgraph": lambda v: mlp_block(v, t1, t2),
    }
    reference = {
        "compile(shard_map) fullgraph": "eager shard_map",
        "compiled f, batched": "eager batched",
        "compile(cmap)": "eager batched",
        "compiled f, vmap": "eager vmap",
        "compile(cmap) fullgraph": "eager vmap",
    }

    def step(fn: Callable) -> Callable[[], None]:
        def run() -> None:
            fn(x).square().sum().backward()
            x.grad = None

        return run

    first, times = {}, {name: [] for name in variants}
    want = {ref: variants[ref](x).detach() for ref in ("eager batched", "eager shard_map")}
    for name, fn in variants.items():
        first[name] = timed(step(fn), 1)
        ref = "eager shard_map" if "shard_map" in name else "eager batched"
        assert torch.allclose(fn(x).detach(), want[ref], atol=1e-5), name
    names = list(variants)
    for rep in range(args.reps):
        for k in range(len(names)):  # the starting variant rotates
            name = names[(rep + k) % len(names)]
            times[name].append(timed(step(variants[name]), args.inner))
    if rank == 0:
        print(f"world {size}, batch {args.batch}, backend {args.backend}, {args.reps} repetitions of {args.inner}")
        print(f"{'variant':<26}{'median us':>12}{'range us':>20}{'ratio':>8}{'ratio range':>14}{'first call ms':>16}")
        for name in names:
            med = statistics.median(times[name]) * 1e6
            lo, hi = min(times[name]) * 1e6, max(times[name]) * 1e6
            ref = reference.get(name)
            # each repetition's own ratio (the variants are interleaved, so a repetition shares the machine's load)
            ratios = [t / r for t, r in zip(times[name], times[ref])] if ref else [1.0]
            ratio = med / (statistics.median(times[ref]) * 1e6) if ref else 1.0
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
            print(
                f"{name:<26}{med:>12.0f}{f'{lo:.0f}-{hi:.0f}':>20}{ratio:>8.2f}{spread:>14}{first[name] * 1e3:>16.0f}"
            )


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Parse the command line and run :func:`measure` on a fresh gloo world."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 repetitions of 2 calls")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.inner = 3, 2
    # no pool of compile workers per rank; torch's default process-group timeout (compiling can take minutes)
    world.spawn(measure, args.world, (args,), timeout_s=None, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})


if __name__ == "__main__":
    main()
