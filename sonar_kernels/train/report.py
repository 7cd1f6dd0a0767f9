"""sonar-train's report: the summary table and the figure (the statistics they print: ``stats``)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from sonar_kernels.train.clipping import clipping_lines, spike_effect_lines
from sonar_kernels.train.memory import LABELS
from sonar_kernels.train.stats import (
    MIN_TIMED_STEPS,
    NEGLIGIBLE_DELTA,
    TIMING_WARMUP,
    heldout_statistics,
    memory_note,
    nats,
    paired_difference,
    peak_shares,
    speedup,
    step_time_summary,
)

# The statistics live in ``stats``; the report's readers (verdicts, cli, the tests) find them here as well.
__all__ = ["MIN_TIMED_STEPS", "NEGLIGIBLE_DELTA", "TIMING_WARMUP", "heldout_statistics", "memory_note", "nats",
           "paired_difference", "peak_shares", "plot", "speedup", "step_time_summary", "summary_table"]  # fmt: skip


# What the sonar arm executes, by resolved backend.
BACKEND_RUNS = {
    "triton": "the Triton kernels, AdamW in the wgrad epilogue",
    "torch": "torch's grouped GEMM, each expert tensor's AdamW right after its gradient (no Triton kernel)",
}


def summary_table(report: dict) -> str:
    arms = report["arms"]
    std = arms.get("standard")
    lines = []
    if "backend" in report:
        lines.append(
            f"{_source(report)}, {_seeds(report)}, "
            f"data {report.get('data', '?')}, commit {report.get('commit', 'unknown')[:12]}"
        )
        if report.get("model"):
            lines.append(report["tokens"])
        if "sonar" in arms:
            lines.append(f"sonar arm: backend {report['backend']} ({BACKEND_RUNS[report['backend']]})")
        lines.append("")
    measured = any(r["peak_memory_bytes"] for r in arms.values())
    # "vs standard": paired, over the seeds both arms ran.
    header = f"{'arm':<20} {'seeds':>5} {'held-out loss':>13} {'vs standard':>11}"
    if measured:
        header += f" {'peak MiB':>9} {'vs standard':>11} {'peak in':>14}"
    header += f" {'step ms median (p10-p90)':>25} {'clipped':>7}"
    lines.append(header)
    most = max(len(r["seeds"]) for r in arms.values())
    fewer = False
    for name, r in arms.items():
        d_loss = f"{paired_difference(r, std):+.4f}" if std else "-"  # no standard arm: nothing to compare
        mark = "*" if len(r["seeds"]) < most else " "
        fewer = fewer or mark == "*"
        line = f"{name:<20} {len(r['seeds']):>5} {r['heldout_loss']:>12.4f}{mark} {d_loss:>11}"
        if measured:
            d_mem = f"{100 * (r['peak_memory_bytes'] / std['peak_memory_bytes'] - 1):+.1f}%" if std else "-"
            line += f" {r['peak_memory_bytes'] / 2**20:>9.2f} {d_mem:>11} {r['peak_phase']:>14}"
        t = r["step_time"]
        timing = (
            f"{1000 * t['median_s']:.1f} ({1000 * t['p10_s']:.1f}-{1000 * t['p90_s']:.1f})"
            if t["samples"]
            else "not timed"
        )
        clips = r.get("grad_norms") is None or any(g is not None for g in r["grad_norms"])
        clipped = f"{100 * r['clip_fraction']:.0f}%" if clips else "-"  # all-in-backward clips nothing
        line += f" {timing:>25} {clipped:>7}"
        lines.append(line)
    if fewer:
        lines.append(
            "* fewer seeds than the other arms: its held-out loss is the mean over its own seeds, not "
            'comparable to theirs; "vs standard" is paired, over the seeds both ran'
        )
    if "speedup" in report:
        # Printed as sonar / standard, the convention of every ratio the project prints (below 1: sonar
        # faster); report.json's "speedup" keeps standard / sonar.
        ratio = report["speedup"]
        lines.append(
            f"step time sonar / standard: {1 / ratio:.2f}x, below 1 is faster ({report['speedup_note']})"
            if ratio is not None
            else f"step time sonar / standard: {report['speedup_note']}"
        )
    if "timing" in report:
        lines.append(f"step times from {report['timing']}")
    if report.get("rule_compile_s"):
        lines.append(
            f'compiled update rules (torch.compile, docs/design.md "The update rules"): their first calls took '
            f"{report['rule_compile_s']:.1f} s in this process, compilation included, outside every step time"
        )
    if measured:
        lines.append("")
        lines.append("peak memory by category (MiB, first seed): " + ", ".join(LABELS))
        for name, r in arms.items():
            parts = " ".join(f"{r['peak_memory'][c] / 2**20:8.2f}" for c in LABELS)
            lines.append(f"  {name:<20} {parts}")
        if report.get("peak_memory_note"):
            lines.append(report["peak_memory_note"])
    else:
        lines.append("peak memory: not measured (--no-memory)")
    heldout = report.get("heldout")
    if heldout is not None:
        lines.append("")
        lines.append("held-out loss by seed (nats per byte; the same held-out batches for every seed):")
        seeds = arms["standard"]["seeds"]
        names = [n for n in arms if n != "standard"]
        lines.append(f"  {'seed':>6} {'standard':>10} " + " ".join(f"{n:>20}" for n in names))
        for i, seed in enumerate(seeds):
            cells = []
            for n in names:
                by_seed = dict(zip(arms[n]["seeds"], arms[n]["heldout_losses"], strict=True))
                cells.append(f"{by_seed[seed]:>20.4f}" if seed in by_seed else f"{'-':>20}")
            lines.append(f"  {seed:>6} {arms['standard']['heldout_losses'][i]:>10.4f} " + " ".join(cells))
        se = heldout["standard_error"]
        spread = (
            f", standard error {se:.4f}; the standard arm's seed-to-seed standard deviation "
            f"{heldout['standard_seed_sd']:.4f}"
            if se is not None
            else ""
        )
        lines.append(
            f"  sonar - standard: {' '.join(f'{d:+.4f}' for d in heldout['deltas'])}; "
            f"mean {nats(heldout['mean_delta'])}{spread}"
        )
        lines.append(f"  verdict: {heldout['verdict']}")
    for arm, suffix in (("sonar-8bit", "8bit"), ("torchao-8bit", "torchao_8bit")):
        eight_bit = report.get(f"heldout_{suffix}")
        if eight_bit is None:
            continue
        lines.append(
            f"  {arm} - standard: {' '.join(f'{d:+.4f}' for d in eight_bit['deltas'])}; "
            f"mean {nats(eight_bit['mean_delta'])}; verdict: {eight_bit['verdict']}"
        )
        ratio = report.get(f"peak_memory_ratio_{suffix}")
        if ratio is not None:
            lines.append(f"  {arm} peak memory / standard's: {ratio:.3f}")
    lines += clipping_lines(report) + spike_effect_lines(report)
    versus = report.get("versus_mixed_precision")
    if versus:
        lines.append("")
        lines.append(
            "against mixed-precision (standard AdamW on fp32 master copies of every parameter, fp32 moments; "
            "held-out difference over paired seeds, peak memory ratio):"
        )
        for name, entry in versus.items():
            held = entry["heldout"]
            ratio = entry["peak_memory_ratio"]
            memory = f"; peak memory {ratio:.3f}x" if ratio is not None else ""
            lines.append(
                f"  {name:<22} {' '.join(f'{d:+.4f}' for d in held['deltas'])}; mean {nats(held['mean_delta'])}"
                f"{memory}; verdict: {held['verdict']}"
            )
    updates = report.get("sonar_expert_updates_in_backward")
    if updates is not None:
        lines.append("")
        lines.append(
            f"sonar expert updates: {updates} in the backward, {report['sonar_expert_updates_in_step']} in "
            f"step(), of {report['sonar_expert_updates_expected']} expected "
            f"({report['expert_tensors']} expert tensors x steps x seeds)"
        )
    verdict = report.get("sonar_equals_control_bitwise")
    if verdict is not None:
        lines.append(
            f"sonar and standard-dense-clip bitwise identical (all parameters after training, seed "
            f"{arms['standard-dense-clip']['seeds'][0]}): {verdict}"
        )
    for name, entry in report.get("expert_clipping", {}).items():
        if entry["equals_control_bitwise"] is not None:
            counted = entry["expert_updates"]
            lines.append(
                f"{name} and {entry['control']} bitwise identical (all parameters after training, seed "
                f"{arms[entry['control']]['seeds'][0]}; {name}'s expert updates: {counted['backward']} in the "
                f"backward, {counted['step']} in step(), of {counted['expected']} expected): "
                f"{entry['equals_control_bitwise']}"
            )
    verdict = report.get("remainder_equals_control_bitwise")
    if verdict is not None:
        lines.append(
            "sonar-remainder's fp32 masters (bf16 weight and remainder) and dense weights and remainder-control's "
            f"(torch.optim.AdamW on fp32 expert masters) bitwise identical (seed "
            f"{arms['remainder-control']['seeds'][0]}): {verdict}"
        )
    dist = report.get("distributed")
    if dist is not None:
        lines.append("")
        lines.append(f"{dist['ranks']} ranks, {dist['layout']}")
        for name in dist["expert_checksums"]:
            lines.append(
                f"  {name:<20} checksums per rank: dense {' '.join(dist['dense_checksums'][name])}, "
                f"experts {' '.join(dist['expert_checksums'][name])}"
            )
        what = "dense weights" if dist.get("expert_parallel") else "dense and expert weights"
        lines.append(f"the ranks' {what} are identical in every arm: {dist['ranks_agree']}")
    return "\n".join(lines)


def _source(report: dict) -> str:
    """What was trained: the preset, or "model PATH (model type)" for a --model run."""
    return report.get("source") or report["preset"]


def _seeds(report: dict) -> str:
    """The run's size in words, e.g. "3 seeds x 200 steps"."""
    n, steps = report.get("seeds_run", 1), report["steps"]
    return f"{n} seed{'s' if n > 1 else ''} x {steps} step{'s' if steps > 1 else ''}"


