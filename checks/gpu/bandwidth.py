"""The nccl rows: cmap's all_gather and all_reduce against ``torch.distributed``'s own, on the same bytes.

Per size S (bytes per rank), float32, variants interleaved in every repetition:

* all_gather: ``dist.all_gather_into_tensor`` into an output allocated per call (cmap allocates its result per
  call too); ``cmap(identity, src="local")`` of this rank's S bytes (64 rows), the same data movement; and
  ``cmap(identity)`` with ``src=None``, every rank holding the whole batch and narrowing its rows, the default.
* all_reduce: ``dist.all_reduce`` in place on S bytes; ``psum`` inside ``cmap(..., src="local", dst="local")``
  of one example of S bytes per rank.

S is a whole number of 64 rows of float32 (256 B at least; a size in between is rounded down, and the check's line
says so; a size under 256 B is a SKIP line). One timed block is a barrier, then ``calls`` back-to-back calls and one
device synchronize, timed on every rank; a block's time is the slowest rank's, and a row's time the median over
:data:`BLOCKS` blocks. ``calls`` is chosen per row so that a block lasts about :data:`BLOCK_S` (a 1 KiB call takes
microseconds, a 64 MiB one milliseconds), so every size costs about the same time and small sizes get the many calls
a stable microsecond needs. ``added_us_per_call`` is cmap's row time minus torch's for the same op and size.
Bandwidths are nccl-tests': algbw is the bytes each rank ends up with (all_gather: P * S; all_reduce: S) over the
time, busbw scales it by (P - 1) / P for all_gather and 2 (P - 1) / P for all_reduce, so that it compares with the
links' speed at any P. Before timing, each cmap variant's result is checked against the torch variant's.
"""

import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

import colossalai_cmap as cm
from checks.gpu.core import Ctx
from checks.gpu.report import compare
from checks.gpu.sizes import size_label

MIB = 1 << 20
ROWS = 64  # rows per rank: cmap maps over them
MIN_BYTES = 4 * ROWS  # one float32 column
BLOCKS = 9  # timed blocks per row (odd: the median is one of them)
BLOCK_S = 0.05  # each block lasts about this long
MAX_CALLS = 20000  # calls per block at most
WARMUP = 3  # calls before timing: from the third, cmap's rounds are sized for the data they carry
GATHER_ROW = ("torch all_gather_into_tensor", "cmap(identity, src='local')")  # the same data movement


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
            ("all_gather", GATHER_ROW[0], torch_all_gather),
            ("all_gather", GATHER_ROW[1], lambda: self.gather_local(mine)),
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


def measure(ctx: Ctx, sizes: List[int], blocks: int = BLOCKS, block_s: float = BLOCK_S) -> List[Dict[str, Any]]:
    """Every row for every size (bytes per rank) whose results check out, as dicts (also the JSON rows)."""
    rows: List[Dict[str, Any]] = []
    for asked in sizes:
        nbytes = asked // MIN_BYTES * MIN_BYTES
        if nbytes == 0:
            why = f"{size_label(asked)} per rank is under {MIN_BYTES} B, the smallest row: {ROWS} rows of one float32"
            ctx.rep.skip("bandwidth", f"rows at {size_label(asked)} per rank", why)
            continue
        name = f"results at {size_label(nbytes)} per rank"
        if nbytes != asked:
            name += f" ({asked} B asked, rounded down to {ROWS} rows of float32)"
        sized = Sizes(ctx, nbytes)
        if ctx.rep.check("bandwidth", name, sized.check):
            rows.extend(_timed_rows(ctx, sized, blocks, block_s))
    for row in rows:
        base = _base(rows, row)
        row["time_vs_torch"] = row["time_ms"] / base["time_ms"]
        row["added_us_per_call"] = (row["time_ms"] - base["time_ms"]) * 1e3
    return rows


def _base(rows: List[Dict[str, Any]], row: Dict[str, Any]) -> Dict[str, Any]:
    """Torch's row for ``row``'s op and size (the first of them)."""
    return next(r for r in rows if r["op"] == row["op"] and r["bytes_per_rank"] == row["bytes_per_rank"])


def _calls_per_block(ctx: Ctx, call: Callable[[], Any], block_s: float) -> int:
    """Calls that make a block of about ``block_s``, from probe blocks of 1, 8, 64, ... calls until one lasts an
    eighth of that (the faster of two such). Every rank takes the same decisions: a block's time is the slowest rank's, on every rank.
    """
    calls = 1
    while True:
        seconds = _block(ctx, call, calls)
        if seconds * calls >= block_s / 8 or calls >= MAX_CALLS:
            seconds = min(seconds, _block(ctx, call, calls))  # one slow probe (a first call's set-up) must not decide
            return max(1, min(MAX_CALLS, round(block_s / max(seconds, 1e-9))))
        calls = min(MAX_CALLS, calls * 8)


