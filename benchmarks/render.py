"""Render ``docs/performance.md`` and its plots (``docs/img/perf_*.png``) from ``benchmarks/results.json``.

Run it as ``python benchmarks/render.py [results.json] [docs_dir]``; ``benchmarks/run.py`` calls it at the end.
"""

import json
import math
import os
import sys
from typing import Any, Dict, List, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from common import GOAL_LARGE, GOAL_TINY, MiB, fmt_bytes  # noqa: E402

DPI = 72
COLORS = {1: "tab:green", 2: "tab:blue", 4: "tab:orange"}


def _rst_to_md(text: str) -> str:
    """The docstring's reST bullets and literals as Markdown: one line per bullet or paragraph."""
    out: List[str] = []
    for line in text.replace("``", "`").splitlines():
        if line.startswith("  ") and out and out[-1]:
            out[-1] += " " + line.strip()
        else:
            out.append(line.strip())
    return "\n".join(out)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


# ------------------------------------------------------------------------------------------------ scaling model
def fit_comm(timing: Sequence[Dict[str, Any]]) -> Tuple[float, float, float]:
    """Fit ``T_comm(P, S) = alpha * (P - 1) + beta * S * (P - 1) / P`` to the measured ``gather_only`` times.

    Returns:
        (alpha seconds, beta seconds per byte, relative RMS residual), both coefficients kept non-negative.
    """
    rows, ys = [], []
    for r in timing:
        if r["P"] < 2:
            continue
        p, s = r["P"], r["out_bytes"]
        rows.append([p - 1, s * (p - 1) / p])
        ys.append(r["times"]["gather_only"]["median_s"])
    if not rows:
        return 0.0, 0.0, 0.0
    a, y = np.array(rows, dtype=float), np.array(ys, dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)  # relative least squares: small and large messages count alike
    coef, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    alpha, beta = float(coef[0]), float(coef[1])
    if alpha < 0 or beta < 0:
        col = 1 if alpha < 0 else 0
        only, *_ = np.linalg.lstsq(a[:, col : col + 1] * w[:, None], y * w, rcond=None)
        alpha, beta = (0.0, float(only[0])) if col == 1 else (float(only[0]), 0.0)
    pred = a @ np.array([alpha, beta])
    resid = float(np.sqrt(np.mean(((pred - y) / y) ** 2)))
    return alpha, beta, resid


def model_time(r: Dict[str, Any], p: int, alpha: float, beta: float, overhead: float) -> float:
    """Modelled time of one cmap call on ``p`` real cores: sharded compute + all_gather + cmap's fixed overhead."""
    t1 = r["times"]["vmap_full"]["median_s"]
    if p == 1:
        return t1
    rows = math.ceil(r["batch"] / p)
    s = r["out_bytes"]
    return t1 * rows / r["batch"] + alpha * (p - 1) + beta * s * (p - 1) / p + overhead


