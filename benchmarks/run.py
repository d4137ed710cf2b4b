"""cmap against hand-written torch.distributed code and against single-process ``torch.vmap``, as ratios measured
side by side in one run.

    python -m benchmarks.run            # make bench: writes benchmarks/results.json, renders docs/performance.md
    python -m benchmarks.run --quick    # smoke test: a few repetitions, everything written to a temporary folder

It launches its own gloo worlds of P = 2 and P = 4 processes on 127.0.0.1 (and a world of one process for the small
cases, which isolates cmap's software overhead), one thread per rank, prints a summary, writes results.json and
renders the report (``render.py``). What each world runs is ``suite.py``; how time and memory are measured is
written into results.json (``timing.TIMING_METHOD``, ``measure.MEMORY_METHOD``) and into the report.

What cmap sends: every call makes one status round, an all_gather of a 48-byte header plus a payload per rank (256
bytes at first, growing to what calls on the group needed, up to 1 KiB, alike on every rank). Outputs that fit in the
payload ride in it (one collective per call); larger outputs take a second collective (with ``dst=-1``, one
all_gather of the padded rows straight into the result buffer, issued right behind the round when the call repeats).
cmap runs with its defaults (no ``timeout=``, as most users call it); the process groups have a 180 s timeout, so a
benchmark bug fails within minutes instead of hanging.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Sequence

from benchmarks import machine, paths, world
from benchmarks.cases import CASES
from benchmarks.measure import MEMORY_METHOD
from benchmarks.suite import SECTIONS, Config, run_world
from benchmarks.summary import format_memory, format_table
from benchmarks.timing import TIMING_METHOD


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """The command line; with ``--quick``, ``out`` and ``docs`` default to a new temporary folder."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes (default 1,2,4)")
    p1 = ",".join(c.name for c in CASES if c.in_p1)
    parser.add_argument(
        "--p1-cases",
        default=p1,
        help="cases also run in a world of one process, where the collectives cost almost nothing and cmap's own "
        f"software overhead shows (default {p1})",
    )
    parser.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    parser.add_argument("--reps-scale", type=float, default=1.0, help="scale repetitions (never below 10)")
    parser.add_argument("--no-profile", action="store_true", help="skip the overhead profile")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory checks")
    parser.add_argument(
        "--no-threshold", action="store_true", help="skip timing cmap's two ways of gathering around the threshold"
    )
    parser.add_argument("--no-render", action="store_true", help="do not render docs/performance.md")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: every case with 3 repetitions and a short profile; results.json and the rendered docs go "
        "to a new temporary folder unless --out or --docs name one (never the committed ones by default)",
    )
    parser.add_argument(
        "--out", default=None, help="results file (default benchmarks/results.json; with --quick, a temporary one)"
    )
    parser.add_argument(
        "--docs",
        default=None,
        help="where to render performance.md and img/ (default docs/; with --quick, next to --out)",
    )
    opts = parser.parse_args(argv)
    unknown = set(opts.cases.split(",")) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; the cases are {[c.name for c in CASES]}")
    if opts.quick:
        scratch = tempfile.mkdtemp(prefix="cmap-bench-quick-")
        opts.out = opts.out or os.path.join(scratch, "results.json")
        opts.docs = opts.docs or os.path.join(os.path.dirname(os.path.abspath(opts.out)), "docs")
    opts.out = opts.out or str(paths.RESULTS)
    opts.docs = opts.docs or str(paths.DOCS)
    return opts


def config_of(opts: argparse.Namespace) -> Config:
    """What every world measures, from the command line."""
    return Config(
        cases=tuple(opts.cases.split(",")),
        p1_cases=tuple(opts.p1_cases.split(",")),
        reps_scale=0.0 if opts.quick else opts.reps_scale,
        min_reps=3 if opts.quick else 10,
        quick=opts.quick,
        profile=not opts.no_profile,
        memory=not opts.no_memory,
        threshold=not opts.no_threshold,
    )


def meta_of(opts: argparse.Namespace, worlds: List[int]) -> Dict[str, Any]:
    """results.json's ``meta``: when, on what machine and software, and how it was measured."""
    for key, value in world.SINGLE_THREADED.items():
        os.environ.setdefault(key, value)  # what the ranks will run with (spawn sets the same defaults)
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        **machine.describe(worlds),
        "worlds": worlds,
        "backend": f"gloo on {world.LOCALHOST}, CPU tensors, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
        "torch.set_num_threads(1)",
        "timing_method": TIMING_METHOD,
        "memory_method": MEMORY_METHOD,
        "quick": opts.quick,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run every world, write results.json, print the summary and render the report."""
    opts = parse_args(argv)
    config, worlds = config_of(opts), [int(w) for w in opts.worlds.split(",")]
    results: Dict[str, Any] = {"meta": meta_of(opts, worlds), **{key: [] for key in SECTIONS}}
    started = time.time()
    for size in worlds:
        print(f"world of {size} processes (gloo, {world.LOCALHOST})", flush=True)
        part = world.spawn(run_world, size, (config,))[0]
        for key in SECTIONS:
            results[key] += part[key]
    results["meta"]["wall_s"] = round(time.time() - started, 1)
    results["meta"]["load_average_at_end"] = list(os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    with open(opts.out, "w") as f:
        json.dump(results, f, indent=1)
    print()
    print("time: median over repetitions of (max over ranks of the block time / calls per block); ratios of medians")
    print(format_table(results["timing"]))
    if results["memory"]:
        print()
        print("peak memory of one call above the level before it (rss: all threads; torch: this thread's allocations)")
        print(format_memory(results["memory"]))
    print(f"\nwrote {opts.out} ({results['meta']['wall_s']} s)")
    if not opts.no_render:
        from benchmarks import render  # needs matplotlib (the bench extra)

        print(f"rendered {render.render(opts.out, opts.docs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
