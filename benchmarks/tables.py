"""The report's Markdown tables and lists, built from results.json's rows (one list of lines each)."""

from typing import Any, Dict, List, Sequence, Tuple

from benchmarks.goals import fmt_bytes
from benchmarks.scaling import model_time


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def _goal_cells(r: Dict[str, Any]) -> str:
    """The goal and pass cells of a results row."""
    if r["goal"] is None:
        return "- | -"
    return f"<= {r['goal']} | " + ("pass" if r["pass"] else "**FAIL**")


def timing_table(timing: Sequence[Dict[str, Any]]) -> List[str]:
    """The results table: one row per (case, P)."""
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
            f"**{q['cmap/baseline']:.3f}** | {_goal_cells(r)} | {q['min cmap/baseline']:.3f} | "
            f"{q['cpu cmap/baseline']:.3f} | {q['cmap/vmap']:.2f} | {r['collectives_per_call']:g} | "
            f"{q['(baseline+status)/baseline']:.3f} | {_without_status(r)} |"
        )
    return lines


def _without_status(r: Dict[str, Any]) -> str:
    """cmap / baseline if cmap's status all_gather cost nothing: (cmap - (baseline+status - baseline)) / baseline;
    ``-`` where cmap made one collective (the status rode with the data: there is no status collective to take out).
    """
    if r["collectives_per_call"] < 2:
        return "-"
    t = {k: v["median_s"] for k, v in r["times"].items()}
    return f"{(t['cmap'] - max(t['baseline+status'] - t['baseline'], 0.0)) / t['baseline']:.3f}"


def memory_table(memory: Sequence[Dict[str, Any]]) -> List[str]:
    """Peak memory per rank for each dst choice and the baselines: one row per (case, P, variant)."""
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


def memory_findings(memory: Sequence[Dict[str, Any]]) -> List[str]:
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


