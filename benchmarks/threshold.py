"""Where carrying the rows in the status round stops paying: cmap's two ways of gathering a repeated call's output,
side by side in one world, at sizes around the threshold between them.

A repeated call whose output goes to every rank carries its rows in its status round (one collective) up to
``FUSE_BYTES`` received in all (4 MiB); past it, it issues its status round and one all_gather of the rows straight
into the result together (two collectives), because cutting the rows out of the round's buffer costs more there.
Here two cmaps of the same function run on groups of their own, one whose rounds carry rows at every size measured
(``rows in the round``) and one whose rounds carry none (``round + all_gather``), interleaved with the hand-written
baseline. A group's rounds read the threshold (``colossalai_cmap.wire.link.FUSE_BYTES``) when they are first set
up, so it is set around each group's first call, alike on every rank: the one place the benchmarks reach past the
package's public API, since no public setting picks the way at a given size.
"""

import statistics
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

import colossalai_cmap
from benchmarks.baselines import Baseline
from benchmarks.cases import elementwise
from benchmarks.measure import allgather_obj, timed_block
from colossalai_cmap.wire import link

SIZES_MIB = (1, 2, 4, 6, 8)  # output of the whole batch: rows of 256 float32 (1 KiB each)
REPS, INNER = 15, 3
VARIANTS = ("baseline", "rows in the round", "round + all_gather")


def bench_threshold(reps: int = REPS) -> List[Dict[str, Any]]:
    """Time both ways and the baseline at each of :data:`SIZES_MIB`; rank 0 returns one row per size (``[]`` on the
    others): medians of the block times (max over ranks), the ratios to the baseline, each way's collectives per
    call, and ``fused / two``, the median over repetitions of the per-repetition ratio of the two ways."""
    world = dist.get_world_size()
    largest = max(SIZES_MIB) << 20
    fused = _cmap_with_threshold(2 * largest + (1 << 20))  # every size's rows and headers fit in its rounds
    two = _cmap_with_threshold(0)  # no rows ride: the rounds carry the status alone
    rows = []
    for mib in SIZES_MIB:
        x = torch.randn(mib * 1024, 256, generator=torch.Generator().manual_seed(1234))
        base = Baseline(elementwise, 0, x.shape[0])
        fns: Dict[str, Callable[[], Any]] = {
            "baseline": lambda: base(x),
            "rows in the round": lambda: fused(x),
            "round + all_gather": lambda: two(x),
        }
        if not (torch.equal(fused(x), base(x)) and torch.equal(two(x), base(x))):
            raise AssertionError(f"threshold benchmark: the two ways disagree with the baseline at {mib} MiB")
        for name in VARIANTS:  # warm-up: the rounds learn the size (a transition seen twice)
            for _ in range(3):
                fns[name]()
        times: Dict[str, List[float]] = {name: [] for name in VARIANTS}
        for rep in range(reps):
            for k in range(len(VARIANTS)):
                name = VARIANTS[(rep + k) % len(VARIANTS)]
                times[name].append(max(allgather_obj(timed_block(fns[name], INNER)[0])))
        med = {name: statistics.median(v) for name, v in times.items()}
        collectives = {"rows in the round": _collectives(fused, x), "round + all_gather": _collectives(two, x)}
        rows.append(
            {
                "P": world,
                "out_bytes": x.numel() * x.element_size(),
                "times_ms": {name: round(t * 1e3, 3) for name, t in med.items()},
                "ratios": {name: round(med[name] / med["baseline"], 3) for name in VARIANTS[1:]},
                "fused/two": round(
                    statistics.median(a / b for a, b in zip(times["rows in the round"], times["round + all_gather"])),
                    3,
                ),
                "collectives_per_call": collectives,
            }
        )
    return rows if dist.get_rank() == 0 else []


def _cmap_with_threshold(fuse_bytes: int) -> Callable[..., Any]:
    """A cmap of the elementwise case on a group of its own, whose rounds carry rows up to ``fuse_bytes`` received
    in all (its first call is made here, where the group's rounds are set up)."""
    group = dist.new_group(list(range(dist.get_world_size())))
    f = colossalai_cmap.cmap(elementwise, group=group)
    kept, link.FUSE_BYTES = link.FUSE_BYTES, fuse_bytes
    try:
        f(torch.zeros(dist.get_world_size(), 256))
    finally:
        link.FUSE_BYTES = kept
    return f


def _collectives(f: Any, x: torch.Tensor) -> int:
    f(x)
    return f.stats.collectives
