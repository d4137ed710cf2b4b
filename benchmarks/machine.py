"""What ran where: the machine, the software and the checkout, measured at run time and written into results.json, so
that the report describes the machine it was measured on.

``parallel_throughput`` is a probe: P processes spin a fixed pure-Python loop at once, against one process alone. Its
result (how many cores' worth of work P processes get done at once) is what tells whether the ranks of a world of P
had a core each, whatever the CPU count says (SMT siblings, CPU quotas and other jobs all lower it).

``collective_cpu`` is the other probe: what a tiny all_gather costs the host's CPUs in a gloo world of P, split into
the calling thread's CPU time and the rest of the process's (gloo's own threads). Where the world keeps most of the
usable CPUs busy with nothing but collectives, every microsecond of the callers' Python waits for a CPU too.
"""

import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Dict, List, Sequence, Tuple

from benchmarks.paths import ROOT

SPIN = 3_000_000  # loop iterations of one probe: about 0.1-0.3 s of one core
COLLECTIVE_CALLS, COLLECTIVE_WARMUP = 1000, 100  # all_gathers timed by collective_cpu (about 0.5-5 s), and before


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else ``platform.processor()``, else ``unknown``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), or ``os.cpu_count()`` where that is not known."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def package_commit() -> str:
    """The checkout's short commit, with ``-dirty`` if the package's files differ from it."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "colossalai_cmap"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def _spin(n: int) -> float:
    start = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    return time.perf_counter() - start


def _spin_together(n: int, start: Any, out: Any) -> None:
    start.wait()
    out.put(_spin(n))


def parallel_throughput(processes: int, n: int = SPIN) -> float:
    """How many cores' worth of work ``processes`` processes get done at once: ``processes`` times one process's
    time alone (the best of three), over the slowest one's time when all spin the same loop at once."""
    alone = min(_spin(n) for _ in range(3))
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_spin_together, args=(n, start, out)) for _ in range(processes)]
    for proc in procs:
        proc.start()
    together = max(out.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join()
    return processes * alone / together


def collective_cpu(processes: int, calls: int = COLLECTIVE_CALLS) -> Dict[str, float]:
    """What one 16-byte ``all_gather_into_tensor`` costs this host in a fresh gloo world of ``processes``, per call
    and as medians over the ranks: ``wall_us``, ``caller_cpu_us`` (the calling thread's CPU time), ``other_cpu_us``
    (the process's other threads', gloo's), and ``cores_busy``: the CPUs the world kept busy (its CPU time over the
    wall time), to set against the usable CPUs."""
    from benchmarks import world  # it starts the ranks; imported here so that importing this module starts nothing

    ranks = world.spawn(_collective_cpu_rank, processes, (calls,))
    wall, caller, other = (statistics.median(r[i] for r in ranks) for i in range(3))
    return {
        "processes": processes,
        "wall_us": round(wall, 1),
        "caller_cpu_us": round(caller, 1),
        "other_cpu_us": round(other, 1),
        "cores_busy": round(sum(r[1] + r[2] for r in ranks) / max(r[0] for r in ranks), 2),
    }


def _collective_cpu_rank(calls: int) -> Tuple[float, float, float]:
    """One rank of :func:`collective_cpu`: per call, microseconds of wall time, of this thread's CPU time, and of
    the process's other threads' CPU time."""
    import torch
    import torch.distributed as dist

    inp, out = torch.zeros(4), torch.empty(4 * dist.get_world_size())
    for _ in range(COLLECTIVE_WARMUP):
        dist.all_gather_into_tensor(out, inp)
    dist.barrier()
    wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(calls):
        dist.all_gather_into_tensor(out, inp)
    wall, thread, process = time.perf_counter() - wall, time.thread_time() - thread, time.process_time() - process
    return wall / calls * 1e6, thread / calls * 1e6, (process - thread) / calls * 1e6


def gpus() -> List[str]:
    """The names of the CUDA devices torch sees (none on a CPU build or machine)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def describe(worlds: Sequence[int]) -> Dict[str, Any]:
    """The machine and the software, for results.json's ``meta`` (the probes run once per world size above 1)."""
    import torch

    import colossalai_cmap

    logical = os.cpu_count()
    return {
        "torch": torch.__version__,
        "colossalai_cmap": getattr(colossalai_cmap, "__version__", "?"),
        "package_commit": package_commit(),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {logical} logical CPUs",
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "logical_cpus": logical,
        "usable_cpus": usable_cpus(),
        "parallel_throughput": [
            {"processes": p, "cores": parallel_throughput(p)} for p in sorted(set(worlds)) if p > 1
        ],
        "collective_cpu": [collective_cpu(p) for p in sorted(set(worlds)) if p > 1],
        "gpus": gpus(),
        "load_average_at_start": list(os.getloadavg()),
    }
