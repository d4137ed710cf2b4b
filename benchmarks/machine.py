"""What ran where: the machine, the software and the checkout, measured at run time and written into results.json, so
that the report describes the machine it was measured on.

``parallel_throughput`` is a probe: P processes spin a fixed pure-Python loop at once, against one process alone. Its
result (how many cores' worth of work P processes get done at once) is what tells whether the ranks of a world of P
had a core each, whatever the CPU count says (SMT siblings, CPU quotas and other jobs all lower it).

``collective_cpu`` is the other probe, which every benchmark world runs first (``suite.py``): what a tiny all_gather
costs the host's CPUs in a gloo world of P, split into the calling thread's CPU time and the rest of the process's
(gloo's own threads). Where the world keeps most of the usable CPUs busy with nothing but collectives, every
microsecond of the callers' Python waits for a CPU too.
"""

import multiprocessing as mp
import os
import platform
import subprocess
import time
from typing import Any, Dict, List, Sequence

from benchmarks.paths import ROOT

SPIN = 3_000_000  # loop iterations of one probe: about 0.1-0.3 s of one core
COLLECTIVE_CALLS, COLLECTIVE_WARMUP = 1000, 100  # all_gathers timed by collective_cpu (0.5-5 s here), and before


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


def collective_cpu(calls: int = COLLECTIVE_CALLS) -> Dict[str, float]:
    """What one 16-byte ``all_gather_into_tensor`` costs this host in the running gloo world (every rank calls it),
    per call, as medians over the ranks: ``wall_us``, ``caller_cpu_us`` (the calling thread's CPU time),
    ``other_cpu_us`` (the process's other threads', gloo's), and ``cores_busy``: the CPUs the world kept busy (its
    CPU time over the wall time), to set against the usable CPUs."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    inp, out = torch.zeros(4), torch.empty(4 * world)
    for _ in range(COLLECTIVE_WARMUP):
        dist.all_gather_into_tensor(out, inp)
    dist.barrier()
    wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(calls):
        dist.all_gather_into_tensor(out, inp)
    wall, thread, process = time.perf_counter() - wall, time.thread_time() - thread, time.process_time() - process
    mine = torch.tensor([wall, thread, process - thread], dtype=torch.float64) / calls * 1e6
    ranks = torch.empty(world * 3, dtype=torch.float64)
    dist.all_gather_into_tensor(ranks, mine)
    ranks = ranks.view(world, 3)
    medians = ranks.median(dim=0).values.tolist()  # the lower median where P is even
    return {
        "processes": world,
        "wall_us": round(medians[0], 1),
        "caller_cpu_us": round(medians[1], 1),
        "other_cpu_us": round(medians[2], 1),
        "cores_busy": round(float((ranks[:, 1] + ranks[:, 2]).sum() / ranks[:, 0].max()), 2),
    }


def gpus() -> List[str]:
    """The names of the CUDA devices torch sees (none on a CPU build or machine)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def describe(worlds: Sequence[int]) -> Dict[str, Any]:
    """The machine and the software, for results.json's ``meta`` (the probe runs once per world size above 1)."""
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
        "gpus": gpus(),
        "load_average_at_start": list(os.getloadavg()),
    }
