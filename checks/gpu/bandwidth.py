"""The nccl rows: cmap's all_gather and all_reduce against ``torch.distributed``'s own, on the same bytes.

Per size S (bytes per rank), float32, variants interleaved in every repetition:

* all_gather: ``dist.all_gather_into_tensor`` into an output allocated per call (cmap allocates its result per
  call too); ``cmap(identity, src="local")`` of this rank's S bytes (64 rows), the same data movement; and
  ``cmap(identity)`` with ``src=None``, every rank holding the whole batch and narrowing its rows, the default.
* all_reduce: ``dist.all_reduce`` in place on S bytes; ``psum`` inside ``cmap(..., src="local", dst="local")``
  of one example of S bytes per rank.

One timed block is a barrier, then ``inner`` calls and one device synchronize, timed on every rank; a block's time
is the slowest rank's, and a row's time the median over the repetitions. Bandwidths are nccl-tests': algbw is the
bytes each rank ends up with (all_gather: P * S; all_reduce: S) over the time, busbw scales it by (P - 1) / P for
all_gather and 2 (P - 1) / P for all_reduce, so that it compares with the links' speed at any P. Before timing,
each cmap variant's result is checked against the torch variant's.
"""

import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

import colossalai_cmap as cm
from checks.gpu.core import Ctx
from checks.gpu.report import compare

MIB = 1 << 20
ROWS = 64  # rows per rank: cmap maps over them
REPS = 7
BLOCK_S = 0.02  # aim for blocks of about this long


def _identity(v: torch.Tensor) -> torch.Tensor:
    return v


def _psum(v: torch.Tensor) -> torch.Tensor:
    return cm.psum(v, "i")


class Sizes:
    """One size's tensors and calls, made once and shared by the check and the timed blocks."""

    def __init__(self, ctx: Ctx, nbytes: int) -> None:
        n, dev, cols = ctx.size, ctx.device, nbytes // 4 // ROWS
        self.n, self.nbytes = n, nbytes
        gen = torch.Generator(device=dev).manual_seed(1000 + ctx.rank)
        self.mine = torch.randn(ROWS, cols, device=dev, generator=gen)
        self.whole = torch.empty(n * ROWS, cols, device=dev)
        dist.all_gather_into_tensor(self.whole, self.mine)  # the same global batch on every rank, by construction
        self.summed = self.mine.reshape(1, -1).clone()
        dist.all_reduce(self.summed)
        self.buffer = torch.zeros(1, ROWS * cols, device=dev)  # zeros: repeated in-place sums stay finite
        self.gather_local, self.gather_none = cm.cmap(_identity, src="local"), cm.cmap(_identity)
        self.reduce_local = cm.cmap(_psum, axis_name="i", src="local", dst="local")

    def check(self) -> str:
        """Each cmap variant's result against the torch one's (raises AssertionError)."""
        compare("cmap all_gather src='local'", self.gather_local(self.mine), self.whole, exact=True)
        compare("cmap all_gather src=None", self.gather_none(self.whole), self.whole, exact=True)
        note = compare("cmap psum", self.reduce_local(self.mine.reshape(1, -1)), self.summed, atol=1e-4, rtol=1e-5)
        return f"cmap's all_gather (src='local', src=None) bitwise, psum {note}, against torch's on the same bytes"

    def calls(self) -> List[Tuple[str, str, Callable[[], Any]]]:
        """(op, implementation, call), torch's first for each op."""
        mine, whole, row = self.mine, self.whole, self.mine.reshape(1, -1)

        def torch_all_gather() -> torch.Tensor:
            out = torch.empty_like(whole)
            dist.all_gather_into_tensor(out, mine)
            return out

        return [
            ("all_gather", "torch all_gather_into_tensor", torch_all_gather),
            ("all_gather", "cmap(identity, src='local')", lambda: self.gather_local(mine)),
            ("all_gather", "cmap(identity), src=None", lambda: self.gather_none(whole)),
            ("all_reduce", "torch all_reduce (in place)", lambda: dist.all_reduce(self.buffer)),
            ("all_reduce", "cmap psum, src/dst='local'", lambda: self.reduce_local(row)),
        ]


def _sync(ctx: Ctx) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()


