"""Which steady-state calls synchronize the host with the GPU, under ``torch.cuda.set_sync_debug_mode``.

Each probe builds a call, runs it twice (warm-up: plans, buffers and nccl communicators exist), then runs it once
more under the debug mode, twice over:

* ``"warn"``, on the default group: every synchronizing op becomes a Python warning at the line that called it, so
  the call completes and the report lists where it synchronized (file, line and the code there);
* ``"error"``, as the report's verdict, on a process group made for this probe alone (the call is rebuilt on it and
  warmed up again): the first synchronizing op raises ``RuntimeError``. All ranks raise at the same step, but the
  call is cut short, so its group is never used again, and the default group, which the checks and the benchmark
  use, is left alone.

Each probe also reports the steady call's ``record_collectives().host_reads``: tensors on the data's side that the
host read. Rounds go over a host gloo group and carry nothing of the data, so every call should say "no" and 0, as
the control probe (``torch.distributed`` alone) does. Reports are informational, never a failure.
"""

import linecache
import warnings
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import colossalai_cmap as cm
from benchmarks import paths
from checks.gpu.core import Ctx
from colossalai_cmap import P, shard_map

SYNC_TEXT = "synchronizing CUDA operation"
Thunk = Callable[[], Any]


def _short(filename: str) -> str:
    """A path from the package or torch down, so the report reads the same on every machine."""
    for marker in ("colossalai_cmap/", "torch/", "colossalai/", "transformers/", "benchmarks/"):
        at = filename.rfind(marker)
        if at >= 0:
            return filename[at:]
    return filename


def _site(filename: str, lineno: int) -> str:
    code = linecache.getline(filename, lineno).strip()
    return f"{_short(filename)}:{lineno}" + (f" `{code[:70]}`" if code else "")


def _mesh_on(ctx: Ctx, group: Optional[Any]) -> Any:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if group is None:
        return init_device_mesh(ctx.device.type, (ctx.size,), mesh_dim_names=("i",))
    return DeviceMesh.from_group(group, ctx.device.type, mesh_dim_names=("i",))


def probes(ctx: Ctx) -> List[Tuple[str, Callable[[Optional[Any]], Thunk]]]:
    """(name, build) pairs: ``build(group)`` makes the call on ``group`` (None: the default) and returns it."""
    n, dev = ctx.size, ctx.device
    x, y = ctx.data(64, 128, seed=1), ctx.data(64, 128, seed=2)
    big = ctx.data(64 * n, 64 * 1024, seed=3, dtype=torch.float32)  # 16 MiB of float32 output per rank: the data phase
    grad_x = ctx.data(8 * n, 32, seed=4).requires_grad_()
    a, b = ctx.data(6, 4 * n, seed=5), ctx.data(4 * n, 3, seed=6)

    def control(g: Optional[Any]) -> Thunk:
        out = torch.empty(n * x.numel(), dtype=x.dtype, device=dev)
        return lambda: dist.all_gather_into_tensor(out, x.reshape(-1), group=g)

    def backward(g: Optional[Any]) -> Thunk:
        f = cm.cmap(lambda v: torch.tanh(v).sum(), group=g)
        return lambda: f(grad_x).sum().backward()

    def matmul(g: Optional[Any]) -> Thunk:
        f = shard_map(lambda p, q: cm.psum(p @ q, "i"), _mesh_on(ctx, g), (P(None, "i"), P("i", None)), P())
        return lambda: f(a, b)

    def llama(g: Optional[Any]) -> Thunk:
        from checks.gpu.sharded import llama as build

        plan = paths.load_example("tensor_parallel_llama").PLAN
        model, ids = cm.shard_model(build(ctx), group=g, plan=plan), torch.randint(0, 1000, (2, 8)).to(dev)
        return lambda: model(input_ids=ids)

    return [
        ("control: torch.distributed all_gather_into_tensor", control),
        ("cmap(dot) dst=-1, 64 rows (rides in the status round)", lambda g: _bind(cm.cmap(torch.dot, group=g), x, y)),
        (
            "cmap(sin) dst=-1, 16 MiB per rank (status round + data all_gather)",
            lambda g: _bind(cm.cmap(torch.sin, group=g), big),
        ),
        ("cmap(dot) dst=0", lambda g: _bind(cm.cmap(torch.dot, dst=0, group=g), x, y)),
        ("cmap(dot) dst='local'", lambda g: _bind(cm.cmap(torch.dot, dst="local", group=g), x, y)),
        ("cmap with psum inside func", lambda g: _bind(cm.cmap(lambda v: cm.psum(v, "i"), axis_name="i", group=g), x)),
        ("cmap forward + backward", backward),
        ("shard_map(psum(a @ b))", matmul),
        ("shard_model Llama forward", llama),
    ]


