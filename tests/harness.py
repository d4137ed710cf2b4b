"""A pool of real gloo worlds for the tests: spawn once, run many checks, never hang.

``World(P)`` starts P processes that call ``colossalai.launch`` on a free port and then serve requests: each
request names a module-level function (by module and qualified name), which every rank runs with the same
arguments. ``World.run`` returns the per-rank results, re-raises a rank's failure with its traceback, and enforces
a hard deadline: on expiry the world is killed (and rebuilt on next use) and the test fails instead of hanging.
"""

import importlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Dict, List, Optional

from world_env import LOCALHOST, free_port, rank_env  # noqa: F401  (free_port: also the tests' import)

DEFAULT_DEADLINE = float(os.environ.get("CMAP_TEST_DEADLINE", "90"))
# Starting a world imports torch and colossalai (in the fork server once, or in every spawned process): slow when the
# machine is loaded.
START_DEADLINE = float(os.environ.get("CMAP_TEST_START_DEADLINE", "240"))


DIED = "<died>"
# What each rank would import itself, in the fork server once: colossalai.launch alone imports torch._dynamo (sympy,
# triton), a second of CPU per rank.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "colossalai"]

# torch.compile would start a pool of inductor compile workers in every rank: two cores cannot feed them.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


class RankFailed(AssertionError):
    """A check raised on one or more ranks; the message holds each rank's traceback."""


class WorldTimeout(AssertionError):
    """A check did not finish on every rank before the deadline; the world was killed."""


def _context() -> Any:
    """Each rank is forked from a server that imported torch and colossalai once (:data:`PRELOAD`): a fresh
    interpreter per rank spent seconds of CPU on those imports alone, most of a world's start. The server is this
    test process's, started once; it only imports (no process group, no colossalai_cmap module beyond the start-up
    hook's, no thread of ours), so each rank starts as clean as a spawned one."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # A fork waits for the server's imports with no bound of its own: a probe first, within the start's deadline.
    probe = ctx.Process(target=time.sleep, args=(0,), daemon=True)
    starter = threading.Thread(target=probe.start, daemon=True)
    starter.start()
    starter.join(START_DEADLINE)
    if starter.is_alive():
        server = getattr(forkserver._forkserver, "_forkserver_pid", None)
        if server:
            os.kill(server, signal.SIGKILL)
        raise WorldTimeout(f"the fork server did not import {PRELOAD} within {START_DEADLINE:.0f} s; it was killed.")
    probe.join()
    return ctx


def _serve(rank: int, world_size: int, port: int, conn: Connection, env: Dict[str, str]) -> None:
    os.environ.clear()  # the test process's environment now, as a spawned process gets it (not the fork server's)
    os.environ.update(env)
    os.environ.update(rank_env(rank, world_size, port))
    import torch

    torch.set_num_threads(1)
    import colossalai

    colossalai.launch(rank=rank, world_size=world_size, host=LOCALHOST, port=port, local_rank=rank, verbose=False)
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            conn.send(("bye", None))
            break
        module, name, args, kwargs = msg
        try:
            fn: Any = importlib.import_module(module)
            for part in name.split("."):
                fn = getattr(fn, part)
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException as exc:  # reported to the test, which fails with this traceback
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    # No destroy_process_group(): with gloo it can block once the rank hosting the store has exited.
    os._exit(0)


class World:
    """P worker processes joined in one gloo world."""

    def __init__(self, size: int, env: Optional[Dict[str, str]] = None, spawn: bool = False) -> None:
        """With ``spawn``, each rank is a fresh interpreter, which exits as a user's script does (atexit handlers,
        then finalization): what ``close(exit_normally=True)`` tests. A rank forked from the server leaves with
        ``os._exit`` whatever it does."""
        self.size = size
        self.spawn = spawn
        self.env = {"OMP_NUM_THREADS": "1", **(env or {})}  # over the test process's environment at each start
        self.procs: List[mp.Process] = []
        self.conns: List[Connection] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn") if self.spawn else _context()
        port = free_port()
        env = {**os.environ, **self.env}
        self.procs, self.conns = [], []
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, self.size, port, child, env), daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self._collect(START_DEADLINE, "start-up")

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(
        self, fn: Callable, *args: Any, deadline: float = DEFAULT_DEADLINE, may_die: bool = False, **kwargs: Any
    ) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; returns the results in rank order.

        With ``may_die``, a rank whose process exits yields ``DIED`` instead of failing the run.
        """
        if not self.alive:
            self.kill()
            self._start()
        for conn in self.conns:
            conn.send((fn.__module__, fn.__qualname__, args, kwargs))
        return self._collect(deadline, fn.__qualname__, may_die)

    def _collect(self, deadline: float, what: str, may_die: bool = False) -> List[Any]:
        results: Dict[int, Any] = {}
        errors: Dict[int, str] = {}
        end = time.monotonic() + deadline
        pending = dict(enumerate(self.conns))
        while pending:
            left = end - time.monotonic()
            ready = wait(list(pending.values()), timeout=max(left, 0)) if left > 0 else []
            if not ready:
                self.kill()
                raise WorldTimeout(
                    f"{what}: ranks {sorted(pending)} of a world of {self.size} did not finish "
                    f"within {deadline:.0f} s; the world was killed."
                )
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                del pending[rank]
                try:
                    status, value = conn.recv()
                except (EOFError, ConnectionError):
                    self.procs[rank].join(timeout=10)
                    status, value = "err", f"rank {rank} died (exit code {self.procs[rank].exitcode})"
                    if may_die:
                        status, value = "ok", DIED
                if status == "err":
                    errors[rank] = value
                else:
                    results[rank] = value
        if errors:
            self.kill()  # a failed check may leave collectives half done; start clean next time
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankFailed(f"{what} failed on ranks {sorted(errors)} of {self.size}:\n{text}")
        return [results[r] for r in range(self.size)]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def close(self, exit_normally: bool = False) -> List[float]:
        """End the world; returns each process's seconds to exit (inf for one still there after 30 s, then killed).

        By default each rank leaves with ``os._exit``; with ``exit_normally`` its pipe is closed instead, so the
        interpreter exits as a user's script does (atexit handlers, then every object destroyed, process groups
        too), which is where work left in flight could hang it."""
        if exit_normally and not self.spawn:
            raise ValueError("exit_normally needs World(..., spawn=True): a forked rank skips the interpreter's exit")
        start = time.monotonic()
        for conn in self.conns:
            try:
                if exit_normally:
                    conn.close()
                else:
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = start + (30 if exit_normally else 10)
        times = []
        for proc in self.procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0.1))
            times.append(time.monotonic() - start if proc.exitcode is not None else float("inf"))
        if exit_normally:
            self.conns = []
        self.kill()
        return times
