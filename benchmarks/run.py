"""The colossalai-cmap benchmark suite: cmap against hand-written torch.distributed code and against single-process
``torch.vmap``, as ratios measured side by side in one run.

Run it as ``python benchmarks/run.py`` (``make bench``). It launches its own gloo worlds of P = 2 and P = 4 processes
on 127.0.0.1 (and a world of one process for the small cases, which isolates cmap's software overhead)
(``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``), prints a table, writes ``benchmarks/results.json`` and renders
``docs/performance.md`` with its plots (``benchmarks/render.py``). ``python benchmarks/run.py --quick`` is a smoke
test: every case with a few repetitions, its results and rendered docs written to a temporary folder.

What cmap sends: every call makes one status round, an all_gather of a 96-byte header plus a payload per rank (256
bytes at first, growing to what calls on the group needed, up to 1 MiB, alike on every rank). Outputs that fit in the
payload ride in it (one collective per call); larger outputs take a second collective (with ``dst=-1``, one
all_gather of the padded rows straight into the result buffer, issued right behind the round when the call repeats).

How time is measured (also written into results.json):

* Every case runs these variants, interleaved inside each repetition (the starting variant rotates per repetition):
  ``cmap`` (``dst=-1``, ``src=None``); ``baseline`` (narrow the shard, ``torch.vmap``, one
  ``all_gather_into_tensor`` into an output allocated for that call; uneven B: pad the send to the largest shard
  and cut the padding out with one ``torch.cat`` of views); ``baseline+status`` (the baseline plus one int64
  all_gather of a 5-field header and a ``.tolist()``, i.e. what a second, small status collective costs);
  ``fused_header`` (one all_gather of a 96-byte int64 header and the padded rows packed into one byte buffer, the
  header table read back and the rows cut out with one ``torch.cat``: the leanest one-collective design that still
  carries every rank's status); ``gather_only`` (only the baseline's communication, of a precomputed shard);
  ``vmap_full`` (single-process ``torch.vmap`` on the whole batch, timed on rank 0 while the other ranks wait in a
  barrier, which costs no CPU on gloo) and ``vmap_shard`` (``torch.vmap`` on rank 0's shard alone, same protocol).
* One timed block = ``dist.barrier()``, then ``inner`` back-to-back calls timed with ``time.perf_counter`` on every
  rank; the block time is the maximum over ranks, divided by ``inner``. The reported time is the median over the
  repetitions (after warm-up blocks that are not timed).
* Ratios are ratios of those medians; ``paired`` ratios (the median over repetitions of the per-repetition ratio)
  are in results.json too.
* CPU time is measured alongside: ``time.process_time`` (this process, all its threads, gloo's included) over the
  same block, summed over ranks; its median gives a ratio that other jobs on the machine disturb much less than
  wall time (it misses time spent waiting for a peer, so it is a complement, not the goal's measure).

Memory (for ``dst`` choices) is measured twice, because neither way sees everything:

* ``rss``: the process's peak resident set during one call (``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``) minus the resident set just before it, with glibc told to ``mmap`` every allocation of
  64 KiB or more (``mallopt``) so freed tensors leave the resident set. It counts every thread (gloo's too) and
  everything that was touched, at page granularity.
* ``torch``: the peak of the running sum of the allocation and free events that ``torch.profiler``
  (``profile_memory=True``) records on the calling thread, in exact bytes. It does not see allocations that gloo
  makes on its own worker threads.
"""

import argparse
import cProfile
import ctypes
import gc
import json
import math
import os
import platform
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, here and in the spawned ranks
os.environ.setdefault("MKL_NUM_THREADS", "1")
# cmap runs with its defaults (no timeout=, as most users call it); the process groups are created with a 180 s
# timeout, so a benchmark bug fails within minutes instead of hanging.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # benchmark this checkout's package, not some other installed copy

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import fmt_bytes, goal_for  # noqa: E402

import colossalai_cmap  # noqa: E402

VARIANTS = ("cmap", "baseline", "baseline+status", "fused_header", "gather_only", "vmap_full", "vmap_shard")
RANK0_ONLY = ("vmap_full", "vmap_shard")


