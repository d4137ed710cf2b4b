"""One gloo world on 127.0.0.1 for one job: a free port, the launcher's environment, and the spawned ranks.

Every benchmark starts its processes here (``spawn``); the port and each rank's environment come from the tests'
``world_env``. Importing this module imports nothing but the standard library: torch is imported in the ranks.
"""

import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

from benchmarks.paths import test_support

_env = test_support("world_env")
LOCALHOST, free_port, rank_env = _env.LOCALHOST, _env.free_port, _env.rank_env

# One thread per rank for torch's intra-op pool (set before torch is imported, in the parent and so in every rank).
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def spawn(
    target: Callable[..., Any],
    size: int,
    args: Sequence[Any] = (),
    *,
    launch: str = "gloo",
    timeout_s: Optional[float] = 180.0,
    env: Optional[Dict[str, str]] = None,
) -> List[Any]:
    """Run ``target(*args)`` on every rank of a fresh world of ``size`` processes; returns the results in rank order.

    Each rank is a new interpreter (``spawn``) with :data:`SINGLE_THREADED` and ``env`` as environment defaults and
    ``torch.set_num_threads(1)``. It joins the world, runs ``target`` and, when every rank has returned, meets the
    others in a barrier and leaves the process group. If a rank raises or dies, the others are killed and this
    raises ``RuntimeError`` with the rank's traceback.

    Args:
        target: a module-level function (it is pickled by name into the ranks).
        size: the number of processes, P.
        args: the positional arguments of ``target`` (picklable), the same on every rank.
        launch: ``"gloo"`` (``torch.distributed.init_process_group``) or ``"colossalai"`` (``colossalai.launch``,
            which also seeds every rank).
        timeout_s: the process group's timeout for ``"gloo"`` (None: torch's default), so that a bug in a
            benchmark fails within minutes instead of hanging.
        env: more environment defaults for the ranks.
    """
    for key, value in {**SINGLE_THREADED, **(env or {})}.items():
        os.environ.setdefault(key, value)  # inherited by the ranks when they start
    ctx = mp.get_context("spawn")
    job, results = _Job(target, tuple(args), size, free_port(), launch, timeout_s), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(job, rank, results)) for rank in range(size)]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, results)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


@dataclass(frozen=True)
class _Job:
    """What every rank of one world runs, and how the world is joined (see :func:`spawn`)."""

    target: Callable[..., Any]
    args: tuple
    size: int
    port: int
    launch: str
    timeout_s: Optional[float]


def _rank_main(job: _Job, rank: int, out: Any) -> None:
    """One rank: join the world, run the target, report to the parent, leave together."""
    os.environ.update(rank_env(rank, job.size, job.port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        _join(job, rank)
        out.put((rank, "ok", job.target(*job.args)))
    except BaseException as exc:  # reported to the parent, which kills the world
        out.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    dist.barrier()
    dist.destroy_process_group()


def _join(job: _Job, rank: int) -> None:
    if job.launch == "colossalai":
        import colossalai

        colossalai.launch(rank=rank, world_size=job.size, host=LOCALHOST, port=job.port, local_rank=rank, verbose=False)
    elif job.launch == "gloo":
        import torch.distributed as dist

        timeout = {} if job.timeout_s is None else {"timeout": timedelta(seconds=job.timeout_s)}
        dist.init_process_group("gloo", rank=rank, world_size=job.size, **timeout)
    else:
        raise ValueError(f"launch must be 'gloo' or 'colossalai', not {job.launch!r}")


def _collect(procs: List[Any], results: Any) -> List[Any]:
    """Every rank's result, read before the ranks are joined (a rank exits only once its result is sent).

    A rank that exited cleanly passed the closing barrier, so every rank had sent its result by then: one still
    missing :data:`_LOST_AFTER_S` later never arrives (seen once, a rank hung in ``destroy_process_group``), and this
    raises instead of waiting for it forever."""
    got: Dict[int, Any] = {}
    closed_at: Optional[float] = None  # when a rank was first seen to have exited cleanly
    while len(got) < len(procs):
        dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
        try:  # after a death, one last wait for what the rank may have sent just before it
            rank, status, value = results.get(timeout=5.0 if dead else 1.0)
        except queue.Empty:
            if dead:
                _kill(procs)
                codes = {r: procs[r].exitcode for r in dead}
                raise RuntimeError(f"ranks {dead} of {len(procs)} died (exit codes {codes})") from None
            if closed_at is None and any(p.exitcode == 0 for p in procs):
                closed_at = time.monotonic()
            if closed_at is not None and time.monotonic() - closed_at > _LOST_AFTER_S:
                _kill(procs)
                missing = [r for r in range(len(procs)) if r not in got]
                raise RuntimeError(
                    f"the results of ranks {missing} of {len(procs)} never arrived, though a rank passed the closing "
                    f"barrier (which every rank reaches after sending its result) {_LOST_AFTER_S:.0f} s ago"
                ) from None
            continue
        if status == "err":
            _kill(procs)
            raise RuntimeError(f"rank {rank} of {len(procs)} failed:\n{value}")
        got[rank] = value
    return [got[r] for r in range(len(procs))]


_LOST_AFTER_S = 60.0


def _kill(procs: List[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