def _block(ctx: Ctx, call: Callable[[], Any], inner: int) -> float:
    """Seconds per call of one timed block, the slowest rank's."""
    _sync(ctx)
    dist.barrier(group=ctx.rep.ctl)
    start = time.perf_counter()
    for _ in range(inner):
        call()
    _sync(ctx)
    mine = (time.perf_counter() - start) / inner
    return max(ctx.rep.gather(mine, "bandwidth block"))


def _counted(call: Callable[[], Any]) -> int:
    with cm.record_collectives() as log:
        call()
    return log.count


def measure(ctx: Ctx, sizes_mib: List[float], reps: int = REPS) -> List[Dict[str, Any]]:
    """Every row for every size whose results check out, as dicts (also the JSON rows)."""
    rows: List[Dict[str, Any]] = []
    for mib in sizes_mib:
        nbytes = max(int(mib * MIB) // (4 * ROWS), 1) * (4 * ROWS)
        sized = Sizes(ctx, nbytes)
        if ctx.rep.check("bandwidth", f"results at {nbytes / MIB:g} MiB per rank", sized.check):
            rows.extend(_timed_rows(ctx, sized, reps))
    for row in rows:
        base = next(r for r in rows if r["op"] == row["op"] and r["bytes_per_rank"] == row["bytes_per_rank"])
        row["time_vs_torch"] = row["time_ms"] / base["time_ms"]
    return rows


def _timed_rows(ctx: Ctx, sized: Sizes, reps: int) -> List[Dict[str, Any]]:
    calls = sized.calls()
    inner = []
    for _, _, call in calls:  # warm-up, then size the blocks
        call()
        inner.append(max(1, min(50, int(BLOCK_S / max(_block(ctx, call, 2), 1e-6)))))
    times: List[List[float]] = [[] for _ in calls]
    for rep in range(reps):
        for j in range(len(calls)):
            k = (j + rep) % len(calls)  # rotate which variant goes first
            times[k].append(_block(ctx, calls[k][2], inner[k]))
    return [
        _row(ctx, op, impl, sized.nbytes, statistics.median(ts), _counted(call) if "cmap" in impl else 1)
        for (op, impl, call), ts in zip(calls, times)
    ]


def _row(ctx: Ctx, op: str, impl: str, nbytes: int, seconds: float, collectives: int) -> Dict[str, Any]:
    n = ctx.size
    algbw = (n * nbytes if op == "all_gather" else nbytes) / seconds / 1e9
    factor = (n - 1) / n if op == "all_gather" else 2 * (n - 1) / n
    return {
        "op": op,
        "impl": impl,
        "bytes_per_rank": nbytes,
        "time_ms": seconds * 1e3,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * factor,
        "collectives_per_call": collectives,
    }


def table(rows: List[Dict[str, Any]], size: int, backend: str) -> str:
    """The rows as a markdown table, with cmap's ratios to torch's."""
    lines = [
        f"{backend} rows: P={size}, float32, median over {REPS} timed blocks of the slowest rank "
        "(busbw as nccl-tests: all_gather x (P-1)/P, all_reduce x 2(P-1)/P)",
        "",
        "| op | MiB/rank | implementation | ms | algbw GB/s | busbw GB/s | time / torch | busbw / torch | "
        "collectives/call |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next(b for b in rows if b["op"] == r["op"] and b["bytes_per_rank"] == r["bytes_per_rank"])
        bus = f"{r['busbw_GBps']:.1f}" if size > 1 else "-"
        bus_ratio = f"{r['busbw_GBps'] / base['busbw_GBps']:.2f}" if size > 1 else "-"
        lines.append(
            f"| {r['op']} | {r['bytes_per_rank'] / MIB:g} | {r['impl']} | {r['time_ms']:.3f} | "
            f"{r['algbw_GBps']:.1f} | {bus} | {r['time_vs_torch']:.2f} | {bus_ratio} | {r['collectives_per_call']} |"
        )
    if size == 1:
        lines.append("")
        lines.append(
            "P=1: nothing crosses a link (busbw is 0 by definition), and cmap runs as plain torch.vmap with no "
            "collective: these rows are software overhead only. The bandwidth rows need 2+ GPUs."
        )
    return "\n".join(lines)
