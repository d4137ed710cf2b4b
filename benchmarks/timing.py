"""Timing one case: cmap and its baselines, interleaved in repetitions of timed blocks, as medians and ratios."""

import statistics
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

import colossalai_cmap
from benchmarks.baselines import Baseline
from benchmarks.cases import Case
from benchmarks.goals import goal_for
from benchmarks.measure import allgather_obj, max_diff, timed_block

VARIANTS = ("cmap", "baseline", "baseline+status", "fused_header", "gather_only", "vmap_full", "vmap_shard")
RANK0_ONLY = ("vmap_full", "vmap_shard")  # timed on rank 0 while the others wait in the block's barrier

# How time is measured, written into results.json (``meta.timing_method``) and rendered into the report.
TIMING_METHOD = (
    "* Every case runs these variants, interleaved inside each repetition (the starting variant rotates per "
    "repetition): `cmap` (`dst=-1`, `src=None`); `baseline` (narrow the shard, `torch.vmap`, one "
    "`all_gather_into_tensor` into an output allocated for that call; uneven B: pad the send to the largest shard "
    "and cut the padding out with one `torch.cat` of views); `baseline+status` (the baseline plus one int64 "
    "all_gather of a 5-field header and a `.tolist()`, i.e. what a second, small status collective costs); "
    "`fused_header` (one all_gather of a 48-byte int64 header and the padded rows packed into one byte buffer, the "
    "header table read back and the rows cut out with one `torch.cat`: the leanest one-collective design that still "
    "carries every rank's status); `gather_only` (only the baseline's communication, of a precomputed shard); "
    "`vmap_full` (single-process `torch.vmap` on the whole batch, timed on rank 0 while the other ranks wait in a "
    "barrier, which costs no CPU on gloo) and `vmap_shard` (`torch.vmap` on rank 0's shard alone, same protocol).\n"
    "* One timed block = `dist.barrier()`, then `inner` back-to-back calls timed with `time.perf_counter` on every "
    "rank; the block time is the maximum over ranks, divided by `inner`. The reported time is the median over the "
    "repetitions (after warm-up blocks that are not timed).\n"
    "* Ratios are ratios of those medians; `paired` ratios (the median over repetitions of the per-repetition ratio) "
    "are in results.json too.\n"
    "* CPU time is measured alongside: `time.process_time` (this process, all its threads, gloo's included) over the "
    "same block, summed over ranks; its median gives a ratio that other jobs on the machine disturb much less than "
    "wall time (it misses time spent waiting for a peer, so it is a complement, not the goal's measure)."
)


def bench_time(case: Case, reps_scale: float, min_reps: int = 10) -> Dict[str, Any]:
    """Time the variants of one case, interleaved; returns per-variant medians (max over ranks) and ratios on rank 0
    (``{}`` on the other ranks)."""
    rank = dist.get_rank()
    args = case.inputs()
    reps = max(min_reps, int(round(case.reps * reps_scale)))
    fns, check, local = _variants(case, args)
    variants = VARIANTS + case.extras
    for _ in range(2 if case.inner > 1 else 1):  # warm-up, untimed
        for name in variants:
            timed_block(fns[name], case.inner, name not in RANK0_ONLY or rank == 0)
    times: Dict[str, List[float]] = {name: [] for name in variants}
    cpu: Dict[str, List[float]] = {name: [] for name in variants}
    with colossalai_cmap.record_collectives() as log:  # only the cmap variant issues cmap's collectives
        for rep in range(reps):
            for k in range(len(variants)):
                name = variants[(rep + k) % len(variants)]
                wall, used = timed_block(fns[name], case.inner, name not in RANK0_ONLY or rank == 0)
                times[name].append(wall)
                cpu[name].append(used)
    collectives = log.count / (reps * case.inner)
    per_rank, per_rank_cpu, checks = allgather_obj(times), allgather_obj(cpu), allgather_obj(check)
    if rank != 0:
        return {}
    result: Dict[str, Any] = {
        "case": case.name,
        "description": case.description,
        "P": dist.get_world_size(),
        "batch": case.batch,
        "out_bytes": int(local.element_size() * local[0].numel() * case.batch) if local.numel() else 0,
        "inner": case.inner,
        "reps": reps,
        "collectives_per_call": collectives,
        "max_abs_diff": max(max(c.values()) for c in checks),
    }
    result.update(_summary(variants, reps, per_rank, per_rank_cpu))
    result["goal"] = goal = goal_for(case.small_goal, result["P"], result["out_bytes"])
    result["pass"] = None if goal is None else result["ratios"]["cmap/baseline"] <= goal
    return result


