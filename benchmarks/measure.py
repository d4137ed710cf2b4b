"""The instruments, used inside the ranks of a world: timed blocks (wall and CPU time) and one call's peak memory (the
resident set, and torch's own allocations through ``torch.profiler``)."""

import ctypes
import gc
import time
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

# How memory is measured, written into results.json (``meta.memory_method``) and rendered into the report.
MEMORY_METHOD = (
    "Memory (for `dst` choices) is measured twice, because neither way sees everything:\n"
    "\n"
    "* `rss`: the process's peak resident set during one call (`VmHWM` after resetting it through "
    "`/proc/self/clear_refs`) minus the resident set just before it, with glibc told to `mmap` every allocation of "
    "64 KiB or more (`mallopt`) so freed tensors leave the resident set. It counts every thread (gloo's too) and "
    "everything that was touched, at page granularity.\n"
    "* `torch`: the peak of the running sum of the allocation and free events that `torch.profiler` "
    "(`profile_memory=True`) records on the calling thread, in exact bytes. It does not see allocations that gloo "
    "makes on its own worker threads."
)


def barrier() -> None:
    """Every rank of the world waits here for the others."""
    dist.barrier()


def allgather_obj(obj: Any) -> List[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference of two tensors (infinite if their shapes differ)."""
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def timed_block(fn: Callable[[], Any], inner: int, active: bool = True) -> Tuple[float, float]:
    """Barrier, then ``inner`` calls of ``fn`` (if ``active`` on this rank).

    Returns:
        (wall seconds, CPU seconds of this process, all its threads) per call on this rank.
    """
    barrier()
    if not active:
        return 0.0, 0.0
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(inner):
        out = fn()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    del out
    return dt / inner, dc / inner


# ------------------------------------------------------------------------------------------------------- memory
_LIBC: Optional[ctypes.CDLL] = None


def mmap_large_allocations() -> None:
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


def peak_rss(fn: Callable[[], Any]) -> Tuple[int, int]:
    """(peak, retained) resident bytes above the level just before ``fn()``, over all threads; ranks in step."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    barrier()
    start = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    out = fn()
    peak, after = _status_kib("VmHWM"), _status_kib("VmRSS")
    del out
    barrier()
    return (peak - start) * 1024, max(after - start, 0) * 1024


def peak_torch(fn: Callable[[], Any]) -> Tuple[int, int, int]:
    """(peak, retained) bytes of torch allocations on this thread during ``fn()``, and the c10d ops it issued."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    barrier()
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
    barrier()
    return peak, level, ops