def _title(report: dict) -> str:
    data = report.get("data", "?")
    data = Path(data).name if data != "pydoc_data.topics" else data
    first = (
        f"{_source(report)} ({report['layers']} layer{'s' if report['layers'] > 1 else ''}, {report['parameters'] / 1e6:.1f} M parameters, "
        f"{report['dtype']}, {report['device']}) on {data}; backend {report.get('backend', '?')}; "
        f"{_seeds(report)}"
    )
    verdicts = []
    if "sonar_equals_control_bitwise" in report:
        verdicts.append(
            "sonar = standard-dense-clip bitwise" if report["sonar_equals_control_bitwise"] else
            "sonar DIFFERS from standard-dense-clip"
        )  # fmt: skip
    heldout = report.get("heldout")
    if heldout is not None:
        se = heldout["standard_error"]
        pm = f" ± {se:.4f} (SE)" if se is not None else ""
        verdicts.append(f"held-out sonar - standard {nats(heldout['mean_delta'])}{pm}")
    if report.get("peak_memory_reduction") is not None:
        alike = (
            f" (standard's peak: {peak_shares(report['arms']['standard'])})"
            if report.get("peak_memory_note")
            else ""
        )
        verdicts.append(f"peak memory {-100 * report['peak_memory_reduction'] + 0.0:+.1f} %{alike}")
    if report.get("speedup") is not None:
        verdicts.append(f"step time sonar / standard {1 / report['speedup']:.2f}x")
    lines = [first, "; ".join(verdicts)]
    if heldout is not None:
        lines.append(f"held-out verdict: {heldout['verdict']}")
    spike = report.get("inject_spike")
    clipped = []
    for name, entry in report.get("expert_clipping", {}).items():
        for reference in ("standard", "sonar"):
            held = entry.get(f"versus_{reference}")
            if held is not None:
                se = held["standard_error"]
                pm = f" ± {se:.4f}" if se is not None else ""
                clipped.append(f"{name} - {reference} {nats(held['mean_delta'])}{pm}")
    if clipped or spike is not None:
        injected = (
            f"spike: step {spike['step']}'s loss x{spike['scale']:g}" if spike is not None else "no spike"
        )
        lines.append(f"{injected}; " + "; ".join(clipped))
    return "\n".join(lines)