def _variants(
    case: Case, args: Sequence[torch.Tensor]
) -> Tuple[Dict[str, Callable[[], Any]], Dict[str, float], torch.Tensor]:
    """The timed callables by variant name, the correctness check (cmap == baseline == single-process vmap, each
    rank checking its own copy) and this rank's shard of the output."""
    from colossalai import cmap

    cm = cmap(case.func, in_dims=case.in_dims)
    base = Baseline(case.func, case.in_dims, case.batch)
    base_status = Baseline(case.func, case.in_dims, case.batch, status=True)
    base_ceil = Baseline(case.func, case.in_dims, case.batch, ceil_plan=True)
    base_fused = Baseline(case.func, case.in_dims, case.batch, fused=True)
    vf = torch.vmap(case.func, case.in_dims)
    local = base.compute(args)
    shard0 = Baseline(case.func, case.in_dims, case.batch)
    shard0.rows, shard0.offset = shard0.sizes[0], 0
    fns: Dict[str, Callable[[], Any]] = {
        "cmap": lambda: cm(*args),
        "baseline": lambda: base(*args),
        "baseline+status": lambda: base_status(*args),
        "fused_header": lambda: base_fused(*args),
        "gather_only": lambda: base.communicate(local),
        "vmap_full": lambda: vf(*args),
        "vmap_shard": lambda: shard0.compute(args),
        "baseline_ceil_plan": lambda: base_ceil(*args),
    }
    got, ref, single = cm(*args), base(*args), vf(*args)
    check = {
        "cmap_vs_vmap_maxabs": max_diff(got, single),
        "baseline_vs_vmap_maxabs": max_diff(ref, single),
        "fused_header_vs_vmap_maxabs": max_diff(base_fused(*args), single),
    }
    if case.extras:
        check["baseline_ceil_plan_vs_vmap_maxabs"] = max_diff(base_ceil(*args), single)
    return fns, check, local


def _summary(
    variants: Sequence[str], reps: int, per_rank: List[Dict[str, List[float]]], per_rank_cpu: List[Dict[str, Any]]
) -> Dict[str, Any]:
    """``times`` (per variant: median, quartiles and minimum of the block time, the maximum over ranks; the per-rank
    medians; the median CPU time summed over ranks) and ``ratios``."""
    block_max = {name: [max(r[name][i] for r in per_rank) for i in range(reps)] for name in variants}
    times: Dict[str, Any] = {}
    for name in variants:
        xs = sorted(block_max[name])
        times[name] = {
            "median_s": statistics.median(xs),
            "q1_s": xs[len(xs) // 4],
            "q3_s": xs[(3 * len(xs)) // 4],
            "min_s": xs[0],
            "per_rank_median_s": [statistics.median(r[name]) for r in per_rank],
            "cpu_sum_median_s": statistics.median(sum(r[name][i] for r in per_rank_cpu) for i in range(reps)),
        }
    med = {name: times[name]["median_s"] for name in VARIANTS}

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(block_max[a], block_max[b]) if y > 0)

    ratios = {
        "cmap/baseline": med["cmap"] / med["baseline"],
        "cmap/vmap": med["cmap"] / med["vmap_full"],
        "baseline/vmap": med["baseline"] / med["vmap_full"],
        "(baseline+status)/baseline": med["baseline+status"] / med["baseline"],
        "cmap/(baseline+status)": med["cmap"] / med["baseline+status"],
        "fused_header/baseline": med["fused_header"] / med["baseline"],
        "paired cmap/baseline": paired("cmap", "baseline"),
        "min cmap/baseline": times["cmap"]["min_s"] / times["baseline"]["min_s"],
        "cpu cmap/baseline": times["cmap"]["cpu_sum_median_s"] / times["baseline"]["cpu_sum_median_s"],
        "paired cmap/vmap": paired("cmap", "vmap_full"),
    }
    return {"times": times, "ratios": ratios}