def _bind(f: Callable, *args: Any) -> Thunk:
    return lambda: f(*args)


def warn_pass(call: Thunk) -> Counter:
    """Every synchronizing op of one call, by the line that issued it (the call runs to the end)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return Counter(_site(w.filename, w.lineno) for w in caught if SYNC_TEXT in str(w.message))


def error_pass(call: Thunk) -> str:
    """``"no"``, or ``"yes (RuntimeError: ... [where])"``: the first synchronizing op raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    except Exception as exc:  # RuntimeError from torch, or a CmapError that carries it from func
        text = str(exc)
        if SYNC_TEXT not in text:
            return f"error ({type(exc).__name__}: {text.splitlines()[0][:200] if text else ''})"
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f" at {_site(tb.tb_frame.f_code.co_filename, tb.tb_lineno)}" if tb is not None else ""
        return f"yes ({type(exc).__name__}: called a {SYNC_TEXT}{where})"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "no"


def _warmed(build: Callable[[Optional[Any]], Thunk], group: Optional[Any]) -> Thunk:
    call = build(group)
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    return call


def run(ctx: Ctx) -> List[Dict[str, Any]]:
    """Every probe, both passes; rank 0 prints one line per call. Returns the rows for the JSON file."""
    rep, rows = ctx.rep, []
    rep.say("")
    rep.say('Host syncs: the steady call (after two warm-up calls) under torch.cuda.set_sync_debug_mode("error");')
    rep.say('the sites are where the "warn" pass saw synchronizing ops (rank 0). Informational, never a failure.')
    for name, build in probes(ctx):
        mine: Dict[str, Any] = {"call": name}
        try:
            call = _warmed(build, None)
            with cm.record_collectives() as log:
                call()
            mine["host_reads"] = log.host_reads
            sites = warn_pass(call)
            mine["sites"] = dict(sites)
            group = dist.new_group(list(range(ctx.size)))  # this probe's own: an error pass cuts its call short
            mine["error_mode"] = error_pass(_warmed(build, group))
        except Exception as exc:  # a probe that cannot run says so; the others still run
            mine["error_mode"] = f"probe failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        torch.cuda.synchronize()
        everyone = rep.gather(mine, f"host syncs: {name}")
        rows.append({"rank0": everyone[0], "ranks_differ": any(e != everyone[0] for e in everyone)})
        rep.say(_line(everyone))
    return rows


def _line(everyone: List[Dict[str, Any]]) -> str:
    first = everyone[0]
    sites = first.get("sites") or {}
    where = "; ".join(f"{site}{f' (x{k})' if k > 1 else ''}" for site, k in sites.items()) or "none"
    count = sum(sites.values())
    differ = [r for r, e in enumerate(everyone) if e != first]
    tail = f"; ranks {differ} saw otherwise" if differ else ""
    reads = first.get("host_reads", "?")
    return (
        f"host syncs: {first['call']} steady call: {first['error_mode']}; host_reads {reads}; "
        f"warn pass: {count} sync(s): {where}{tail}"
    )
