"""``make gpu-check``'s script where there is no GPU: it says that it needs one and exits 0; every module parses.

The checks themselves need CUDA and nccl. ``test_checks_over_gloo`` runs the same checks on CPU tensors over gloo
(``--cpu``), and ``test_bandwidth_rows_over_gloo`` the nccl rows' code (sizes, the added microseconds, the table),
so their logic is exercised on every machine.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checks.gpu import bandwidth
from checks.gpu.core import Ctx
from checks.gpu.report import Reporter
from checks.gpu.sizes import DEFAULT_SIZES, parse_sizes, size_label

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


def test_sizes_take_units_and_plain_mib():
    KiB, MiB = 1 << 10, 1 << 20
    assert DEFAULT_SIZES == "1KiB,64KiB,1MiB,16MiB,64MiB"
    assert parse_sizes(DEFAULT_SIZES) == [KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB]
    assert parse_sizes("1,16,64") == [MiB, 16 * MiB, 64 * MiB]  # the older form: MiB
    assert parse_sizes(" 512b, 0.5MiB,2kib ,1GiB") == [512, MiB // 2, 2 * KiB, 1 << 30]
    for bad, says in [("1KB", "'1KB' is not a size"), ("64,x", "'x' is not a size"), ("0", "positive whole")]:
        with pytest.raises(ValueError, match=says):
            parse_sizes(bad)
    with pytest.raises(ValueError, match="1.5B"):
        parse_sizes("1.5B")
    labels = [size_label(n) for n in (KiB, 64 * KiB, MiB, 64 * MiB, 768, 3 * MiB // 2)]
    assert labels == ["1 KiB", "64 KiB", "1 MiB", "64 MiB", "768 B", "1.5 MiB"]


def test_bad_sizes_stop_before_any_rank_starts():
    done = _run("--sizes", "1KiB,64KB", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--sizes: '64KB' is not a size" in done.stderr


def _bandwidth_rows(sizes, blocks, block_s):
    import torch.distributed as dist

    rep = Reporter(None, dist.get_rank(), dist.get_world_size())  # None: the default (gloo) group
    ctx = Ctx(torch.device("cpu"), rep.rank, rep.size, rep)
    rows = bandwidth.measure(ctx, sizes, blocks=blocks, block_s=block_s)
    verdicts = [(v.status, v.name, v.detail) for v in rep.verdicts]
    return rows, bandwidth.table(rows, ctx.size, "gloo"), bandwidth.summary(rows, "gloo"), verdicts


def test_bandwidth_rows_over_gloo(worlds):
    sizes = [100, 1 << 10, 1000, 64 << 10]  # under the smallest row, 1 KiB, rounded down to 768 B, 64 KiB
    [(rows, table, summary, verdicts), *others] = worlds(2).run(_bandwidth_rows, sizes, 3, 0.002, deadline=240)
    assert [o[0] for o in others] == [rows]  # every rank has the same rows (the slowest rank's times)
    assert verdicts[0][:2] == ("SKIP", "rows at 100 B per rank") and "under 256 B" in verdicts[0][2], verdicts
    assert [v[0] for v in verdicts[1:]] == ["PASS"] * 3, verdicts
    assert "768 B per rank (1000 B asked, rounded down" in verdicts[2][1]
    impls = ["torch all_gather_into_tensor", "cmap(identity, src='local')", "cmap(identity), src=None"]
    impls += ["torch all_reduce (in place)", "cmap psum, src/dst='local'"]
    assert [(r["bytes_per_rank"], r["impl"]) for r in rows] == [(n, i) for n in (1024, 768, 64 << 10) for i in impls]
    for row in rows:
        base = next(r for r in rows if r["op"] == row["op"] and r["bytes_per_rank"] == row["bytes_per_rank"])
        assert row["added_us_per_call"] == pytest.approx((row["time_ms"] - base["time_ms"]) * 1e3)
        assert row["blocks"] == 3 and row["calls_per_block"] >= 1
    assert sum(row["added_us_per_call"] == 0 for row in rows) == 6  # the torch rows
    assert "| op | size/rank | implementation | us / call | added us / call |" in table
    assert "median over 3 timed blocks" in table
    gather_local = next(r for r in rows if r["impl"] == impls[1] and r["bytes_per_rank"] == 1024)
    line = (
        f"| all_gather | 1 KiB | {impls[1]} | {gather_local['time_ms'] * 1e3:.1f} | "
        f"{gather_local['added_us_per_call']:+.1f} |"
    )
    assert line in table, table
    assert [s.split(":")[0] for s in summary[:3]] == [
        f"gloo all_gather at {n}/rank" for n in ("1 KiB", "768 B", "64 KiB")
    ]
    assert f"{impls[1]} {gather_local['added_us_per_call']:+.1f} us per call on {impls[0]}'s" in summary[0]
    assert len(summary) == 5 and all("64 KiB/rank" in s for s in summary[3:]), summary
