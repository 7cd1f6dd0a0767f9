"""sonar-train's report: the summary table and the figure."""

from __future__ import annotations

from pathlib import Path

from sonar_kernels.train.memory import LABELS


def summary_table(report: dict) -> str:
    arms = report["arms"]
    std = arms.get("standard")
    lines = [
        f"{'arm':<20} {'held-out loss':>13} {'vs standard':>11} {'peak MiB':>9} {'vs standard':>11} "
        f"{'peak in':>14} {'step ms':>8} {'speedup':>7} {'clipped':>7}"
    ]
    for name, r in arms.items():
        d_loss = r["heldout_loss"] - std["heldout_loss"] if std else float("nan")
        d_mem = (
            100 * (r["peak_memory_bytes"] / std["peak_memory_bytes"] - 1)
            if std and std["peak_memory_bytes"]
            else float("nan")
        )
        speedup = std["step_time_s"] / r["step_time_s"] if std else float("nan")
        lines.append(
            f"{name:<20} {r['heldout_loss']:>13.4f} {d_loss:>+11.4f} {r['peak_memory_bytes'] / 2**20:>9.2f} "
            f"{d_mem:>+10.1f}% {r['peak_phase']:>14} {1000 * r['step_time_s']:>8.1f} {speedup:>6.2f}x "
            f"{100 * r['clip_fraction']:>6.0f}%"
        )
    lines.append("")
    lines.append("peak memory by category (MiB): " + ", ".join(LABELS))
    for name, r in arms.items():
        parts = " ".join(f"{r['peak_memory'][c] / 2**20:8.2f}" for c in LABELS)
        lines.append(f"  {name:<20} {parts}")
    if "sonar" in arms and "backend" in report:
        ran = {
            "triton": "the Triton kernels, AdamW in the wgrad epilogue",
            "torch": "torch's grouped GEMM, each expert tensor's AdamW right after its gradient (no Triton kernel)",
        }[report["backend"]]
        lines.append("")
        lines.append(f"sonar arm: backend {report['backend']} ({ran})")
    verdict = report.get("sonar_equals_control_bitwise")
    if verdict is not None:
        lines.append("")
        lines.append(
            f"sonar and standard-dense-clip bitwise identical (all parameters after training): {verdict}"
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


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"standard": "-", "sonar": "--", "standard-dense-clip": ":", "all-in-backward": "-."}
    for name, r in arms.items():
        left.plot(
            r["train_losses"], styles.get(name, "-"), label=f"{name} (held-out {r['heldout_loss']:.3f})"
        )
    left.set_xlabel("step")
    left.set_ylabel("training loss (nats per byte, incl. load balancing)")
    left.set_title(f"{report['preset']}: training loss")
    left.legend()
    bottom = [0.0] * len(arms)
    names = list(arms)
    for category in LABELS:
        values = [arms[n]["peak_memory"][category] / 2**20 for n in names]
        if any(values):
            right.bar(names, values, bottom=bottom, label=category)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_ylabel("MiB at the step's peak")
    right.set_title(f"peak memory ({report['device']})")
    right.legend(loc="lower center", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
