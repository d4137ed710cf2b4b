"""Render ``docs/performance.md`` and its plots (``docs/img/perf_*.png``) from results.json and the template
``benchmarks/performance.md.tmpl``.

    python -m benchmarks.render [RESULTS] [DOCS]    # default: benchmarks/results.json, docs/

``python -m benchmarks.run`` calls :func:`render` at the end of a run. The template is Markdown with
``string.Template`` fields (``$name``), all of them filled here, and optional sections between
``<!-- if NAME -->`` and ``<!-- end NAME -->`` lines, kept only when the results hold what they show (a run with
``--no-profile`` has no profile section). What the report says about the machine comes from results.json's ``meta``,
as the run measured it (``machine.py``).
"""

import argparse
import json
import os
import re
from string import Template
from typing import Any, Dict, List, Optional, Sequence

from benchmarks import paths, plots, tables
from benchmarks.goals import GOAL_LARGE, GOAL_MID, GOAL_SMALL, MiB
from benchmarks.scaling import fit_comm, overheads

# Where GPU numbers come from: the rows above time gloo on CPU tensors.
GPU_CHECK = (
    "On a GPU machine, `make gpu-check` (`python -m checks.gpu`) times cmap's all_gather and all_reduce "
    "against `torch.distributed`'s over nccl at 1 KiB, 64 KiB, 1 MiB, 16 MiB and 64 MiB per rank, with the "
    "microseconds cmap adds per call, and writes `checks/gpu_results.json`; "
    "see [colossalai.md](colossalai.md#on-gpus-make-gpu-check)."
)
_SECTION = re.compile(r"^<!-- if (\w+) -->\n(.*?)^<!-- end \1 -->\n", re.DOTALL | re.MULTILINE)


def fill(template: str, fields: Dict[str, Any], sections: Dict[str, bool]) -> str:
    """The template with the sections that ``sections`` marks false removed, the others' marker lines dropped, and
    every ``$field`` substituted (a missing field raises ``KeyError``)."""

    def keep(m: "re.Match[str]") -> str:
        return m.group(2) if sections[m.group(1)] else ""

    return Template(_SECTION.sub(keep, template)).substitute(fields)


def render(results_path: str, docs_dir: str, template_path: Optional[str] = None) -> str:
    """Write ``docs_dir/performance.md`` and ``docs_dir/img/perf_*.png``; returns the markdown path."""
    with open(results_path) as f:
        res = json.load(f)
    meta, timing, memory = res["meta"], res["timing"], res["memory"]
    machine = _MachineWords(meta, timing, res.get("gpu_note"), res.get("collective_cpu", []))
    img = os.path.join(docs_dir, "img")
    os.makedirs(img, exist_ok=True)
    alpha, beta, resid = fit_comm(timing)
    plots.plot_overhead(timing, os.path.join(img, "perf_overhead.png"))
    if memory:
        plots.plot_memory(memory, os.path.join(img, "perf_memory.png"))
    plots.plot_scaling(timing, alpha, beta, machine.measured_on, os.path.join(img, "perf_scaling.png"))
    # profiles from an older results.json (a different format) are left out; rerun the benchmarks for them
    profile = [p for p in res.get("profile", []) if p.get("per_rank") and "breakdown_us" in p["per_rank"][0]]
    ceil = [r for r in timing if "baseline_ceil_plan" in r["times"]]
    fields = {
        **_run_fields(meta, timing, machine),
        **_result_fields(timing, ceil, profile, res),
        "alpha_us": f"{alpha * 1e6:.0f}",
        "beta_ns": f"{beta * 1e9:.3g}",
        "bandwidth": f"{(1 / beta / MiB) if beta else float('inf'):.3g}",
        "residual": f"{resid:.2f}",
        "scaling_table": "\n".join(tables.scaling_table(timing, (alpha, beta), overheads(timing))),
    }
    sections = {
        "ceil": bool(ceil),
        "threshold": bool(res.get("threshold")),
        "profile": bool(profile),
        "memory": bool(memory),
        "zero_copy": bool(res.get("zero_copy")),
        "chunk": bool(res.get("chunk")),
    }
    with open(template_path or paths.TEMPLATE) as f:
        text = fill(f.read(), fields, sections)
    path = os.path.join(docs_dir, "performance.md")
    with open(path, "w") as f:
        f.write(text)
    return path


