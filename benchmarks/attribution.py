"""Where cmap's time goes: ``cProfile`` of repeated cmap calls inside every rank, split from the profile's caller
edges into time in torch.distributed, in torch.vmap, in what cmap calls, and cmap's own Python; beside it the
hand-written baseline's phases, timed by hand. Nothing in the package is patched."""

import cProfile
import os
import pstats
import statistics
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch.distributed as dist

import colossalai_cmap
from benchmarks import cases
from benchmarks.baselines import PHASES, Baseline
from benchmarks.cases import Case
from benchmarks.measure import allgather_obj, barrier

PACKAGE_DIR = os.path.dirname(os.path.abspath(colossalai_cmap.__file__)) + os.sep
# Where a profiled cmap call's time goes (keys of results.json's "breakdown_us"):
#   collectives: inside torch.distributed (issuing the collectives and waiting for them; its group queries too);
#   vmap: inside torch.vmap, the per-example function included (defined in cases.py);
#   calls_out: in the other functions that cmap's code calls (torch ops, pytree, builtins);
#   own: the package's own Python (the own time of every function in colossalai_cmap);
#   unattributed: what is left (cProfile's rounding; about 0).
PARTS = ("collectives", "vmap", "calls_out", "own", "unattributed")
CASES_FILE = os.path.abspath(cases.__file__)  # the per-example functions: their time is the vmap part


def _in_package(key: Tuple[str, int, str]) -> bool:
    return key[0] != "~" and os.path.abspath(key[0]).startswith(PACKAGE_DIR)


def _part(key: Tuple[str, int, str]) -> str:
    """The part of the call a function outside the package belongs to, judged by its file and name."""
    path, name = key[0].replace(os.sep, "/"), key[2]
    if "/torch/distributed/" in path or "_distributed_c10d" in name:
        return "collectives"
    if "/torch/_functorch/" in path or os.path.abspath(key[0]) == CASES_FILE:
        return "vmap"
    return "calls_out"


def _where(key: Tuple[str, int, str]) -> str:
    """``name (file)``, the file relative to the package's parent folder; builtins by their name. No line numbers:
    they change with every edit, and the report is read beside the code."""
    path, _, name = key
    if path == "~":
        return name
    if _in_package(key):
        path = os.path.relpath(path, os.path.dirname(PACKAGE_DIR.rstrip(os.sep)))
    else:
        path = os.path.basename(path)
    return f"{name} ({path})"


def _profile_calls(fn: Callable, args: Sequence[Any], calls: int) -> Tuple[pstats.Stats, Tuple[str, int, str], float]:
    """cProfile ``calls`` calls ``fn(*args)`` made from one loop function; returns the stats, the loop's key in them
    and the wall seconds per call under the profiler."""

    def loop() -> None:
        for _ in range(calls):
            fn(*args)

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(loop)
    wall = (time.perf_counter() - t0) / calls
    stats = pstats.Stats(prof)
    code = loop.__code__
    root = next(k for k in stats.stats if k[0] == code.co_filename and k[1] == code.co_firstlineno)
    return stats, root, wall


