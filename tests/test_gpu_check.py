"""``make gpu-check``'s script where there is no GPU: it says that it needs one and exits 0; every module parses.

The checks themselves need CUDA and nccl. ``test_checks_over_gloo`` runs the same checks on CPU tensors over gloo
(``--cpu``), so their logic is exercised on every machine.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "checks" / "gpu"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # hides any GPU: torch.cuda.is_available() is False
    command = [sys.executable, "-m", "checks.gpu", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_without_cuda_it_says_so_and_exits_0():
    done = _run(timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu-check: needs a GPU: torch.cuda.is_available() is False" in done.stdout
    assert "nothing was checked" in done.stdout


def test_every_module_parses():
    modules = sorted(PACKAGE.glob("*.py"))
    assert {p.name for p in modules} >= {"__main__.py", "rank.py", "core.py", "sharded.py", "syncs.py", "bandwidth.py"}
    for path in modules:
        ast.parse(path.read_text(), filename=str(path))


@pytest.mark.slow
def test_checks_over_gloo():
    done = _run("--cpu", "--nproc", "2", "--no-bench", timeout=400)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert "FAIL " not in out, out
    assert "PASS collectives: ppermute inside cmap" in out, out
    assert "PASS shard_model: tensor-parallel Llama" in out, out
    assert "SKIP host syncs" in out, out  # the probes need CUDA