def _run_fields(meta: Dict[str, Any], timing: Sequence[Dict[str, Any]], machine: "_MachineWords") -> Dict[str, Any]:
    """When and where the run was: the software, the machine as measured, and the goals' tally."""
    judged = [r for r in timing if r["goal"] is not None]
    return {
        **{k: meta[k] for k in ("date", "torch", "colossalai_cmap", "package_commit", "python", "machine", "backend")},
        "wall_s": meta["wall_s"],
        "load_start": _load(meta, "load_average_at_start"),
        "load_end": _load(meta, "load_average_at_end"),
        "machine_measured": machine.described,
        "worlds": machine.worlds,
        "measured_on": machine.measured_on,
        "vmap_caveat": machine.vmap_caveat,
        "scaling_intro": machine.scaling_intro,
        "fit_note": machine.fit_note,
        "gpu_note": machine.gpu_note,
        "goal_large": GOAL_LARGE,
        "goal_mid": GOAL_MID,
        "goal_small": GOAL_SMALL,
        "passed": sum(bool(r["pass"]) for r in judged),
        "judged": len(judged),
    }


def _result_fields(
    timing: Sequence[Dict[str, Any]], ceil: Sequence[Dict[str, Any]], profile: Sequence[Dict[str, Any]], res: Dict
) -> Dict[str, Any]:
    """The tables and lists of the results, profile and memory sections."""
    meta, memory = res["meta"], res["memory"]
    return {
        "timing_table": "\n".join(tables.timing_table(timing)),
        "max_abs_diff": f"{max(r['max_abs_diff'] for r in timing):.3g}",
        "status_vs_fused": tables.status_vs_fused(timing),
        "ceil_plan": tables.ceil_plan(ceil),
        "threshold_table": "\n".join(tables.threshold_table(res.get("threshold", []))),
        "timing_method": _as_markdown(meta["timing_method"]),
        "profile_summary": "\n".join(tables.profile_summary(profile)),
        "profile_details": "\n".join(tables.profile_details(profile)),
        "memory_method": _as_markdown(meta["memory_method"].split("\n", 1)[1].strip()),
        "memory_table": "\n".join(tables.memory_table(memory)),
        "memory_findings": "\n".join(tables.memory_findings(memory)),
        "zero_copy": "\n".join(tables.zero_copy(res.get("zero_copy", []))),
        "chunk_table": "\n".join(tables.chunk_table(res.get("chunk", []))),
    }


def _as_markdown(text: str) -> str:
    """A method text as Markdown, one line per bullet or paragraph. Older results files hold it as reST (double
    backquotes, bullets wrapped onto indented lines); Markdown passes through unchanged."""
    out: List[str] = []
    for line in text.replace("``", "`").splitlines():
        if line.startswith("  ") and out and out[-1]:
            out[-1] += " " + line.strip()
        else:
            out.append(line.strip())
    return "\n".join(out)


def _load(meta: Dict[str, Any], key: str) -> str:
    value = meta.get(key)
    return f"{value[0]:.3g}" if value else "(not recorded)"


