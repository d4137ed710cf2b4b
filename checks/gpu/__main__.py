"""``python -m checks.gpu``: find the GPUs, then run the check under ``torchrun`` (see the package doc).

Run from the repository root. Exits 0 without CUDA (nothing to check), else with the ranks' status: 1 when a check
failed, 124 when the run did not finish before ``--deadline``.
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from typing import List, Optional, Sequence

from benchmarks.paths import ROOT
from checks.gpu.sizes import DEFAULT_SIZES, parse_sizes

DEFAULT_JSON = str(ROOT / "checks" / "gpu_results.json")
MAX_RANKS = 8
STATUS_ENV = "GPU_CHECK_STATUS"  # rank 0 writes "pass" or "fail" there (rank.STATUS_ENV; rank.py imports torch)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m checks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=None, help=f"ranks (default: min({MAX_RANKS}, GPUs); --cpu: 2)")
    parser.add_argument("--no-bench", action="store_true", help="skip the nccl rows")
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help="sizes per rank of the nccl rows, with B, KiB, MiB or GiB; a plain number is MiB (default %(default)s)",
    )
    parser.add_argument(
        "--json", default=None, help=f"results file (default {DEFAULT_JSON}; with --cpu, none unless given)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run the same checks over gloo on CPU tensors (tests the script)"
    )
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds for the whole run (default 540)")
    parser.add_argument("--peer-timeout", type=float, default=180.0, help="seconds a rank waits for a peer's report")
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)  # set by the launch below
    opts = parser.parse_args(argv)
    try:
        parse_sizes(opts.sizes)  # here, before any rank starts; each rank parses it again
    except ValueError as exc:
        parser.error(str(exc))
    if opts.json is None and not opts.cpu:
        opts.json = DEFAULT_JSON
    return opts


def no_gpu_message() -> str:
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    env = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
    return (
        f"gpu-check: needs a GPU: torch.cuda.is_available() is False here (torch {torch.__version__}, built for "
        f"CUDA {torch.version.cuda}{env}), so nothing was checked.\n"
        f"gpu-check: on a machine with NVIDIA GPUs it runs cmap, its collectives, shard_map and shard_model on "
        f"min({MAX_RANKS}, GPUs) ranks over nccl; `python -m checks.gpu --cpu` runs the same checks over "
        "gloo here."
    )


def _command(opts: argparse.Namespace, nproc: int) -> List[str]:
    forward = ["--sizes", opts.sizes, "--peer-timeout", str(opts.peer_timeout), "--json", opts.json or ""]
    forward += ["--cpu"] * opts.cpu + ["--no-bench"] * opts.no_bench
    # torchrun from this interpreter (the venv's), as a module: no PATH lookup can pick another torch.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return torchrun + ["-m", "checks.gpu", "--as-rank"] + forward


def launch(opts: argparse.Namespace) -> int:
    """Detect the GPUs and run the ranks; returns the exit status."""
    import torch

    env = dict(os.environ)
    if opts.cpu:
        nproc = opts.nproc or 2
        env["CUDA_VISIBLE_DEVICES"] = ""  # colossalai then picks its CPU accelerator, and gloo
        where = f"{nproc} CPU processes over gloo"
    elif not torch.cuda.is_available():
        print(no_gpu_message(), flush=True)
        return 0
    else:
        count = torch.cuda.device_count()
        nproc = opts.nproc or min(MAX_RANKS, count)
        if nproc > count:
            print(f"gpu-check: --nproc {nproc} needs {nproc} GPUs (nccl: one per rank); this machine has {count}.")
            return 2
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        where = f"{nproc} of {count} GPUs ({', '.join(names)}) over nccl"
        if nproc == 1:
            where += "; one GPU: a world of 1, the multi-rank checks need 2+ GPUs"
    print(f"gpu-check: launching torchrun on {where}; deadline {opts.deadline:.0f} s", flush=True)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # the venv's bin first
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        env[STATUS_ENV] = status = os.path.join(scratch, "status")
        proc = subprocess.Popen(_command(opts, nproc), cwd=ROOT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=opts.deadline)
        except subprocess.TimeoutExpired:
            _stop(proc)
            print(f"gpu-check: TIMEOUT: not done after {opts.deadline:.0f} s; the last lines above say where it was.")
            return 124
        except KeyboardInterrupt:
            _stop(proc)
            raise
        verdict = open(status).read().strip() if os.path.exists(status) else None
    if code != 0 or verdict != "pass":
        why = f"torchrun exit status {code}" if code != 0 else f"verdict {verdict or 'missing'}"
        print(f"gpu-check: FAILED ({why})", flush=True)
        return code or 1
    return 0


def _stop(proc: subprocess.Popen) -> None:
    """End torchrun and its ranks: they run in a session of their own, which this signals."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = parse_args(argv)
    if opts.as_rank:
        from checks.gpu import rank

        rank.main(opts)  # it ends the process
    return launch(opts)


if __name__ == "__main__":
    sys.exit(main())