def _overheads(timing: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """cmap's fixed cost over the baseline per case: the median over P of ``cmap - baseline`` (at least 0)."""
    out: Dict[str, List[float]] = {}
    for r in timing:
        if r["P"] < 2:
            continue
        out.setdefault(r["case"], []).append(r["times"]["cmap"]["median_s"] - r["times"]["baseline"]["median_s"])
    return {k: max(float(np.median(v)), 0.0) for k, v in out.items()}


# --------------------------------------------------------------------------------------------------------- plots
def plot_overhead(timing: Sequence[Dict[str, Any]], path: str) -> None:
    fig, ax = plt.subplots(figsize=(8.4, 3.8), dpi=DPI)
    for p in sorted({r["P"] for r in timing}):
        rs = sorted((r for r in timing if r["P"] == p), key=lambda r: r["out_bytes"])
        xs = [max(r["out_bytes"], 1) for r in rs]
        ax.plot(xs, [r["ratios"]["cmap/baseline"] for r in rs], "o-", color=COLORS.get(p), label=f"cmap, P={p}")
        ax.plot(
            xs,
            [r["ratios"]["(baseline+status)/baseline"] for r in rs],
            "x:",
            color=COLORS.get(p),
            label=f"baseline + one status all_gather, P={p}",
        )
        ax.plot(
            xs,
            [r["ratios"].get("cpu cmap/baseline", float("nan")) for r in rs],
            "s",
            mfc="none",
            color=COLORS.get(p),
            ms=5,
            label=f"cmap, CPU time, P={p}",
        )
        for r, x in zip(rs, xs):
            ax.annotate(
                r["case"], (x, r["ratios"]["cmap/baseline"]), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.hlines(GOAL_TINY, 8, MiB, colors="red", linestyles="--", lw=1, label="goal, tiny case: 1.3x")
    ax.hlines(GOAL_LARGE, MiB, 2**27, colors="green", linestyles="--", lw=1, label=">= 1 MiB: 1.05x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("output bytes (whole batch)")
    ax.set_ylabel("time / hand-written baseline")
    ax.set_title("cmap overhead against narrow + vmap + all_gather_into_tensor", fontsize=9)
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_memory(memory: Sequence[Dict[str, Any]], path: str) -> None:
    cases = list(dict.fromkeys(r["case"] for r in memory))
    worlds = sorted({r["P"] for r in memory})
    fig, axes = plt.subplots(1, len(cases), figsize=(3.0 * len(cases), 3.4), dpi=DPI, squeeze=False)
    for ax, case in zip(axes[0], cases):
        rows = [r for r in memory if r["case"] == case and r["P"] == max(worlds)]
        labels = [
            r["variant"].replace("cmap ", "").replace(" (all_gather)", "").replace(" (no comm)", "") for r in rows
        ]
        full = rows[0]["full_out_bytes"]
        r0 = [r["per_rank"][0]["rss_peak"] / full for r in rows]
        others = [max(x["rss_peak"] for x in r["per_rank"][1:]) / full for r in rows]
        xs = np.arange(len(rows))
        ax.bar(xs - 0.2, r0, 0.4, label="rank 0")
        ax.bar(xs + 0.2, others, 0.4, label="max of other ranks")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
        ax.set_title(f"{case} (P={max(worlds)}, out {fmt_bytes(full)})", fontsize=8)
        ax.set_ylabel("peak RSS / full output", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_scaling(timing: Sequence[Dict[str, Any]], alpha: float, beta: float, path: str) -> None:
    ovh = _overheads(timing)
    ps = [1, 2, 4, 8, 16, 32]
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.6), dpi=DPI, sharey=True)
    cases = list(dict.fromkeys(r["case"] for r in timing if r["P"] > 1))
    panels = (
        (axes[0], alpha, beta, "with this machine's all_gather (fitted)"),
        (axes[1], 0.0, 0.0, "communication free or overlapped"),
    )
    for ax, a, b, title in panels:
        for i, case in enumerate(cases):
            rs = [r for r in timing if r["case"] == case and r["P"] > 1]
            ref = max(rs, key=lambda r: r["P"])
            t1 = ref["times"]["vmap_full"]["median_s"]
            color = f"C{i}"
            ax.plot(ps, [t1 / model_time(ref, p, a, b, ovh[case]) for p in ps], "o-", color=color, label=case, ms=3)
            if a:
                ax.plot([r["P"] for r in rs], [1.0 / r["ratios"]["cmap/vmap"] for r in rs], "x", color=color, ms=6)
        ax.plot(ps, ps, color="grey", lw=0.8, ls="--", label="ideal (P)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("P (real cores or devices)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("speed-up over one-process vmap")
    axes[1].legend(fontsize=7, ncol=2, loc="lower right")
    fig.suptitle("modelled scaling (lines); x: measured here, P processes sharing ~1 core", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------ markdown
def _goal_cells(r: Dict[str, Any]) -> str:
    if r["goal"] is None:
        return "- | -"
    return f"<= {r['goal']} | " + ("pass" if r["pass"] else "**FAIL**")


def _timing_table(timing: Sequence[Dict[str, Any]]) -> List[str]:
    lines = [
        "| case | what | P | bytes out | cmap ms | baseline ms | vmap ms | **cmap / baseline** | goal | pass "
        "| ratio of minima | CPU-time ratio | cmap / vmap | collectives / call | (baseline + status) / baseline "
        "| cmap / baseline without the status collective (estimate) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in timing:
        t, q = r["times"], r["ratios"]
        lines.append(
            f"| {r['case']} | {r['description']} | {r['P']} | {fmt_bytes(r['out_bytes'])} | "
            f"{_ms(t['cmap']['median_s'])} | {_ms(t['baseline']['median_s'])} | {_ms(t['vmap_full']['median_s'])} | "
            f"**{q['cmap/baseline']:.3f}** | {_goal_cells(r)} | "
            f"{q['min cmap/baseline']:.3f} | {q['cpu cmap/baseline']:.3f} | {q['cmap/vmap']:.2f} | {r['collectives_per_call']:g} | "
            f"{q['(baseline+status)/baseline']:.3f} | {_without_status(r):.3f} |"
        )
    return lines


def _without_status(r: Dict[str, Any]) -> float:
    """cmap / baseline if cmap's status all_gather cost nothing: (cmap - (baseline+status - baseline)) / baseline."""
    t = {k: v["median_s"] for k, v in r["times"].items()}
    return (t["cmap"] - max(t["baseline+status"] - t["baseline"], 0.0)) / t["baseline"]


def _memory_table(memory: Sequence[Dict[str, Any]]) -> List[str]:
    lines = [
        "| case | P | variant | rank 0 peak (RSS) | other ranks' max peak (RSS) | rank 0 peak (torch) "
        "| other ranks' max peak (torch) | full output | rank 0's shard output | collectives |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in memory:
        pr = r["per_rank"]
        coll = pr[0]["collectives"]
        lines.append(
            f"| {r['case']} | {r['P']} | {r['variant']} | {fmt_bytes(pr[0]['rss_peak'])} | "
            f"{fmt_bytes(max(x['rss_peak'] for x in pr[1:]))} | {fmt_bytes(pr[0]['torch_peak'])} | "
            f"{fmt_bytes(max(x['torch_peak'] for x in pr[1:]))} | {fmt_bytes(r['full_out_bytes'])} | "
            f"{fmt_bytes(r['shard_out_bytes'][0])} | {'-' if coll is None else coll} |"
        )
    return lines


def _memory_findings(memory: Sequence[Dict[str, Any]]) -> List[str]:
    """Bullets checking the memory goals against the measured rows."""
    rows = {(r["case"], r["P"], r["variant"]): r for r in memory}
    lines = []
    for case, p in dict.fromkeys((r["case"], r["P"]) for r in memory):
        get = lambda v: rows.get((case, p, v))  # noqa: E731
        d0, shard, local, all_ = (
            get("cmap dst=0"),
            get("vmap_shard (no comm)"),
            get("cmap dst=local"),
            get("cmap dst=-1"),
        )
        if not (d0 and shard and local and all_):
            continue
        full = d0["full_out_bytes"]
        others = max(x["rss_peak"] for x in d0["per_rank"][1:])
        others_shard = max(x["rss_peak"] for x in shard["per_rank"][1:])
        gap0 = d0["per_rank"][0]["rss_peak"] - d0["per_rank"][0]["torch_peak"]
        gap_all = all_["per_rank"][0]["rss_peak"] - all_["per_rank"][0]["torch_peak"]
        extra = others - others_shard
        gloo = (
            f"Rank 0's resident peak exceeds its torch allocations by {fmt_bytes(max(gap0, 0))} with `dst=0` and "
            f"{fmt_bytes(max(gap_all, 0))} with `dst=-1`"
        )
        if max(gap0, gap_all) > 0.5 * full:
            gloo += (
                ": gloo's gather and all_gather allocate a flat receive buffer of the full output on their worker "
                "thread and copy it into the given tensors (the baseline's all_gather pays the same; NCCL writes in "
                "place)."
            )
        else:
            gloo += " (gloo's flat receive buffer is not alive at the peak here)."
        lines.append(
            f"- {case}, P={p}: with `dst=0` the other ranks peak at {fmt_bytes(others)}, "
            f"{fmt_bytes(max(extra, 0))} above computing their shard alone ({fmt_bytes(others_shard)}); the full "
            f"output is {fmt_bytes(full)}, so they {'never allocate it' if extra < 0.9 * full else '**allocate it**'}"
            f"{' (the extra is the packed send buffer, one copy of the shard)' if extra > 0.1 * full else ''}. "
            f"`dst='local'` peaks at {fmt_bytes(max(x['rss_peak'] for x in local['per_rank']))}, the shard "
            f"computation itself. {gloo}"
        )
    return lines


# What a profiled cmap call's time is split into (the keys of results.json's profile "breakdown_us", in order).
PARTS = (
    ("collectives", "in torch.distributed"),
    ("vmap", "in torch.vmap(func)"),
    ("calls_out", "in torch ops, pytree, builtins called by cmap"),
    ("own", "cmap's own Python"),
)


def _ops_text(r0: Dict[str, Any]) -> str:
    """The last call's collectives, e.g. ``2 (all_gather, all_gather; 2.001 MiB sent)``."""
    last = r0["last_call"]
    return f"{len(last['ops'])} ({', '.join(last['ops']) or 'none'}; {fmt_bytes(last['bytes'])} sent)"


def _profile_summary(profile: Sequence[Dict[str, Any]]) -> List[str]:
    head = " | ".join(label for _, label in PARTS)
    lines = [
        f"| case | P | cmap us | baseline us | collectives / call | cmap us under cProfile | {head} "
        "| baseline's all_gather / vmap / rest us |",
        "|---|---|---|---|---|---|" + "---|" * len(PARTS) + "---|",
    ]
    for p in profile:
        r0 = p["per_rank"][0]
        us, pct, b = r0["breakdown_us"], r0["breakdown_pct"], r0["baseline_phases_us"]
        cells = " | ".join(f"{pct[k]:.0f}% ({us[k]:.0f})" for k, _ in PARTS)
        rest = b["narrow"] + b["alloc/pad"] + b["cut"]
        lines.append(
            f"| {p['case']} | {p['P']} | {r0['cmap_us']:.0f} | {r0['baseline_us']:.0f} | {_ops_text(r0)} | "
            f"{r0['profiled_us']:.0f} | {cells} | {b['all_gather']:.0f} / {b['vmap']:.0f} / {rest:.0f} |"
        )
    return lines


def _function_table(rows: Sequence[Dict[str, Any]], first: str) -> List[str]:
    """A markdown table of profiled functions, the cumulative (``first="cum"``) or own time columns first."""
    cum_first = first == "cum"
    cols = ("cumulative us", "% of call", "own us", "% of call")
    cols = cols if cum_first else cols[2:] + cols[:2]
    lines = ["| function (file) | calls / call | " + " | ".join(cols) + " |", "|---|---|---|---|---|---|"]
    for t in rows:
        fn = t["function"].replace("|", "\\|")
        cum = f"{t['cum_us']:.1f} | {t['cum_pct']:.1f}%"
        own = f"{t['own_us']:.1f} | {t['own_pct']:.1f}%"
        lines.append(
            f"| `{fn}` | {t['calls_per_call']:g} | " + (f"{cum} | {own} |" if cum_first else f"{own} | {cum} |")
        )
    return lines


def _profile_section(profile: Sequence[Dict[str, Any]], top: int = 12) -> List[str]:
    lines: List[str] = _profile_summary(profile) + [
        "",
        "Each part is a percentage of the profiled call (us per call in brackets); what cProfile could not attribute "
        "(rounding) is left out. cProfile adds a roughly fixed cost to every Python function call, so it inflates "
        "cmap's own Python share: compare *cmap us under cProfile* with the unprofiled *cmap us*. All figures are "
        "from rank 0, from a different moment of the run than the table above, so the totals differ.",
        "",
    ]
    for p in profile:
        r0 = p["per_rank"][0]
        lines += [
            f"#### {p['case']}, P={p['P']} ({p['calls']} calls; rank 0)",
            "",
            f"Unprofiled (median of blocks): cmap {r0['cmap_us']:.0f} us, baseline {r0['baseline_us']:.0f} us per call "
            f"(max over ranks: cmap {max(x['cmap_us'] for x in p['per_rank']):.0f} us, baseline "
            f"{max(x['baseline_us'] for x in p['per_rank']):.0f} us). Under cProfile: {r0['profiled_us']:.0f} us per "
            f"call. Collectives per call: {_ops_text(r0)}"
            f"{', fast path (plan reused)' if r0['last_call']['fast_path'] else ''}. Baseline phases (median us per "
            "call): " + ", ".join(f"{k} {v:.0f}" for k, v in r0["baseline_phases_us"].items()) + ".",
            "",
            "cmap's functions by cumulative time (us per cmap call; % of the profiled call):",
            "",
        ]
        lines += _function_table(r0["package_by_cumulative"][:top], "cum")
        lines += ["", "cmap's functions by own time (where *cmap's own Python* goes):", ""]
        lines += _function_table(r0["package_by_own"][:8], "own")
        lines += ["", "All functions by own time (cmap's, torch's and builtins):", ""]
        lines += _function_table(r0["cprofile_top"][:10], "own")
        lines.append("")
    return lines


def render(results_path: str, docs_dir: str) -> str:
    """Write ``docs_dir/performance.md`` and ``docs_dir/img/perf_*.png``; returns the markdown path."""
    with open(results_path) as f:
        res = json.load(f)
    meta, timing, memory = res["meta"], res["timing"], res["memory"]
    img = os.path.join(docs_dir, "img")
    os.makedirs(img, exist_ok=True)
    plot_overhead(timing, os.path.join(img, "perf_overhead.png"))
    if memory:
        plot_memory(memory, os.path.join(img, "perf_memory.png"))
    alpha, beta, resid = fit_comm(timing)
    plot_scaling(timing, alpha, beta, os.path.join(img, "perf_scaling.png"))
    ovh = _overheads(timing)

    judged = [r for r in timing if r["goal"] is not None]
    passed = sum(bool(r["pass"]) for r in judged)
    md: List[str] = [
        "# Performance",
        "",
        "<!-- generated by benchmarks/render.py from benchmarks/results.json; do not edit by hand -->",
        "",
        "Measured by `make bench` (`python benchmarks/run.py`), which launches its own gloo worlds of P = 2 and "
        "P = 4 processes on 127.0.0.1 and times every variant side by side, interleaved, in one run.",
        "",
        f"Run: {meta['date']}, torch {meta['torch']}, colossalai-cmap {meta['colossalai_cmap']} "
        f"(commit {meta['package_commit']}), Python {meta['python']}, {meta['machine']}; {meta['backend']}. "
        f"The machine has about one core of throughput and was shared with other jobs (load average "
        f"{meta.get('load_average_at_start', ['?'])[0]:.3g} at the start, {meta.get('load_average_at_end', ['?'])[0]:.3g}"
        f" at the end), so absolute times mean little; the ratios are what to read. Whole run: {meta['wall_s']} s.",
        "",
        "## Goals",
        "",
        "- At 1 MiB of output or more, cmap takes at most **1.05x** the hand-written baseline's time.",
        "- For tiny calls, at most **1.3x** (the tiny case).",
        "- The goals are judged in worlds of P = 2 and P = 4. The P = 1 rows (cmap's software overhead alone) and "
        "the medium case (256 KiB, neither tiny nor 1 MiB) are reported without a goal.",
        "- One data collective for all output leaves, plus at most one small metadata or status exchange.",
        "- Replicated inputs are not copied; with `dst=r` other ranks hold at most their own shard's output; with "
        "`dst=-1` the result is one preallocated buffer.",
        "",
        f"**{passed} of {len(judged)}** (case, P) timings with a goal meet it in this run.",
        "",
        "## Results",
        "",
    ]
    md += _timing_table(timing)
    md += [
        "",
        "P=1 rows come from a world of one process, where every collective is a local copy: there cmap / baseline "
        "is cmap's own software overhead. *cmap / baseline* is the ratio of the medians (the goal's measure); *ratio "
        "of minima* uses the fastest repetition of each; *CPU-time ratio* is the ratio of the median CPU time per "
        "call summed over ranks (all threads), which other jobs on the machine disturb much less. "
        "*(baseline + status) / baseline* is the hand-written baseline with one extra 5 x int64 all_gather (and "
        "`.tolist()`) in front of its data all_gather: what a second, tiny collective costs on its own; the last "
        "column subtracts that cost from cmap's time, estimating cmap's ratio if its status round cost nothing. "
        "*cmap / vmap* compares with single-process `torch.vmap` on the whole batch; here the P ranks share 2 vCPUs "
        "with about one core's throughput (and other jobs), so it says little about scaling (see the scaling "
        "model). Every case first checks that "
        "cmap, the baseline and single-process vmap agree (largest absolute difference over all cases: "
        f"{max(r['max_abs_diff'] for r in timing):.3g}).",
        "",
    ]
    md += [
        "The two ways to tell every rank every other rank's status, each at its leanest, hand-written: "
        "*(baseline + status) / baseline* is a second, tiny all_gather (cmap's way for outputs too large for the "
        "status round's payload, which grows to at most 1 MiB per rank: the status round, then one all_gather of the "
        "padded rows straight into the result buffer, issued right behind the round when the call repeats); *fused_header / baseline* is one all_gather of a 96-byte int64 header and the padded "
        "rows packed into one byte buffer, the header table read back and the rows cut out with one `torch.cat` "
        "(cmap's way for outputs that fit the payload: they ride in the status round, one collective per call). "
        "Per (case, P), (baseline + status) / fused_header: "
        + "; ".join(
            f"{r['case']} P={r['P']}: {r['ratios']['(baseline+status)/baseline']:.3f} / "
            f"{r['ratios']['fused_header/baseline']:.3f}"
            for r in timing
        )
        + ". The tiny case's fused_header is the floor of any design that carries a status header: cmap's own "
        "software overhead comes on top of it.",
        "",
    ]
    ceil = [r for r in timing if "baseline_ceil_plan" in r["times"]]
    if ceil:
        md += [
            "Uneven B and the split. The baseline splits like `torch.tensor_split` (the first `B % P` ranks get one "
            "more row), pads every short shard to the largest for the all-gather, and cuts the padding out with one "
            "`torch.cat`. cmap splits gathered outputs like `torch.chunk` (blocks of `ceil(B / P)`): only the last "
            "shard pads, and the first B rows of the gather buffer are the result, returned as a view. Part of cmap's "
            "lead on the uneven case is that split, not cmap itself; `baseline_ceil_plan` is the hand-written baseline "
            "with cmap's split, and against it cmap's ratio is: "
            + "; ".join(
                f"P={r['P']}: baseline_ceil_plan {_ms(r['times']['baseline_ceil_plan']['median_s'])} ms "
                f"({r['times']['baseline_ceil_plan']['median_s'] / r['times']['baseline']['median_s']:.3f}x the "
                f"baseline), cmap / baseline_ceil_plan "
                f"**{r['times']['cmap']['median_s'] / r['times']['baseline_ceil_plan']['median_s']:.3f}**"
                for r in ceil
            )
            + ".",
            "",
        ]
    md += [
        "![overhead against output size](img/perf_overhead.png)",
        "",
        "### How it was measured",
        "",
        _rst_to_md(meta["timing_method"]),
        "",
    ]
    # profiles from an older results.json (a different format) are left out; rerun benchmarks/run.py for them
    profile = [p for p in res.get("profile", []) if p.get("per_rank") and "breakdown_us" in p["per_rank"][0]]
    if profile:
        md += [
            "## Where cmap's overhead goes",
            "",
            "Measured inside the ranks with `cProfile`: every rank profiles its own repeated calls of the case's "
            "cmap (nothing in the package is patched or wrapped). Every call makes one status round, an all_gather of a "
            "96-byte header plus a payload per rank (256 bytes at first, growing to what calls on the group needed, up "
            "to 1 MiB, alike on every rank); outputs that fit in the payload ride in it (one collective per call), "
            "larger outputs take a second collective, one all_gather of the padded "
            "rows straight into the result buffer. The collectives of each call are counted by "
            "`colossalai_cmap.record_collectives()` and `cmap(f).stats`. The call's time is split, from the "
            "profile's caller edges, into: time inside `torch.distributed` (issuing the collectives and waiting for "
            "the peers; also its group queries, a few us), inside `torch.vmap` (the per-example function included), in the other functions cmap's "
            "code calls (torch ops such as allocations, copies and views, pytree, builtins), and cmap's own Python "
            "(the own time of the package's functions). The baseline's phases are timed by hand in the same blocks.",
            "",
        ]
        md += _profile_section(profile)
    if memory:
        md += [
            "## Memory",
            "",
            "Peak memory of one repeated call (not the first) above the level just before it, per rank.",
            "",
            _rst_to_md(meta["memory_method"].split("\n", 1)[1].strip()),
            "",
        ]
        md += _memory_table(memory)
        md += ["", "What the rows show:", ""] + _memory_findings(memory)
        md += ["", "![peak memory against dst](img/perf_memory.png)", ""]
    if res.get("zero_copy"):
        md += ["### Replicated inputs are not copied", ""]
        for z in res["zero_copy"]:
            ok = all(all(v for k, v in m.items() if k != "rows") for r in z["per_rank"] for m in r.values())
            md.append(
                f"- P={z['P']}: on every rank, the mapped shard `func` receives (with `mode='batched'`, and with "
                f"`mode='vmap'` after unwrapping the BatchedTensor) starts at `x.data_ptr() + offset * "
                f"x.stride(0) * itemsize` in the input's own storage, and the `in_dims=None` argument is the caller's "
                f"tensor itself: **{'yes' if ok else 'NO'}** (rows per rank: "
                f"{[r['vmap']['rows'] for r in z['per_rank']]})."
            )
        md.append("")
    if res.get("chunk"):
        md += [
            "### `chunk_size` bounds each rank's peak activation memory",
            "",
            "`outer_activation(x) = tanh(x[:, None] * x[None, :]).sum(0)` on B=1024, D=128 with `dst='local'`: "
            "each example has a 64 KiB intermediate (two are alive at once: the product and its tanh).",
            "",
            "| P | chunk_size | rows per rank | intermediate per chunk | peak RSS (max over ranks) "
            "| peak torch (max over ranks) |",
            "|---|---|---|---|---|---|",
        ]
        for c in res["chunk"]:
            md.append(
                f"| {c['P']} | {c['chunk_size']} | {c['rows_per_rank']} | {fmt_bytes(c['intermediate_bytes'])} | "
                f"{fmt_bytes(max(x['rss_peak'] for x in c['per_rank']))} | "
                f"{fmt_bytes(max(x['torch_peak'] for x in c['per_rank']))} |"
            )
        md.append("")
    md += [
        "## Scaling model",
        "",
        "These CPUs cannot show scaling (the P ranks share about one core), so it is modelled from measured parts:",
        "",
        "    T_cmap(P) = T_vmap(B) * ceil(B / P) / B  +  alpha * (P - 1) + beta * S * (P - 1) / P  +  T_over",
        "    speed-up(P) = T_vmap(B) / T_cmap(P)",
        "",
        "- `T_vmap(B)`: measured single-process vmap on the whole batch (`vmap_full`). Compute is assumed to split "
        "evenly over P real cores; the measured `vmap_shard` / `vmap_full` column below checks that vmap's time is "
        "proportional to the rows.",
        "- `alpha * (P - 1) + beta * S * (P - 1) / P`: a ring all_gather of S output bytes, with alpha and beta "
        "fitted (relative least squares) to the measured `gather_only` times of every case and P: "
        f"**alpha = {alpha * 1e6:.0f} us per step, beta = {beta * 1e9:.3g} ns per byte "
        f"({(1 / beta / MiB) if beta else float('inf'):.3g} MiB/s)**, relative RMS residual {resid:.2f}. Measured "
        "here, with P processes sharing one core, both are pessimistic for real cores.",
        "- `T_over`: cmap's measured fixed cost over the baseline (median over P of cmap - baseline, at least 0).",
        "",
        "![modelled scaling](img/perf_scaling.png)",
        "",
        "| case | S | T_vmap(B) ms | vmap_shard / vmap_full (P=2, P=4) | T_over ms | speed-up, fitted all_gather: "
        "P=2 / 4 / 8 / 16 | speed-up, communication free: P=2 / 4 / 8 / 16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in dict.fromkeys(r["case"] for r in timing if r["P"] > 1):
        rs = sorted((r for r in timing if r["case"] == case and r["P"] > 1), key=lambda r: r["P"])
        ref = rs[-1]
        t1 = ref["times"]["vmap_full"]["median_s"]
        frac = ", ".join(
            f"{r['times']['vmap_shard']['median_s'] / r['times']['vmap_full']['median_s']:.2f}" for r in rs
        )
        fitted = " / ".join(f"{t1 / model_time(ref, p, alpha, beta, ovh[case]):.2g}" for p in (2, 4, 8, 16))
        free = " / ".join(f"{t1 / model_time(ref, p, 0.0, 0.0, ovh[case]):.2g}" for p in (2, 4, 8, 16))
        md.append(
            f"| {case} | {fmt_bytes(ref['out_bytes'])} | {_ms(t1)} | {frac} | {ovh[case] * 1e3:.3g} | {fitted} "
            f"| {free} |"
        )
    md += [
        "",
        "The fitted all_gather here (loopback gloo, P processes sharing about one core) is far slower than a real "
        "interconnect, so the left panel is a pessimistic bound and the right one (T_comm = 0) an optimistic one. "
        "Where T_vmap(B) is much larger than T_over, the right panel approaches P; calls whose whole computation "
        "costs less than cmap's fixed overhead and one collective cannot gain from more ranks at any P.",
        "",
        "## GPU",
        "",
        res.get("gpu_note", "Not measured: this run had no GPU machine. The benchmark runs unchanged on one."),
        "",
    ]
    path = os.path.join(docs_dir, "performance.md")
    with open(path, "w") as f:
        f.write("\n".join(md))
    return path


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    results = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "results.json")
    docs = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(here), "docs")
    print(render(results, docs))