class _MachineWords:
    """What the report says about the machine, from what the run measured (``machine.describe``, and each world's
    ``machine.collective_cpu``): the CPUs, the probe's parallel throughput, what a tiny collective alone costs the
    host, the GPUs. Older results files lack these fields; then it says less, and nothing that was not measured."""

    def __init__(
        self,
        meta: Dict[str, Any],
        timing: Sequence[Dict[str, Any]],
        gpu_note: Optional[str],
        collectives: Sequence[Dict[str, Any]] = (),
    ) -> None:
        self.meta, self.note, self.collectives = meta, gpu_note, collectives
        self.ps = sorted({r["P"] for r in timing if r["P"] > 1})
        self.top = max(self.ps, default=1)
        self.throughput = {e["processes"]: e["cores"] for e in meta.get("parallel_throughput", [])}
        usable = meta.get("usable_cpus")
        if self.top in self.throughput:  # did the largest world's ranks get (most of) a core each?
            self.shared: Optional[bool] = self.throughput[self.top] < 0.8 * self.top
        else:
            self.shared = None if usable is None else usable < self.top
        cpus = f"{usable} usable CPUs" if usable is not None else meta["machine"]
        at_top = self.throughput.get(self.top)
        self.measured_on = cpus + (f", {at_top:.2g} cores' throughput at P={self.top}" if at_top else "")

    @property
    def worlds(self) -> str:
        return " and ".join(f"P = {p}" for p in self.ps)

    @property
    def described(self) -> str:
        m = self.meta
        if "cpu_model" not in m:
            return "not described in this results file (it predates the machine fields)"
        text = f"{m['cpu_model']}, {m['logical_cpus']} logical CPUs ({m['usable_cpus']} usable by the run), "
        text += m["platform"]
        if self.throughput:
            each = " and ".join(f"{c:.2g} (P = {p})" for p, c in sorted(self.throughput.items()))
            text += f"; a probe at the start, P processes spinning a loop at once, got {each} cores' worth of work done"
        for c in self.collectives:
            text += (
                f"; a 16-byte all_gather alone at P = {c['processes']} took {c['wall_us']:.0f} us per call, the "
                f"calling thread {c['caller_cpu_us']:.0f} us of CPU and gloo's threads {c['other_cpu_us']:.0f} us, "
                f"per rank: {c['cores_busy']:.2g} of the {m['usable_cpus']} usable CPUs busy with collectives alone"
            )
        return text

    @property
    def vmap_caveat(self) -> str:
        if self.shared is False:
            return (
                f"here every rank had a core of its own ({self.measured_on}), so it shows the speed-up on loopback "
                "gloo (see also the scaling model)."
            )
        if self.shared:
            return (
                f"here the P ranks ran on {self.measured_on}, so it says little about scaling (see the scaling model)."
            )
        return f"here the P ranks ran on {self.measured_on}; the scaling model shows what more cores would give."

    @property
    def scaling_intro(self) -> str:
        if self.shared is False:
            return (
                f"This run measured P up to {self.top} on {self.measured_on}, over loopback gloo; beyond that, and "
                "with a real interconnect, it is modelled from measured parts:"
            )
        if self.shared:
            return (
                f"This run cannot show scaling (the P ranks ran on {self.measured_on}), so it is modelled from "
                "measured parts:"
            )
        return f"Scaling is modelled from measured parts (the P ranks ran on {self.measured_on}):"

    @property
    def fit_note(self) -> str:
        if self.shared:
            return f"Measured here, with the P processes on {self.measured_on}, both are pessimistic for real cores."
        return f"Measured here on loopback gloo ({self.measured_on})."

    @property
    def gpu_note(self) -> str:
        if self.note:  # a note written into results.json by hand
            return self.note
        if self.meta.get("gpus"):
            names = ", ".join(self.meta["gpus"])
            return (
                f"Not measured: the benchmark times CPU tensors over gloo; this machine's GPUs ({names}) were not used. "
                + GPU_CHECK
            )
        return "Not measured: this run had no GPU machine. The benchmark runs unchanged on one. " + GPU_CHECK


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Render from the command line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.render", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", default=str(paths.RESULTS), help="results file (default %(default)s)")
    parser.add_argument("docs", nargs="?", default=str(paths.DOCS), help="where to write (default %(default)s)")
    opts = parser.parse_args(argv)
    print(render(opts.results, opts.docs))


if __name__ == "__main__":
    main()