# ---------------------------------------------------------------------------------------------------- functions
def elementwise(x: torch.Tensor) -> torch.Tensor:
    """An elementwise per-example function."""
    return torch.sin(x) + x


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """A per-example 2-layer MLP (weights shared by every example, ``in_dims=(0, None, None)``)."""
    return torch.relu(x @ w1) @ w2


def outer_activation(x: torch.Tensor) -> torch.Tensor:
    """A function with a large per-example intermediate (D x D) and a small output (D): for ``chunk_size``."""
    return torch.tanh(x[:, None] * x[None, :]).sum(0)


# -------------------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One benchmark case: how to build the full inputs (same on every rank), the function and its in_dims.

    Attributes:
        name: case name in the table.
        batch: B, the mapped batch size.
        func: the per-example function.
        in_dims: vmap in_dims.
        inner: calls per timed block.
        reps: timed repetitions (blocks per variant).
        memory: whether to measure peak memory for the ``dst`` choices.
        profile: whether to profile where cmap's overhead goes.
        extras: extra variants timed for this case only.
    """

    name: str
    batch: int
    func: Callable
    in_dims: Any
    inner: int
    reps: int
    memory: bool = False
    profile: bool = False
    extras: Tuple[str, ...] = ()

    def inputs(self) -> Tuple[torch.Tensor, ...]:
        """The full inputs, seeded so that every rank builds the same tensors."""
        g = torch.Generator().manual_seed(1234)
        if self.name == "tiny":
            return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
        if self.name == "medium":
            return (torch.randn(256, 256, generator=g),)
        if self.name == "large":
            return (torch.randn(4096, 4096, generator=g),)
        if self.name == "mlp":
            x = torch.randn(4096, 512, generator=g)
            return x, torch.randn(512, 512, generator=g) / 512**0.5, torch.randn(512, 512, generator=g) / 512**0.5
        if self.name == "uneven":
            return (torch.randn(4097, 256, generator=g),)
        raise KeyError(self.name)


CASES = (
    Case("tiny", 8, torch.dot, 0, inner=20, reps=40, profile=True),
    Case("medium", 256, elementwise, 0, inner=8, reps=30),
    Case("large", 4096, elementwise, 0, inner=1, reps=15, memory=True, profile=True),
    Case("mlp", 4096, mlp, (0, None, None), inner=2, reps=20, memory=True),
    Case("uneven", 4097, elementwise, 0, inner=4, reps=30, memory=True, profile=True, extras=("baseline_ceil_plan",)),
)
DESCRIPTIONS = {
    "tiny": "torch.dot, B=8, D=4",
    "medium": "sin(x)+x, B=256, D=256",
    "large": "sin(x)+x, B=4096, D=4096 (64 MiB out)",
    "mlp": "relu(x@W1)@W2, 512 wide, B=4096",
    "uneven": "sin(x)+x, B=4097, D=256",
}


# --------------------------------------------------------------------------------------------------- baseline
def shard_sizes(batch: int, world: int) -> List[int]:
    """The split ``torch.tensor_split`` makes: the first ``B % P`` ranks get one extra row."""
    q, r = divmod(batch, world)
    return [q + (1 if i < r else 0) for i in range(world)]


class Baseline:
    """Hand-written torch.distributed code for ``dst=-1``: narrow, ``torch.vmap``, one ``all_gather_into_tensor``.

    Args:
        func: the per-example function.
        in_dims: vmap in_dims (a flat tuple of 0/None, or an int).
        batch: B.
        status: also exchange a small int64 header first, as cmap's status exchange does.
        ceil_plan: shard as ``ceil(B / P)`` rows per rank with the remainder on the last ranks, instead of
            ``tensor_split``'s plan; then only short ranks pad and the first B rows of the gathered buffer are the
            result, returned as a view with no copy.
        fused: the leanest one-collective design that still tells every rank every other rank's status: a 96-byte
            int64 header (the size of cmap's) and the padded rows packed into one byte buffer, one all_gather, the
            header table read back, the rows cut out of the gathered blocks with one ``torch.cat``.
    """

    def __init__(
        self,
        func: Callable,
        in_dims: Any,
        batch: int,
        status: bool = False,
        ceil_plan: bool = False,
        fused: bool = False,
    ) -> None:
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.sizes = shard_sizes(batch, self.world)
        self.ceil_plan = ceil_plan
        if ceil_plan:
            cap = -(-batch // self.world)
            self.sizes = [min(max(batch - i * cap, 0), cap) for i in range(self.world)]
        self.rows, self.offset, self.cap = self.sizes[self.rank], sum(self.sizes[: self.rank]), max(self.sizes)
        self.even = len(set(self.sizes)) == 1
        self.in_dims, self.status, self.batch, self.fused = in_dims, status, batch, fused
        self.vf = torch.vmap(func, in_dims)

    def shard(self, args: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        dims = self.in_dims if isinstance(self.in_dims, tuple) else (self.in_dims,) * len(args)
        return [a if d is None else a.narrow(d, self.offset, self.rows) for a, d in zip(args, dims)]

    def compute(self, args: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.vf(*self.shard(args))

    def communicate(self, local: torch.Tensor) -> torch.Tensor:
        if self.status:
            header = torch.tensor([0, self.rows, 1, 1, self.batch], dtype=torch.int64)
            table = torch.empty(self.world * 5, dtype=torch.int64)
            dist.all_gather_into_tensor(table, header)
            table.tolist()
        shape, dtype = local.shape[1:], local.dtype
        if self.fused:
            return self._fused(local)
        if self.even:
            out = torch.empty((self.world * self.rows, *shape), dtype=dtype)
            dist.all_gather_into_tensor(out, local.contiguous())
            return out
        send = local
        if self.rows < self.cap:
            send = torch.empty((self.cap, *shape), dtype=dtype)
            send.narrow(0, 0, self.rows).copy_(local)
        buf = torch.empty((self.world * self.cap, *shape), dtype=dtype)
        dist.all_gather_into_tensor(buf, send.contiguous())
        if self.ceil_plan:
            return buf.narrow(0, 0, self.batch)
        return torch.cat([buf.narrow(0, r * self.cap, n) for r, n in enumerate(self.sizes)])

    def _fused(self, local: torch.Tensor) -> torch.Tensor:
        shape, dtype = local.shape[1:], local.dtype
        row = local[0].numel() * local.element_size() if self.rows else math.prod(shape) * dtype.itemsize
        head = 96  # 12 x int64, the size of cmap's status header
        send = torch.empty(head + self.cap * row, dtype=torch.uint8)
        send.numpy()[:head].view("int64")[:] = (1, 0, self.rows, 1, 1, self.batch, 1, self.cap * row, 0, 0, 0, 0)
        send.narrow(0, head, self.rows * row).view(dtype).view(local.shape).copy_(local)
        recv = torch.empty((self.world, send.numel()), dtype=torch.uint8)
        dist.all_gather_into_tensor(recv.view(-1), send)
        recv.numpy()[:, :head].view("int64").tolist()
        return torch.cat(
            [recv[r].narrow(0, head, n * row).view(dtype).view(n, *shape) for r, n in enumerate(self.sizes) if n]
        )

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return self.communicate(self.compute(args))


# ------------------------------------------------------------------------------------------------- worker side
def _barrier() -> None:
    dist.barrier()


def _timed_block(fn: Callable[[], Any], inner: int, active: bool = True) -> Tuple[float, float]:
    """Barrier, then ``inner`` calls of ``fn`` (if ``active`` on this rank).

    Returns:
        (wall seconds, CPU seconds of this process, all its threads) per call on this rank.
    """
    _barrier()
    if not active:
        return 0.0, 0.0
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(inner):
        out = fn()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    del out
    return dt / inner, dc / inner


def _allgather_obj(obj: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def bench_time(case: Case, reps_scale: float, min_reps: int = 10) -> Dict[str, Any]:
    """Time the variants of one case, interleaved; returns per-variant medians (max over ranks) and ratios."""
    from colossalai import cmap

    rank, world = dist.get_rank(), dist.get_world_size()
    args = case.inputs()
    reps = max(min_reps, int(round(case.reps * reps_scale)))
    cm = cmap(case.func, in_dims=case.in_dims)
    base = Baseline(case.func, case.in_dims, case.batch)
    base_status = Baseline(case.func, case.in_dims, case.batch, status=True)
    base_ceil = Baseline(case.func, case.in_dims, case.batch, ceil_plan=True)
    base_fused = Baseline(case.func, case.in_dims, case.batch, fused=True)
    variants = VARIANTS + case.extras
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
    # correctness first: cmap == baseline == single-process vmap (each rank checks its own copy)
    got, ref, single = cm(*args), base(*args), vf(*args)
    check = {
        "cmap_vs_vmap_maxabs": _max_diff(got, single),
        "baseline_vs_vmap_maxabs": _max_diff(ref, single),
        "fused_header_vs_vmap_maxabs": _max_diff(base_fused(*args), single),
    }
    if case.extras:
        check["baseline_ceil_plan_vs_vmap_maxabs"] = _max_diff(base_ceil(*args), single)
    del got, ref, single
    for _ in range(2 if case.inner > 1 else 1):  # warm-up, untimed
        for name in variants:
            _timed_block(fns[name], case.inner, name not in RANK0_ONLY or rank == 0)
    times: Dict[str, List[float]] = {name: [] for name in variants}
    cpu: Dict[str, List[float]] = {name: [] for name in variants}
    with colossalai_cmap.record_collectives() as log:  # only the cmap variant issues cmap's collectives
        for rep in range(reps):
            for k in range(len(variants)):
                name = variants[(rep + k) % len(variants)]
                wall, used = _timed_block(fns[name], case.inner, name not in RANK0_ONLY or rank == 0)
                times[name].append(wall)
                cpu[name].append(used)
    collectives = log.count / (reps * case.inner)
    per_rank = _allgather_obj(times)
    per_rank_cpu = _allgather_obj(cpu)
    checks = _allgather_obj(check)
    if rank != 0:
        return {}
    out_bytes = int(local.element_size() * local[0].numel() * case.batch) if local.numel() else 0
    result: Dict[str, Any] = {
        "case": case.name,
        "description": DESCRIPTIONS[case.name],
        "P": world,
        "batch": case.batch,
        "out_bytes": out_bytes,
        "inner": case.inner,
        "reps": reps,
        "collectives_per_call": collectives,
        "max_abs_diff": max(max(c.values()) for c in checks),
        "times": {},
    }
    block_max = {name: [max(r[name][i] for r in per_rank) for i in range(reps)] for name in variants}
    for name in variants:
        xs = sorted(block_max[name])
        result["times"][name] = {
            "median_s": statistics.median(xs),
            "q1_s": xs[len(xs) // 4],
            "q3_s": xs[(3 * len(xs)) // 4],
            "min_s": xs[0],
            "per_rank_median_s": [statistics.median(r[name]) for r in per_rank],
            "cpu_sum_median_s": statistics.median(sum(r[name][i] for r in per_rank_cpu) for i in range(reps)),
        }
    med = {name: result["times"][name]["median_s"] for name in VARIANTS}

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(block_max[a], block_max[b]) if y > 0)

    result["ratios"] = {
        "cmap/baseline": med["cmap"] / med["baseline"],
        "cmap/vmap": med["cmap"] / med["vmap_full"],
        "baseline/vmap": med["baseline"] / med["vmap_full"],
        "(baseline+status)/baseline": med["baseline+status"] / med["baseline"],
        "cmap/(baseline+status)": med["cmap"] / med["baseline+status"],
        "fused_header/baseline": med["fused_header"] / med["baseline"],
        "paired cmap/baseline": paired("cmap", "baseline"),
        "min cmap/baseline": result["times"]["cmap"]["min_s"] / result["times"]["baseline"]["min_s"],
        "cpu cmap/baseline": result["times"]["cmap"]["cpu_sum_median_s"]
        / result["times"]["baseline"]["cpu_sum_median_s"],
        "paired cmap/vmap": paired("cmap", "vmap_full"),
    }
    result["goal"] = goal = goal_for(case.name, world, out_bytes)
    result["pass"] = None if goal is None else result["ratios"]["cmap/baseline"] <= goal
    return result


def _goal_text(r: Dict[str, Any]) -> str:
    return "-" if r["goal"] is None else f"<={r['goal']} " + ("ok" if r["pass"] else "NO")


# ----------------------------------------------------------------------------------------------------- memory
_LIBC: Optional[ctypes.CDLL] = None


def _mmap_large_allocations() -> None:
    """Make glibc ``mmap`` every allocation of 64 KiB or more, so a freed tensor leaves the resident set."""
    global _LIBC
    try:
        _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD (also turns off glibc's dynamic threshold)
        _LIBC.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except OSError:
        _LIBC = None


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _peak_rss(fn: Callable[[], Any]) -> Tuple[int, int]:
    """(peak, retained) resident bytes above the level just before ``fn()``, over all threads; ranks in step."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    _barrier()
    start = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    out = fn()
    peak, after = _status_kib("VmHWM"), _status_kib("VmRSS")
    del out
    _barrier()
    return (peak - start) * 1024, max(after - start, 0) * 1024


def _peak_torch(fn: Callable[[], Any]) -> Tuple[int, int, int]:
    """(peak, retained) bytes of torch allocations on this thread during ``fn()``, and the c10d ops it issued."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    _barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    level = peak = 0
    ops = 0
    for e in events:
        if e.name() == "[memory]":
            level += e.nbytes()
            peak = max(peak, level)
        elif e.name().startswith("c10d::") and e.name() != "c10d::barrier":
            ops += 1
    _barrier()
    return peak, level, ops


def bench_memory(case: Case) -> List[Dict[str, Any]]:
    """Peak memory per rank of one call for each ``dst`` choice (and the hand-written baseline)."""
    from colossalai import cmap

    rank, world = dist.get_rank(), dist.get_world_size()
    args = case.inputs()
    fns: Dict[str, Callable[[], Any]] = {}
    for dst in (-1, 0, "local"):
        fns[f"cmap dst={dst}"] = (lambda c: lambda: c(*args))(cmap(case.func, in_dims=case.in_dims, dst=dst))
    fns["baseline (all_gather)"] = (lambda b: lambda: b(*args))(Baseline(case.func, case.in_dims, case.batch))
    fns["vmap_shard (no comm)"] = (lambda b: lambda: b.compute(args))(Baseline(case.func, case.in_dims, case.batch))
    sizes = shard_sizes(case.batch, world)
    one = torch.vmap(case.func, case.in_dims)(*Baseline(case.func, case.in_dims, case.batch).shard(args))
    full = one.element_size() * (one[0].numel() if one.dim() else 1) * case.batch
    rows = []
    for name, fn in fns.items():
        fn()  # warm: the plan of this argument shape is cached, as in any repeated call
        with colossalai_cmap.record_collectives() as log:
            rss_peak, rss_kept = _peak_rss(fn)
        collectives = log.count
        t_peak, t_kept, ops = _peak_torch(fn)
        mine = {"rss_peak": rss_peak, "rss_kept": rss_kept, "torch_peak": t_peak, "torch_kept": t_kept, "ops": ops}
        mine["collectives"] = collectives if name.startswith("cmap") else None
        everyone = _allgather_obj(mine)  # every rank takes part in every collective, in the same order
        rows.append(
            {
                "case": case.name,
                "P": world,
                "variant": name,
                "full_out_bytes": full,
                "shard_out_bytes": [full // case.batch * n for n in sizes],
                "per_rank": everyone,
            }
        )
    return rows if rank == 0 else []


def bench_zero_copy() -> Dict[str, Any]:
    """Show that the shards of replicated inputs are views: the pointers ``func`` sees lie in the inputs' storage."""
    from colossalai import cmap

    rank, world = dist.get_rank(), dist.get_world_size()
    x, w = torch.randn(4097, 64), torch.randn(64, 64)
    seen: Dict[str, Any] = {}
    unwrap = getattr(torch._C._functorch, "get_unwrapped", None)  # inspection only (private API)

    def batched(xs: torch.Tensor, w_: torch.Tensor) -> torch.Tensor:
        seen["batched"] = (xs.data_ptr(), xs.untyped_storage().data_ptr(), w_.data_ptr(), xs.shape[0])
        return xs @ w_

    def per_example(xi: torch.Tensor, w_: torch.Tensor) -> torch.Tensor:
        inner = xi
        while unwrap is not None and torch._C._functorch.is_batchedtensor(inner):
            inner = unwrap(inner)
        seen["vmap"] = (inner.data_ptr(), inner.untyped_storage().data_ptr(), w_.data_ptr(), inner.shape[0])
        return xi @ w_

    cmap(batched, in_dims=(0, None), mode="batched", dst="local")(x, w)
    cmap(per_example, in_dims=(0, None), dst="local")(x, w)
    sizes = shard_sizes(x.shape[0], world)
    offset = sum(sizes[:rank])
    expect = x.data_ptr() + offset * x.stride(0) * x.element_size()
    mine = {}
    for mode in ("batched", "vmap"):
        ptr, storage, wptr, rows = seen[mode]
        mine[mode] = {
            "shard_ptr_is_view": ptr == expect,
            "same_storage": storage == x.untyped_storage().data_ptr(),
            "replicated_arg_same_ptr": wptr == w.data_ptr(),
            "rows": rows,
        }
    everyone = _allgather_obj(mine)
    return {"P": world, "per_rank": everyone} if rank == 0 else {}


def bench_chunk() -> List[Dict[str, Any]]:
    """Per-rank peak memory of a function with a large intermediate, for several ``chunk_size`` values."""
    from colossalai import cmap

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(1024, 128, generator=torch.Generator().manual_seed(7))
    rows = []
    for chunk in (None, 128, 32, 8):
        fn = (lambda c: lambda: c(x))(cmap(outer_activation, dst="local", chunk_size=chunk))
        fn()
        rss_peak, _ = _peak_rss(fn)
        t_peak, _, _ = _peak_torch(fn)
        everyone = _allgather_obj({"rss_peak": rss_peak, "torch_peak": t_peak})
        if rank == 0:
            shard_rows = shard_sizes(x.shape[0], world)[0]
            per_example = 128 * 128 * 4
            rows.append(
                {
                    "P": world,
                    "chunk_size": chunk,
                    "rows_per_rank": shard_rows,
                    "intermediate_bytes": per_example * (min(chunk, shard_rows) if chunk else shard_rows),
                    "per_rank": everyone,
                }
            )
    return rows


# ---------------------------------------------------------------------------------------------------- profile
PACKAGE_DIR = os.path.dirname(os.path.abspath(colossalai_cmap.__file__)) + os.sep
# Where a profiled cmap call's time goes (keys of results.json's "breakdown_us"):
#   collectives: inside torch.distributed (issuing the collectives and waiting for them; its group queries too);
#   vmap: inside torch.vmap, the per-example function included;
#   calls_out: in the other functions that cmap's code calls (torch ops, pytree, builtins);
#   own: the package's own Python (the own time of every function in colossalai_cmap);
#   unattributed: what is left (cProfile's rounding; about 0).
PARTS = ("collectives", "vmap", "calls_out", "own", "unattributed")


def _in_package(key: Tuple[str, int, str]) -> bool:
    return key[0] != "~" and os.path.abspath(key[0]).startswith(PACKAGE_DIR)


def _part(key: Tuple[str, int, str]) -> str:
    """The part of the call a function outside the package belongs to, judged by its file and name."""
    path, name = key[0].replace(os.sep, "/"), key[2]
    if "/torch/distributed/" in path or "_distributed_c10d" in name:
        return "collectives"
    if "/torch/_functorch/" in path or os.path.abspath(key[0]) == os.path.abspath(__file__):
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


def _top(
    stats: pstats.Stats, root: Tuple[str, int, str], calls: int, total: float, n: int, key: str, package_only: bool
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
    patched)."""
    from colossalai import cmap

    rank, world = dist.get_rank(), dist.get_world_size()
    args = case.inputs()
    cm = cmap(case.func, in_dims=case.in_dims)
    base = Baseline(case.func, case.in_dims, case.batch)
    for _ in range(2):
        cm(*args)
        base(*args)
    # 1) unprofiled cmap and baseline calls, interleaved in blocks, for the totals and the baseline's phases
    plain, hand = [], []
    b_samples: Dict[str, List[float]] = {"narrow": [], "vmap": [], "alloc/pad": [], "all_gather": [], "cut": []}
    blocks = 5 if calls > 10 else 3 if calls > 2 else 2
    for _ in range(blocks):
        _barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            cm(*args)
        plain.append((time.perf_counter() - t0) / calls)
        _barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            ta = time.perf_counter()
            shard = base.shard(args)
            tb = time.perf_counter()
            local = base.vf(*shard)
            tc = time.perf_counter()
            shape = local.shape[1:]
            if base.even:
                out = torch.empty((world * base.rows, *shape), dtype=local.dtype)
                td = time.perf_counter()
                dist.all_gather_into_tensor(out, local.contiguous())
                te = time.perf_counter()
                tf = te
            else:
                send = local
                if base.rows < base.cap:
                    send = torch.empty((base.cap, *shape), dtype=local.dtype)
                    send.narrow(0, 0, base.rows).copy_(local)
                buf = torch.empty((world * base.cap, *shape), dtype=local.dtype)
                td = time.perf_counter()
                dist.all_gather_into_tensor(buf, send)
                te = time.perf_counter()
                out = torch.cat([buf.narrow(0, r * base.cap, n) for r, n in enumerate(base.sizes)])
                tf = time.perf_counter()
            del out
            for key, dt in zip(b_samples, (tb - ta, tc - tb, td - tc, te - td, tf - te)):
                b_samples[key].append(dt)
        hand.append((time.perf_counter() - t0) / calls)
    b_phase = {k: statistics.median(v) * 1e6 for k, v in b_samples.items()}
    # 2) cProfile of the same calls (every rank profiles its own; the ranks stay in step, call by call)
    _barrier()
    with colossalai_cmap.record_collectives() as log:
        stats, root, wall = _profile_calls(cm, args, calls)
    last = cm.stats
    total, parts = _breakdown(stats, root)
    mine = {
        "cmap_us": statistics.median(plain) * 1e6,
        "baseline_us": statistics.median(hand) * 1e6,
        "baseline_phases_us": b_phase,
        "profiled_us": total / calls * 1e6,
        "profiled_wall_us": wall * 1e6,
        "breakdown_us": {k: v / calls * 1e6 for k, v in parts.items()},
        "breakdown_pct": {k: 100 * v / total if total else float("nan") for k, v in parts.items()},
        "collectives_per_call": log.count / calls,
        "collective_bytes_per_call": log.bytes / calls,
        "last_call": {"ops": list(last.ops), "bytes": last.bytes, "fast_path": last.fast_path, "sizes": last.sizes},
        "package_by_cumulative": _top(stats, root, calls, total, 16, "cum", package_only=True),
        "package_by_own": _top(stats, root, calls, total, 12, "own", package_only=True),
        "cprofile_top": _top(stats, root, calls, total, 22, "own", package_only=False),
    }
    everyone = _allgather_obj(mine)
    return {"case": case.name, "P": world, "calls": calls, "per_rank": everyone} if rank == 0 else {}


# ------------------------------------------------------------------------------------------------------ worker
def _worker(rank: int, world: int, port: int, config: Dict[str, Any], out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=180)
    )
    torch.manual_seed(0)
    names = config["cases"] if world > 1 else [n for n in config["cases"] if n in config["p1_cases"]]
    cases = [c for c in CASES if c.name in names]
    results: Dict[str, Any] = {"timing": [], "memory": [], "zero_copy": [], "chunk": [], "profile": []}
    for case in cases:
        t0 = time.time()
        r = bench_time(case, config["reps_scale"], config["min_reps"])
        if rank == 0:
            results["timing"].append(r)
            print(f"  [P={world}] {case.name:7s} timed in {time.time() - t0:5.1f} s", flush=True)
    if config["profile"]:
        for case in cases:
            if case.profile:
                r = profile_case(case, calls=config["profile_calls"].get(case.name, 2))
                if rank == 0:
                    results["profile"].append(r)
    if config["memory"] and world > 1:
        _mmap_large_allocations()
        for case in cases:
            if case.memory:
                results["memory"] += bench_memory(case)
        results["zero_copy"].append(bench_zero_copy())
        results["chunk"] += bench_chunk()
        if rank == 0:
            print(f"  [P={world}] memory checks done", flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "colossalai_cmap"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


# ------------------------------------------------------------------------------------------------------ output
def format_table(timing: List[Dict[str, Any]]) -> str:
    """The summary table (plain text)."""
    head = (
        f"{'case':8s} {'P':>2s} {'cmap/base':>9s} {'goal':>6s} {'cmap/vmap':>9s} {'coll/call':>9s} "
        f"{'bytes out':>10s} {'cmap':>10s} {'baseline':>10s} {'vmap':>10s} {'+status/base':>12s}"
    )
    lines = [head, "-" * len(head)]
    for r in timing:
        t, q = r["times"], r["ratios"]
        lines.append(
            f"{r['case']:8s} {r['P']:>2d} {q['cmap/baseline']:>9.3f} "
            f"{_goal_text(r):>11s} {q['cmap/vmap']:>9.3f} "
            f"{r['collectives_per_call']:>9.2f} {fmt_bytes(r['out_bytes']):>10s} "
            f"{t['cmap']['median_s'] * 1e3:>8.3f}ms {t['baseline']['median_s'] * 1e3:>8.3f}ms "
            f"{t['vmap_full']['median_s'] * 1e3:>8.3f}ms {q['(baseline+status)/baseline']:>12.3f}"
        )
    return "\n".join(lines)


def format_memory(memory: List[Dict[str, Any]]) -> str:
    """Peak memory per rank for each dst choice (plain text)."""
    head = (
        f"{'case':7s} {'P':>2s} {'variant':22s} {'rank0 rss':>10s} {'others rss':>10s} {'rank0 torch':>11s} "
        f"{'others torch':>12s} {'full out':>9s} {'coll':>4s}"
    )
    lines = [head, "-" * len(head)]
    for r in memory:
        ranks = r["per_rank"]
        others = ranks[1:]
        lines.append(
            f"{r['case']:7s} {r['P']:>2d} {r['variant']:22s} {fmt_bytes(ranks[0]['rss_peak']):>10s} "
            f"{fmt_bytes(max(o['rss_peak'] for o in others)):>10s} {fmt_bytes(ranks[0]['torch_peak']):>11s} "
            f"{fmt_bytes(max(o['torch_peak'] for o in others)):>12s} {fmt_bytes(r['full_out_bytes']):>9s} "
            f"{'' if ranks[0]['collectives'] is None else ranks[0]['collectives']:>4}"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes (default 1,2,4)")
    parser.add_argument(
        "--p1-cases",
        default="tiny,medium,uneven",
        help="cases also run in a world of one process, where the collectives cost almost nothing and cmap's own "
        "software overhead shows (default tiny,medium,uneven)",
    )
    parser.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    parser.add_argument("--reps-scale", type=float, default=1.0, help="scale repetitions (never below 10)")
    parser.add_argument("--no-profile", action="store_true", help="skip the overhead profile")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory checks")
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
    if opts.quick:
        scratch = tempfile.mkdtemp(prefix="cmap-bench-quick-")
        opts.out = opts.out or os.path.join(scratch, "results.json")
        opts.docs = opts.docs or os.path.join(os.path.dirname(os.path.abspath(opts.out)), "docs")
    opts.out = opts.out or os.path.join(ROOT, "benchmarks", "results.json")
    opts.docs = opts.docs or os.path.join(ROOT, "docs")
    config = {
        "cases": opts.cases.split(","),
        "p1_cases": opts.p1_cases.split(","),
        "reps_scale": 0.0 if opts.quick else opts.reps_scale,
        "min_reps": 3 if opts.quick else 10,
        "profile_calls": {"tiny": 20, "uneven": 3} if opts.quick else {"tiny": 200, "uneven": 10},
        "profile": not opts.no_profile,
        "memory": not opts.no_memory,
    }
    started = time.time()
    results: Dict[str, Any] = {
        "meta": {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__,
            "colossalai_cmap": getattr(colossalai_cmap, "__version__", "?"),
            "package_commit": _git_commit(),
            "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} logical CPUs",
            "load_average_at_start": list(os.getloadavg()),
            "backend": "gloo on 127.0.0.1, CPU tensors, OMP_NUM_THREADS=1, torch.set_num_threads(1)",
            "timing_method": __doc__.split("How time is measured (also written into results.json):")[1]
            .split("Memory (for")[0]
            .strip(),
            "memory_method": "Memory (for" + __doc__.split("Memory (for")[1].strip(),
            "quick": opts.quick,
        },
        "timing": [],
        "memory": [],
        "zero_copy": [],
        "chunk": [],
        "profile": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(w) for w in opts.worlds.split(",")):
            print(f"world of {world} processes (gloo, 127.0.0.1)", flush=True)
            path = os.path.join(tmp, f"p{world}.json")
            mp.spawn(_worker, args=(world, _free_port(), config, path), nprocs=world, join=True)
            with open(path) as f:
                part = json.load(f)
            for key in ("timing", "memory", "zero_copy", "chunk", "profile"):
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
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import render

        print(f"rendered {render.render(opts.out, opts.docs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
