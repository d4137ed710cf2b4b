"""torch.compile and cmap side by side: the three ways to combine them, timed in one run on a gloo world.

    python benchmarks/compile.py [--world 2] [--backend aot_eager] [--batch 64]

The function is a per-example MLP whose hidden activations are normalised over the whole global batch (``pmean``
of the mean and of the variance: two collectives per call), with a backward. Variants, interleaved in every
repetition:

* ``eager batched``: ``cmap(f, mode="batched")``, the reference.
* ``compiled f, batched``: ``cmap(torch.compile(f, fullgraph=True), mode="batched")``: func is one graph, its
  collectives functional collectives.
* ``compile(cmap)``: ``torch.compile(cmap(f, mode="batched"))``: cmap's orchestration runs eagerly (a graph break).
* ``eager vmap`` and ``compiled f, vmap``: mode "vmap" maps the original function of a compiled f.

It prints the median time per call (max over ranks) and each variant's ratio to its eager reference, and the first
call's time (the compile). With ``aot_eager`` (the CPU default here) the graph runs the same ops, so the ratios
show what the orchestration costs, not what a code generator would gain.
"""

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import colossalai_cmap as cm  # noqa: E402


def make_f(w1: torch.Tensor, w2: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(x: torch.Tensor) -> torch.Tensor:
        h = x @ w1
        mean = cm.pmean(h, "i")
        var = cm.pmean((h - mean) ** 2, "i")
        return torch.tanh((h - mean) / torch.sqrt(var + 1e-5)) @ w2

    return f


def _timed(fn: Callable[[], None], inner: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    elapsed = torch.tensor([(time.perf_counter() - start) / inner])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(32, 64, generator=g) / 6, torch.randn(64, 8, generator=g) / 8
    x = torch.randn(args.batch, 32, generator=g).requires_grad_()
    f = make_f(w1, w2)
    compiled = torch.compile(f, fullgraph=True, backend=args.backend)
    variants = {
        "eager batched": cm.cmap(f, axis_name="i", mode="batched"),
        "compiled f, batched": cm.cmap(compiled, axis_name="i", mode="batched"),
        "compile(cmap)": torch.compile(cm.cmap(f, axis_name="i", mode="batched"), backend=args.backend),
        "eager vmap": cm.cmap(f, axis_name="i"),
        "compiled f, vmap": cm.cmap(compiled, axis_name="i"),
    }
    reference = {
        "compiled f, batched": "eager batched",
        "compile(cmap)": "eager batched",
        "compiled f, vmap": "eager vmap",
    }

    def step(fn: Callable) -> Callable[[], None]:
        def run() -> None:
            fn(x).square().sum().backward()
            x.grad = None

        return run

    first, times = {}, {name: [] for name in variants}
    want = variants["eager batched"](x).detach()
    for name, fn in variants.items():
        first[name] = _timed(step(fn), 1)
        assert torch.allclose(fn(x).detach(), want, atol=1e-5), name
    names = list(variants)
    for rep in range(args.reps):
        for k in range(len(names)):  # the starting variant rotates
            name = names[(rep + k) % len(names)]
            times[name].append(_timed(step(variants[name]), args.inner))
    if rank == 0:
        print(f"world {world}, batch {args.batch}, backend {args.backend}, {args.reps} repetitions of {args.inner}")
        print(f"{'variant':<22}{'median us':>12}{'range us':>20}{'ratio':>8}{'first call ms':>16}")
        for name in names:
            med = statistics.median(times[name]) * 1e6
            lo, hi = min(times[name]) * 1e6, max(times[name]) * 1e6
            ref = reference.get(name)
            ratio = med / (statistics.median(times[ref]) * 1e6) if ref else 1.0
            print(f"{name:<22}{med:>12.0f}{f'{lo:.0f}-{hi:.0f}':>20}{ratio:>8.2f}{first[name] * 1e3:>16.0f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--inner", type=int, default=20)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no pool of compile workers per rank
    mp.spawn(_worker, args=(args.world, port, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
