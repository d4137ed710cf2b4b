"""What every rank of one world runs: the cost of its collectives alone (``machine.collective_cpu``), the chosen
cases' timings, the threshold between cmap's two ways of gathering (``threshold.py``), then the overhead profiles,
then the memory checks.

``run_world`` is the target that ``run.py`` spawns in each world (see ``world.spawn``).
"""

import time
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

from benchmarks.attribution import profile_case
from benchmarks.cases import CASES
from benchmarks.machine import collective_cpu
from benchmarks.measure import mmap_large_allocations
from benchmarks.memory import bench_chunk, bench_memory, bench_zero_copy
from benchmarks.threshold import REPS, bench_threshold
from benchmarks.timing import bench_time

SECTIONS = ("collective_cpu", "timing", "threshold", "memory", "zero_copy", "chunk", "profile")  # results.json lists


@dataclass(frozen=True)
class Config:
    """What the suite measures (the same for every world).

    Attributes:
        cases: the case names.
        p1_cases: the cases also run in a world of one process.
        reps_scale: scales every case's repetitions.
        min_reps: the fewest repetitions per case.
        quick: the smoke test's profile lengths (``Case.profile_calls``).
        profile: profile where cmap's overhead goes.
        memory: run the memory checks (worlds of P >= 2).
        threshold: time cmap's two ways of gathering output around the size between them (worlds of P >= 2).
    """

    cases: Tuple[str, ...]
    p1_cases: Tuple[str, ...]
    reps_scale: float = 1.0
    min_reps: int = 10
    quick: bool = False
    profile: bool = True
    memory: bool = True
    threshold: bool = True


def run_world(config: Config) -> Dict[str, Any]:
    """Run the suite on this rank; rank 0 returns the results (one list per :data:`SECTIONS` entry)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    names = config.cases if world > 1 else [n for n in config.cases if n in config.p1_cases]
    cases = [c for c in CASES if c.name in names]  # in the order of CASES
    results: Dict[str, Any] = {key: [] for key in SECTIONS}
    if world > 1:  # what the world's collectives alone cost the host, before anything else ran in it
        results["collective_cpu"].append(collective_cpu())
    for case in cases:
        t0 = time.time()
        r = bench_time(case, config.reps_scale, config.min_reps)
        if rank == 0:
            results["timing"].append(r)
            print(f"  [P={world}] {case.name:7s} timed in {time.time() - t0:5.1f} s", flush=True)
    if world > 1 and config.threshold:
        t0 = time.time()
        results["threshold"] += bench_threshold(3 if config.quick else REPS)
        if rank == 0:
            print(f"  [P={world}] threshold timed in {time.time() - t0:5.1f} s", flush=True)
    if config.profile:
        for case in cases:
            if case.profile_calls is not None:
                r = profile_case(case, calls=case.profile_calls[1 if config.quick else 0])
                if rank == 0:
                    results["profile"].append(r)
    if config.memory and world > 1:
        mmap_large_allocations()
        for case in cases:
            if case.memory:
                results["memory"] += bench_memory(case)
        results["zero_copy"].append(bench_zero_copy())
        results["chunk"] += bench_chunk()
        if rank == 0:
            print(f"  [P={world}] memory checks done", flush=True)
    return results if rank == 0 else {}
