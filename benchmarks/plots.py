"""The report's figures (``docs/img/perf_*.png``), drawn with matplotlib from results.json's rows."""

from typing import Any, Dict, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.goals import GOAL_LARGE, GOAL_MID, GOAL_SMALL, LARGE_BYTES, MID_BYTES, MiB, fmt_bytes  # noqa: E402
from benchmarks.scaling import model_time, overheads  # noqa: E402

DPI = 72
COLORS = {1: "tab:green", 2: "tab:blue", 4: "tab:orange"}


def plot_overhead(timing: Sequence[Dict[str, Any]], path: str) -> None:
    """cmap / baseline (wall and CPU time) and (baseline + status) / baseline against the output size, per P."""
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
    ax.hlines(GOAL_SMALL, 8, MID_BYTES, colors="red", linestyles="--", lw=1, label=f"goal, < 1 MiB: {GOAL_SMALL}x")
    ax.hlines(GOAL_MID, MID_BYTES, LARGE_BYTES, colors="orange", linestyles="--", lw=1, label=f"1-4 MiB: {GOAL_MID}x")
    ax.hlines(GOAL_LARGE, LARGE_BYTES, 2**27, colors="green", linestyles="--", lw=1, label=f">= 4 MiB: {GOAL_LARGE}x")
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
    """Peak RSS over the full output per dst choice, rank 0 and the other ranks, in the largest world."""
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


def plot_scaling(timing: Sequence[Dict[str, Any]], alpha: float, beta: float, measured_on: str, path: str) -> None:
    """Modelled speed-up against P, with the fitted all_gather and with free communication; x: measured here.

    Args:
        measured_on: what the P ranks ran on, for the title (e.g. ``2 CPUs, 1.1 cores' throughput``).
    """
    ovh = overheads(timing)
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
    fig.suptitle(f"modelled scaling (lines); x: measured here, P processes on {measured_on}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
