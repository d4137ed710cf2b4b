"""The plain-text summary that ``python -m benchmarks.run`` prints when a run ends (the report is ``render.py``'s)."""

from typing import Any, Dict, List

from benchmarks.goals import fmt_bytes


def _goal_text(r: Dict[str, Any]) -> str:
    """``<=1.05 ok``, ``<=1.3 NO`` or ``-`` (no goal)."""
    return "-" if r["goal"] is None else f"<={r['goal']} " + ("ok" if r["pass"] else "NO")


def format_table(timing: List[Dict[str, Any]]) -> str:
    """The summary table (plain text)."""
    head = (
        f"{'case':8s} {'P':>2s} {'cmap/base':>9s} {'goal':>6s} {'cmap/vmap':>9s} {'coll/call':>9s} "
        f"{'bytes out':>10s} {'cmap':>10s} {'baseline':>10s} {'vmap':>10s} {'+status/base':>12s}"
    )
    lines = [head, "-" * len(head)]
    for r in timing:
        t, q = r["times"], r["ratios"]
        lines.append(
            f"{r['case']:8s} {r['P']:>2d} {q['cmap/baseline']:>9.3f} "
            f"{_goal_text(r):>11s} {q['cmap/vmap']:>9.3f} "
            f"{r['collectives_per_call']:>9.2f} {fmt_bytes(r['out_bytes']):>10s} "
            f"{t['cmap']['median_s'] * 1e3:>8.3f}ms {t['baseline']['median_s'] * 1e3:>8.3f}ms "
            f"{t['vmap_full']['median_s'] * 1e3:>8.3f}ms {q['(baseline+status)/baseline']:>12.3f}"
        )
    return "\n".join(lines)


def format_memory(memory: List[Dict[str, Any]]) -> str:
    """Peak memory per rank for each dst choice (plain text)."""
    head = (
        f"{'case':7s} {'P':>2s} {'variant':22s} {'rank0 rss':>10s} {'others rss':>10s} {'rank0 torch':>11s} "
        f"{'others torch':>12s} {'full out':>9s} {'coll':>4s}"
    )
    lines = [head, "-" * len(head)]
    for r in memory:
        ranks = r["per_rank"]
        others = ranks[1:]
        lines.append(
            f"{r['case']:7s} {r['P']:>2d} {r['variant']:22s} {fmt_bytes(ranks[0]['rss_peak']):>10s} "
            f"{fmt_bytes(max(o['rss_peak'] for o in others)):>10s} {fmt_bytes(ranks[0]['torch_peak']):>11s} "
            f"{fmt_bytes(max(o['torch_peak'] for o in others)):>12s} {fmt_bytes(r['full_out_bytes']):>9s} "
            f"{'' if ranks[0]['collectives'] is None else ranks[0]['collectives']:>4}"
        )
    return "\n".join(lines)
