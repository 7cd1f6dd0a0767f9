"""The report: the predicted table for the real presets (OLMoE-1B-7B, Granite-3.1-3B-A800M) and the command line
(``python bench/memory_model`` and ``--validate``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

from memory_model.inputs import METHODS, Layout, Setup, with_layers
from memory_model.layouts import predict
from memory_model.validation import presets, validate

# --- the real presets ------------------------------------------------------------------------------------

REAL_PRESETS = ("olmoe-1b-7b", "granite-3.1-3b-a800m")
REAL_LAYOUTS = (Layout(dp=8), Layout(ep=8), Layout(dp=4, ep=8), Layout(fsdp=8))
# (parameter, gradient and AdamW moment bytes; activation bytes): sonar-train's --dtype bfloat16 and
# float32, and fp32 master weights with bf16 activations (composed; see Setup.compute_bytes).
PRECISIONS = {"bf16": (2, 2), "fp32 master, bf16 activations": (4, 2), "fp32": (4, 4)}


def real_setup(
    preset: str,
    method: str,
    layout: Layout,
    precision: str,
    checkpointing: bool = True,
    moments: str = "exact",
) -> Setup:
    """The real preset's step as sonar-train runs it on GPUs: the preset's batch (4 x 1024 tokens per
    rank), the Triton backend, torch's fused AdamW (sonar-train's choice on CUDA), DDP's buckets and the
    buffers inside the custom ops counted (allocated bytes, not MemTracker's view)."""
    p = presets()[preset]
    param_bytes, compute_bytes = PRECISIONS[precision]
    return Setup(with_layers(p), p.batch_size, p.sequence_length, method, layout, param_bytes=param_bytes,
                 compute_bytes=compute_bytes, checkpointing=checkpointing, adamw="fused", backend="triton",
                 tracker=False, moments=moments)  # fmt: skip


def real_table() -> str:
    """The predicted per-rank peaks of the real presets as a markdown table (GiB)."""
    lines = []
    for preset in REAL_PRESETS:
        lines += [
            f"**{preset}** (per-rank peak, GiB; activation checkpointing on / off)",
            "",
            "| layout | precision | standard | paper's method | sonar | sonar vs standard |",
            "|---|---|---|---|---|---|",
        ]
        for layout in REAL_LAYOUTS:
            for precision in PRECISIONS:
                cells, totals = [], {}
                for method in METHODS:
                    on, off = (
                        predict(real_setup(preset, method, layout, precision, ck)).total
                        for ck in (True, False)
                    )
                    totals[method] = on
                    cells.append(f"{on / 2**30:.2f} / {off / 2**30:.2f}")
                change = totals["sonar"] / totals["standard"] - 1
                lines.append(f"| {layout.name} | {precision} | {' | '.join(cells)} | {100 * change:+.1f} % |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def real_table_8bit() -> str:
    """The real presets' predicted per-rank peaks with sonar's 8-bit moments beside exact sonar and standard,
    activation checkpointing on, as a markdown table (GiB)."""
    lines = [
        "| preset | layout | precision | standard | sonar | sonar, 8-bit moments | 8-bit vs standard |",
        "|---|---|---|---|---|---|---|",
    ]
    for preset in REAL_PRESETS:
        for layout in REAL_LAYOUTS:
            for precision in PRECISIONS:
                standard, sonar, eight = (
                    predict(real_setup(preset, method, layout, precision, moments=moments)).total
                    for method, moments in (("standard", "exact"), ("sonar", "exact"), ("sonar", "8bit"))
                )
                cells = " | ".join(f"{t / 2**30:.2f}" for t in (standard, sonar, eight))
                lines.append(
                    f"| {preset} | {layout.name} | {precision} | {cells} | {100 * (eight / standard - 1):+.1f} % |"
                )
    return "\n".join(lines) + "\n"


# One GPU's memory (GiB, nominal): an RTX 4090, an L40S / RTX 6000 Ada, an A100 / H100 80 GB, an H200.
GPU_SIZES = (24, 48, 80, 141)
# The share of a GPU's memory a training step may take: the CUDA context, cuBLAS workspaces and the caching
# allocator's fragmentation take the rest (an allowance, not a measurement).
USABLE = 0.9
# One GPU's configurations of bf16 master weights (docs/design.md, "bf16 master weights") against standard
# training: (label, method, precision, moments, master), checkpointing on; master "fp32": sonar-train's
# mixed-precision arm (Setup.fp32_masters: the bf16 model, fp32 masters and moments).
MASTER_CONFIGS = (
    ("standard mixed precision (fp32 master and moments)", "standard", "bf16", "exact", "fp32"),
    ("standard pure bf16", "standard", "bf16", "exact", None),
    ("sonar pure bf16", "sonar", "bf16", "exact", None),
    ("sonar bf16 + remainder, fp32 moments", "sonar", "bf16", "exact", "remainder"),
    ("sonar bf16 + remainder, 8-bit moments", "sonar", "bf16", "8bit", "remainder"),
    ("sonar bf16 + stochastic, fp32 moments", "sonar", "bf16", "exact", "stochastic"),
    ("sonar bf16 + stochastic, 8-bit moments", "sonar", "bf16", "8bit", "stochastic"),
)  # fmt: skip


def real_table_master() -> str:
    """The real presets' predicted peak on one GPU (the preset's batch, activation checkpointing on) with
    bf16 master weights beside standard mixed precision and pure bf16, and which GPU sizes each fits
    (peak <= :data:`USABLE` of the GPU's memory), as a markdown table."""
    sizes = " | ".join(f"{g} GiB" for g in GPU_SIZES)
    lines = [
        f"| preset | configuration | peak GiB | vs mixed precision | {sizes} |",
        "|---|---|---|---|" + "---|" * len(GPU_SIZES),
    ]
    for preset in REAL_PRESETS:
        totals = {}
        for label, method, precision, moments, master in MASTER_CONFIGS:
            setup = real_setup(preset, method, Layout(), precision, moments=moments)
            if master == "fp32":
                setup = dataclasses.replace(setup, fp32_masters=True)
            elif master is not None:
                setup = dataclasses.replace(setup, master=master)
            totals[label] = predict(setup).total
        reference = totals[MASTER_CONFIGS[0][0]]
        for label, total in totals.items():
            fits = " | ".join("fits" if total <= USABLE * g * 2**30 else "no" for g in GPU_SIZES)
            lines.append(f"| {preset} | {label} | {total / 2**30:.1f} | {total / reference:.2f}x | {fits} |")
    return "\n".join(lines) + "\n"


def validation_summary(report: dict) -> str:
    rows = [
        "| layout | ranks | cases | worst error standard | worst error paper | worst error sonar |",
        "|---|---|---|---|---|---|",
    ]
    by_layout: dict = {}
    for c in report["comparisons"]:
        by_layout.setdefault((c["case"]["layout"], c["case"]["ranks"]), []).append(c)
    for (layout, ranks), group in by_layout.items():
        cells = []
        for method in METHODS:
            errors = [c["relative_error"] for c in group if c["case"]["method"] == method]
            cells.append(f"{100 * max(errors, key=abs):+.3f} %" if errors else "")
        rows.append(f"| {layout} | {ranks} | {len(group)} | {' | '.join(cells)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="A memory model of one training step: the per-rank peak, predicted from the model's dimensions.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--validate", action="store_true", help="measure the tiny presets with MemTracker and compare"
    )
    parser.add_argument(
        "--out",
        metavar="PATH",
        help="--validate's JSON (default: bench/results/memory/<date>-cpu-memory-model.json)",
    )
    args = parser.parse_args(argv)
    if not args.validate:
        print("Predicted by bench/memory_model: a model, not a measurement.\n")
        print(real_table())
        print("With 8-bit moments (per-rank peak, GiB, activation checkpointing on):\n")
        print(real_table_8bit())
        print(
            f"bf16 master weights on one GPU (activation checkpointing on; fits: peak <= {USABLE:.0%} of the "
            "GPU's memory):\n"
        )
        print(real_table_master())
        return 0
    report = validate(progress=lambda line: print(line, file=sys.stderr, flush=True))
    out = Path(args.out) if args.out else (
        Path(__file__).parents[1] / "results" / "memory" / f"{report['date'][:10]}-cpu-memory-model.json")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(validation_summary(report))
    print(f"\nwrote {out}")
    worst = max((abs(c["relative_error"]) for c in report["comparisons"]), default=0.0)
    return 0 if worst <= 0.05 else 1