def _breakdown(stats: pstats.Stats, root: Tuple[str, int, str]) -> Tuple[float, Dict[str, float]]:
    """Split the profiled calls' time into :data:`PARTS` (seconds in all), from the profile's caller edges.

    Returns:
        (total seconds inside the cmap calls, seconds per part).
    """
    parts = dict.fromkeys(PARTS, 0.0)
    total = 0.0
    for key, (_, _, own, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        inside = _in_package(key)
        if inside:
            parts["own"] += own
        for caller, edge in callers.items():
            cum = edge[3]
            if caller == root:
                total += cum  # the cmap call itself
            elif inside and not _in_package(caller):
                parts[_part(caller)] -= cum  # package code run under a call out (a generator under any(), ...)
            elif not inside and _in_package(caller):
                parts[_part(key)] += cum
    parts["unattributed"] = total - sum(parts.values())
    return total, parts


def _calls_made(stats: pstats.Stats, root: Tuple[str, int, str], calls: int) -> Dict[str, float]:
    """Function calls per cmap call, as cProfile counts them (Python functions and builtins alike): in all, and of
    the package's own functions. Unlike the times, the counts do not depend on the machine's load."""
    every = package = 0
    for key, (_, nc, _, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if key == root or key[2] == "<method 'disable' of '_lsprof.Profiler' objects>":
            continue  # the profiling loop itself
        every += nc
        package += nc if _in_package(key) else 0
    return {"all": every / calls, "package": package / calls}


def _top(
    stats: pstats.Stats, root: Tuple[str, int, str], calls: int, total: float, *, n: int, key: str, package_only: bool
) -> List[Dict[str, Any]]:
    """The ``n`` functions with the most own (``key="own"``) or cumulative time, per cmap call."""
    rows = []
    for fkey, (_, nc, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        if package_only and not _in_package(fkey):
            continue
        if fkey == root or fkey[2] == "<method 'disable' of '_lsprof.Profiler' objects>":
            continue  # the profiling loop itself
        rows.append(
            {
                "function": _where(fkey),
                "in_package": _in_package(fkey),
                "calls_per_call": nc / calls,
                "own_us": own / calls * 1e6,
                "cum_us": cum / calls * 1e6,
                "own_pct": 100 * own / total if total else float("nan"),
                "cum_pct": 100 * cum / total if total else float("nan"),
            }
        )
    rows.sort(key=lambda r: -r[f"{key}_us"])
    return rows[:n]


def profile_case(case: Case, calls: int) -> Dict[str, Any]:
    """Where cmap's time goes for one case: unprofiled totals of cmap and the baseline (with the baseline's phases),
    then a ``cProfile`` of ``calls`` cmap calls on every rank (each rank profiles its own process; nothing is
    patched). Returns every rank's figures on rank 0 (``{}`` on the other ranks)."""
    from colossalai import cmap

    rank, world = dist.get_rank(), dist.get_world_size()
    args = case.inputs()
    cm = cmap(case.func, in_dims=case.in_dims)
    base = Baseline(case.func, case.in_dims, case.batch)
    for _ in range(2):
        cm(*args)
        base(*args)
    mine = _unprofiled(cm, base, args, calls)
    # the cProfile of the same calls (every rank profiles its own; the ranks stay in step, call by call)
    barrier()
    with colossalai_cmap.record_collectives() as log:
        stats, root, wall = _profile_calls(cm, args, calls)
    last = cm.stats
    total, parts = _breakdown(stats, root)
    mine.update(
        {
            "profiled_us": total / calls * 1e6,
            "profiled_wall_us": wall * 1e6,
            "breakdown_us": {k: v / calls * 1e6 for k, v in parts.items()},
            "breakdown_pct": {k: 100 * v / total if total else float("nan") for k, v in parts.items()},
            "function_calls_per_call": _calls_made(stats, root, calls),
            "collectives_per_call": log.count / calls,
            "collective_bytes_per_call": log.bytes / calls,
            "last_call": {"ops": list(last.ops), "bytes": last.bytes, "fast_path": last.fast_path, "sizes": last.sizes},
            "package_by_cumulative": _top(stats, root, calls, total, n=16, key="cum", package_only=True),
            "package_by_own": _top(stats, root, calls, total, n=12, key="own", package_only=True),
            "cprofile_top": _top(stats, root, calls, total, n=22, key="own", package_only=False),
        }
    )
    everyone = allgather_obj(mine)
    return {"case": case.name, "P": world, "calls": calls, "per_rank": everyone} if rank == 0 else {}


def _unprofiled(cm: Callable, base: Baseline, args: Sequence[Any], calls: int) -> Dict[str, Any]:
    """Unprofiled cmap and baseline calls, interleaved in blocks: the medians per call and the baseline's phases."""
    plain, hand = [], []
    samples: Dict[str, List[float]] = {phase: [] for phase in PHASES}
    blocks = 5 if calls > 10 else 3 if calls > 2 else 2
    for _ in range(blocks):
        barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            cm(*args)
        plain.append((time.perf_counter() - t0) / calls)
        barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            for phase, dt in zip(PHASES, base.timed_phases(args)):
                samples[phase].append(dt)
        hand.append((time.perf_counter() - t0) / calls)
    return {
        "cmap_us": statistics.median(plain) * 1e6,
        "baseline_us": statistics.median(hand) * 1e6,
        "baseline_phases_us": {k: statistics.median(v) * 1e6 for k, v in samples.items()},
    }