def _timed_rows(ctx: Ctx, sized: Sizes, blocks: int, block_s: float) -> List[Dict[str, Any]]:
    calls = sized.calls()
    per_block = []
    for _, _, call in calls:
        for _ in range(WARMUP):
            call()
        per_block.append(_calls_per_block(ctx, call, block_s))
    times: List[List[float]] = [[] for _ in calls]
    for rep in range(blocks):
        for j in range(len(calls)):
            k = (j + rep) % len(calls)  # rotate which variant goes first
            times[k].append(_block(ctx, calls[k][2], per_block[k]))
    return [
        {
            **_row(ctx, op, impl, sized.nbytes, statistics.median(ts), _counted(call) if "cmap" in impl else 1),
            "calls_per_block": n,
            "blocks": blocks,
        }
        for (op, impl, call), ts, n in zip(calls, times, per_block)
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
    """The rows as a markdown table, with cmap's ratios to torch's and the microseconds it adds per call."""
    blocks = rows[0]["blocks"] if rows else BLOCKS
    lines = [
        f"{backend} rows: P={size}, float32, median over {blocks} timed blocks of the slowest rank, each block about "
        f"{BLOCK_S * 1e3:g} ms of back-to-back calls (calls/block); busbw as nccl-tests: all_gather x (P-1)/P, "
        "all_reduce x 2(P-1)/P; added us / call: cmap's time per call minus torch's",
        "",
        "| op | size/rank | implementation | us / call | added us / call | algbw GB/s | busbw GB/s | time / torch | "
        "busbw / torch | collectives/call | calls/block |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = _base(rows, r)
        added = "(base)" if r is base else f"{r['added_us_per_call']:+.1f}"
        bus = f"{r['busbw_GBps']:.2f}" if size > 1 else "-"
        bus_ratio = f"{r['busbw_GBps'] / base['busbw_GBps']:.2f}" if size > 1 else "-"
        lines.append(
            f"| {r['op']} | {size_label(r['bytes_per_rank'])} | {r['impl']} | {r['time_ms'] * 1e3:.1f} | {added} | "
            f"{r['algbw_GBps']:.2f} | {bus} | {r['time_vs_torch']:.2f} | {bus_ratio} | {r['collectives_per_call']} | "
            f"{r['calls_per_block']} |"
        )
    if size == 1:
        lines.append("")
        lines.append(
            "P=1: nothing crosses a link (busbw is 0 by definition), and cmap runs as plain torch.vmap with no "
            "collective: these rows are software overhead only. The bandwidth rows need 2+ GPUs."
        )
    return "\n".join(lines)


def summary(rows: List[Dict[str, Any]], backend: str) -> List[str]:
    """One line per size for cmap's all_gather against ``all_gather_into_tensor`` (the same data movement), then
    the other cmap rows at the largest size."""
    lines = []
    for torch_row in (r for r in rows if r["impl"] == GATHER_ROW[0]):
        cmap_row = next(
            (r for r in rows if r["impl"] == GATHER_ROW[1] and r["bytes_per_rank"] == torch_row["bytes_per_rank"]),
            None,
        )
        if cmap_row is not None:
            lines.append(
                f"{backend} all_gather at {size_label(torch_row['bytes_per_rank'])}/rank: {cmap_row['impl']} "
                f"{cmap_row['added_us_per_call']:+.1f} us per call on {torch_row['impl']}'s "
                f"{torch_row['time_ms'] * 1e3:.1f} us ({cmap_row['time_vs_torch']:.2f}x its time; "
                f"{cmap_row['calls_per_block']} and {torch_row['calls_per_block']} calls/block x "
                f"{cmap_row['blocks']} blocks)"
            )
    largest = max((r["bytes_per_rank"] for r in rows), default=None)
    for row in rows:
        if "cmap" in row["impl"] and row["impl"] != GATHER_ROW[1] and row["bytes_per_rank"] == largest:
            lines.append(
                f"{backend} rows at {size_label(largest)}/rank: {row['impl']} takes {row['time_vs_torch']:.2f}x "
                f"torch's time ({row['added_us_per_call']:+.1f} us per call)"
            )
    return lines
