"""One rank of the check, started by ``torchrun``: launch, run every section in order, print the summary."""

import argparse
import json
import os
import platform
from datetime import datetime, timedelta, timezone
from typing import Any, Dict, List, NoReturn

import torch
import torch.distributed as dist

from checks.gpu import bandwidth, core, sharded, syncs
from checks.gpu.core import Ctx
from checks.gpu.report import PeerTimeout, Reporter, flush
from checks.gpu.sizes import parse_sizes

STATUS_ENV = "GPU_CHECK_STATUS"  # where rank 0 writes "pass" or "fail" for the launcher


def _device(opts: argparse.Namespace) -> torch.device:
    """This rank's own device: the accelerator's current one, set from LOCAL_RANK (never a fixed cuda:0)."""
    if opts.cpu:
        return torch.device("cpu")
    from colossalai.accelerator import get_accelerator

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)  # launch_from_torch already did, through the accelerator: made explicit here
    device = get_accelerator().get_current_device()
    if device != torch.device("cuda", local_rank):
        raise RuntimeError(f"the accelerator's device is {device}, but LOCAL_RANK is {local_rank}")
    return device


def _meta(ctx: Ctx, rep: Reporter) -> Dict[str, Any]:
    from benchmarks import machine

    cuda = ctx.device.type == "cuda"
    names = rep.gather(f"{ctx.device} {torch.cuda.get_device_name(ctx.device) if cuda else 'CPU'}", "devices")
    return {
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "world": ctx.size,
        "backend": dist.get_backend(),
        "devices": names,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "commit": machine.package_commit(),
        "host": platform.node(),
    }


def _save(path: str, results: Dict[str, Any], rep: Reporter) -> None:
    if path and rep.rank == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


def _summary(ctx: Ctx, rep: Reporter, results: Dict[str, Any]) -> List[str]:
    meta = results["meta"]
    lines = ["", f"gpu-check summary: P={ctx.size} over {meta['backend']}: {rep.counts()}"]
    for v in rep.failed:
        lines.append(f"  FAILED {v.section}: {v.name}")
    host = results.get("host_syncs") or []
    calls = [r for r in host if not r["rank0"]["call"].startswith("control")]
    if host:
        yes = sum(1 for r in calls if r["rank0"]["error_mode"].startswith("yes"))
        control = next((r["rank0"]["error_mode"] for r in host if r["rank0"]["call"].startswith("control")), "?")
        lines.append(
            f"host syncs: {yes} of {len(calls)} steady calls synchronize the host (control: {control}); "
            "informational, not a failure"
        )
    lines += bandwidth.summary(results.get("bandwidth") or [], meta["backend"])
    if ctx.size == 1:
        lines.append(
            "one rank: at P=1 cmap runs as plain torch.vmap and sends nothing, so these checks cover CUDA placement, "
            "gradients and the local paths only, and the host-sync lines say nothing about cmap's rounds; the "
            "multi-rank checks (nccl rounds, failures crossing ranks, bandwidth) need 2+ GPUs"
        )
    return lines


def _sections(ctx: Ctx, opts: argparse.Namespace, results: Dict[str, Any]) -> None:
    rep = ctx.rep
    core.run(ctx)
    sharded.run(ctx)
    if not opts.no_bench:
        rows = bandwidth.measure(ctx, parse_sizes(opts.sizes))
        results["bandwidth"] = rows
        rep.say("")
        rep.say(bandwidth.table(rows, ctx.size, results["meta"]["backend"]))
        _save(opts.json, results, rep)
    if ctx.device.type == "cuda":  # last: an error-mode probe cuts a call short (on a group of its own)
        results["host_syncs"] = syncs.run(ctx)
    else:
        rep.skip("host syncs", "set_sync_debug_mode probes", "need CUDA (this run is on CPU)")


def main(opts: argparse.Namespace) -> NoReturn:
    """This rank's whole run; it ends the process. A failed check is reported in the file ``$GPU_CHECK_STATUS`` names, not by the exit
    status: torchrun would print a crash report for a rank that exits non-zero."""
    import colossalai

    colossalai.launch_from_torch(verbose=False)
    device = _device(opts)
    ctl = dist.new_group(backend="gloo", timeout=timedelta(seconds=opts.peer_timeout))
    rep = Reporter(ctl, dist.get_rank(), dist.get_world_size())
    ctx = Ctx(device, rep.rank, rep.size, rep)
    results: Dict[str, Any] = {"meta": _meta(ctx, rep)}
    rep.say(f"gpu-check: P={ctx.size} over {results['meta']['backend']}; " + ", ".join(results["meta"]["devices"]))
    try:
        _sections(ctx, opts, results)
    except PeerTimeout as exc:  # out of step: the run cannot go on; torchrun stops the other ranks
        print(f"[rank {rep.rank}] gpu-check: ABORTED: {exc}", flush=True)
        os._exit(3)
    results["checks"] = rep.as_json()
    for line in _summary(ctx, rep, results):
        rep.say(line)
    _save(opts.json, results, rep)
    if opts.json:
        rep.say(f"results written to {opts.json}")
    status = os.environ.get(STATUS_ENV)
    if status and rep.rank == 0:
        with open(status, "w") as f:
            f.write("fail\n" if rep.failed else "pass\n")
    flush()
    dist.barrier(group=ctl)
    dist.destroy_process_group()
    # torch 2.5.1's gloo group joins its worker threads in its destructor with the GIL held, while a worker may still
    # be releasing the tensors of the barrier's work, which needs the GIL: the rank hung at exit once in a loaded run.
    # Leaving here, with ctl still referenced, tears nothing down.
    os._exit(0)