def plot(report: dict, path: Path) -> list[str]:
    """report.png: the training loss (mean over seeds, with the seeds' range), the held-out loss of
    every seed and arm (the same seed joined across arms), and the peak memory by category; a panel
    without data (one step, --no-memory) is left out. The title carries what ran and the verdicts.
    Returns the panels drawn ("loss", "heldout", "memory")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    names = list(arms)
    panels = []
    if report["steps"] >= 2:
        panels.append("loss")
    panels.append("heldout")
    measured = any(r["peak_memory_bytes"] for r in arms.values())
    if measured:
        panels.append("memory")
    widths = {"loss": 1.4, "heldout": 1.0, "memory": 1.3}
    fig, axes = plt.subplots(
        1, len(panels), figsize=(max(10.0, 5.2 * len(panels) + 1.5), 5.2),
        gridspec_kw={"width_ratios": [widths[p] for p in panels]}, squeeze=False,
    )  # fmt: skip
    axes = dict(zip(panels, axes[0], strict=True))
    palette = {
        "standard": "C0",
        "sonar": "C1",
        "standard-dense-clip": "C2",
        "all-in-backward": "C3",
        "sonar-8bit": "C4",
        "torchao-8bit": "C5",
        "sonar-spike": "C6",
        "spike-control": "C6",
        "sonar-lagged": "C8",
        "lagged-control": "C8",
    }
    colors = {name: palette.get(name, f"C{4 + i}") for i, name in enumerate(names)}
    styles = {
        "standard": "-",
        "sonar": "--",
        "standard-dense-clip": ":",
        "all-in-backward": "-.",
        "sonar-8bit": "--",
        "torchao-8bit": ":",
        "sonar-spike": "--",
        "spike-control": ":",
        "sonar-lagged": "--",
        "lagged-control": ":",
    }
    if "loss" in axes:
        # Every arm's curve on the first seed (the paired comparison: the control lies on sonar's), and
        # the range of an arm's curves over its seeds as a band.
        ax = axes["loss"]
        first = min(s for r in arms.values() for s in r["seeds"])
        banded = False
        spike = report.get("inject_spike")
        # The injected step's loss is SCALE times the others: left out of the curves (a gap) and marked, so
        # that the curves keep their scale.
        at = None if spike is None else spike["step"] - 1

        def shown(run):
            return [math.nan if i == at else x for i, x in enumerate(run)]

        for name, r in arms.items():
            runs = [shown(run) for run in r["train_losses"]]
            steps = range(1, len(runs[0]) + 1)
            if first in r["seeds"]:
                ax.plot(
                    steps,
                    runs[r["seeds"].index(first)],
                    styles.get(name, "-"),
                    color=colors[name],
                    label=name,
                )
            if len(runs) > 1:
                banded = True
                low = [min(values) for values in zip(*runs, strict=True)]
                high = [max(values) for values in zip(*runs, strict=True)]
                ax.fill_between(steps, low, high, color=colors[name], alpha=0.12, linewidth=0)
        if spike is not None:
            ax.axvline(spike["step"], color="0.5", linestyle=":", linewidth=1,
                       label=f"step {spike['step']}: loss x{spike['scale']:g} (not drawn)")  # fmt: skip
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats per byte, incl. load balancing)")
        ax.set_title(f"training loss, seed {first}" + (" (band: range over seeds)" if banded else ""))
        ax.legend(fontsize=8)
    ax = axes["heldout"]
    positions = {name: i for i, name in enumerate(names)}
    seeds = sorted({s for r in arms.values() for s in r["seeds"]})
    for seed in seeds:  # the same seed joined across arms: the comparison is paired
        xs, ys = [], []
        for name, r in arms.items():
            if seed in r["seeds"]:
                xs.append(positions[name])
                ys.append(r["heldout_losses"][r["seeds"].index(seed)])
        ax.plot(xs, ys, "-o", color="0.6", markersize=4, linewidth=0.8, zorder=1)
    for name, r in arms.items():
        values = r["heldout_losses"]
        se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
        ax.errorbar(positions[name] + 0.12, statistics.fmean(values), yerr=se, fmt="D", color=colors[name],
                    capsize=4, zorder=2)  # fmt: skip
    heldout = report.get("heldout")
    if heldout is not None:
        ax.set_xlabel(
            "sonar - standard per seed: " + " ".join(f"{d:+.4f}" for d in heldout["deltas"]), fontsize=8
        )
    low, high = ax.get_ylim()
    middle, half = (low + high) / 2, max(high - low, 0.01) / 2  # a span of at least 0.01 nats
    ax.set_ylim(middle - half, middle + half)
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.set_title("held-out loss: grey, one seed; diamond, mean ± SE")
    if "memory" in axes:
        ax = axes["memory"]
        bottom = [0.0] * len(names)
        largest = max(r["peak_memory_bytes"] for r in arms.values()) / 2**20
        for category in LABELS:
            values = [arms[n]["peak_memory"][category] / 2**20 for n in names]
            if max(values) >= 0.002 * largest:  # a segment that shows (buffers of a few bytes do not)
                ax.bar(names, values, bottom=bottom, label=category.replace("_", " "))
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        for i, total in enumerate(bottom):
            ax.text(i, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("MiB at the step's peak (MemTracker)")
        ax.set_title("peak memory of one step, by category")
        ax.tick_params(axis="x", labelrotation=15, labelsize=8)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.suptitle(_title(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return panels