def profile_summary(profile: Sequence[Dict[str, Any]]) -> List[str]:
    """One row per profiled (case, P): totals, collectives and the parts of a cmap call (rank 0's)."""
    head = " | ".join(label for _, label in PARTS)
    lines = [
        f"| case | P | cmap us | baseline us | collectives / call | function calls / call (cmap's) "
        f"| cmap us under cProfile | {head} | baseline's all_gather / vmap / rest us |",
        "|---|---|---|---|---|---|---|" + "---|" * len(PARTS) + "---|",
    ]
    for p in profile:
        r0 = p["per_rank"][0]
        us, pct, b = r0["breakdown_us"], r0["breakdown_pct"], r0["baseline_phases_us"]
        cells = " | ".join(f"{pct[k]:.0f}% ({us[k]:.0f})" for k, _ in PARTS)
        rest = b["narrow"] + b["alloc/pad"] + b["cut"]
        made = r0.get("function_calls_per_call")  # results from before it was counted have none
        made_text = f"{made['all']:.0f} ({made['package']:.0f})" if made else "-"
        lines.append(
            f"| {p['case']} | {p['P']} | {r0['cmap_us']:.0f} | {r0['baseline_us']:.0f} | {_ops_text(r0)} | "
            f"{made_text} | {r0['profiled_us']:.0f} | {cells} | {b['all_gather']:.0f} / {b['vmap']:.0f} / {rest:.0f} |"
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


def profile_details(profile: Sequence[Dict[str, Any]], top: int = 12) -> List[str]:
    """Per profiled (case, P): the unprofiled and profiled totals, then cmap's functions by cumulative and own time
    and all functions by own time (rank 0's)."""
    lines: List[str] = []
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


def status_vs_fused(timing: Sequence[Dict[str, Any]]) -> str:
    """Per (case, P): (baseline + status) / baseline and fused_header / baseline."""
    return "; ".join(
        f"{r['case']} P={r['P']}: {r['ratios']['(baseline+status)/baseline']:.3f} / "
        f"{r['ratios']['fused_header/baseline']:.3f}"
        for r in timing
    )


def threshold_table(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """cmap's two ways of gathering a repeated call's output, per (P, size): each against the baseline, and against
    each other (paired)."""
    lines = [
        "| P | output | baseline ms | rows in the round / baseline | round + all_gather / baseline "
        "| rows in the round / round + all_gather (paired) | collectives / call |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        q, n = r["ratios"], r["collectives_per_call"]
        lines.append(
            f"| {r['P']} | {fmt_bytes(r['out_bytes'])} | {r['times_ms']['baseline']:.3g} | {q['rows in the round']:.3f} "
            f"| {q['round + all_gather']:.3f} | **{r['fused/two']:.3f}** "
            f"| {n['rows in the round']} / {n['round + all_gather']} |"
        )
    return lines


def ceil_plan(ceil: Sequence[Dict[str, Any]]) -> str:
    """Per P of the rows timed with ``baseline_ceil_plan``: its time, against the baseline and against cmap."""
    return "; ".join(
        f"P={r['P']}: baseline_ceil_plan {_ms(r['times']['baseline_ceil_plan']['median_s'])} ms "
        f"({r['times']['baseline_ceil_plan']['median_s'] / r['times']['baseline']['median_s']:.3f}x the "
        f"baseline), cmap / baseline_ceil_plan "
        f"**{r['times']['cmap']['median_s'] / r['times']['baseline_ceil_plan']['median_s']:.3f}**"
        for r in ceil
    )


def zero_copy(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """One bullet per P: whether every rank's shard and replicated argument were the caller's storage."""
    lines = []
    for z in rows:
        ok = all(all(v for k, v in m.items() if k != "rows") for r in z["per_rank"] for m in r.values())
        lines.append(
            f"- P={z['P']}: on every rank, the mapped shard `func` receives (with `mode='batched'`, and with "
            f"`mode='vmap'` after unwrapping the BatchedTensor) starts at `x.data_ptr() + offset * "
            f"x.stride(0) * itemsize` in the input's own storage, and the `in_dims=None` argument is the caller's "
            f"tensor itself: **{'yes' if ok else 'NO'}** (rows per rank: "
            f"{[r['vmap']['rows'] for r in z['per_rank']]})."
        )
    return lines


def chunk_table(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """Peak memory per ``chunk_size``: one row per (P, chunk_size)."""
    lines = [
        "| P | chunk_size | rows per rank | intermediate per chunk | peak RSS (max over ranks) "
        "| peak torch (max over ranks) |",
        "|---|---|---|---|---|---|",
    ]
    for c in rows:
        lines.append(
            f"| {c['P']} | {c['chunk_size']} | {c['rows_per_rank']} | {fmt_bytes(c['intermediate_bytes'])} | "
            f"{fmt_bytes(max(x['rss_peak'] for x in c['per_rank']))} | "
            f"{fmt_bytes(max(x['torch_peak'] for x in c['per_rank']))} |"
        )
    return lines


def scaling_table(timing: Sequence[Dict[str, Any]], fit: Tuple[float, float], ovh: Dict[str, float]) -> List[str]:
    """The scaling model per case: S, T_vmap(B), vmap_shard / vmap_full per P, T_over, and the modelled speed-ups
    with the fitted all_gather (``fit``: alpha, beta) and with free communication."""
    ps = sorted({r["P"] for r in timing if r["P"] > 1})
    lines = [
        f"| case | S | T_vmap(B) ms | vmap_shard / vmap_full ({', '.join(f'P={p}' for p in ps)}) | T_over ms "
        "| speed-up, fitted all_gather: P=2 / 4 / 8 / 16 | speed-up, communication free: P=2 / 4 / 8 / 16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in dict.fromkeys(r["case"] for r in timing if r["P"] > 1):
        rs = sorted((r for r in timing if r["case"] == case and r["P"] > 1), key=lambda r: r["P"])
        ref = rs[-1]
        t1 = ref["times"]["vmap_full"]["median_s"]
        frac = ", ".join(
            f"{r['times']['vmap_shard']['median_s'] / r['times']['vmap_full']['median_s']:.2f}" for r in rs
        )
        fitted = " / ".join(f"{t1 / model_time(ref, p, *fit, ovh[case]):.2g}" for p in (2, 4, 8, 16))
        free = " / ".join(f"{t1 / model_time(ref, p, 0.0, 0.0, ovh[case]):.2g}" for p in (2, 4, 8, 16))
        lines.append(
            f"| {case} | {fmt_bytes(ref['out_bytes'])} | {_ms(t1)} | {frac} | {ovh[case] * 1e3:.3g} | {fitted} "
            f"| {free} |"
        )
    return lines
