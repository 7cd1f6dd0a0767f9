"""docs/benchmarks.md's GPU results table ("GPU results"), built only from the files gpu_bench.py wrote under
bench/results/ and that git tracks (committed or staged; a CPU run of gpu_bench.py is not a result).

    python bench/results_table.py            # print the table
    python bench/results_table.py --write    # replace the table between docs/benchmarks.md's markers

tests/test_bench_check.py checks that docs/benchmarks.md holds exactly this table, so the docs cannot show
a number that no committed results file backs (README's "Measured" quotes its ranges).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"
BEGIN, END = "<!-- gpu-results:begin -->", "<!-- gpu-results:end -->"


def _benchmark_files(results: Path) -> list[Path]:
    """gpu_bench.py's JSON files under ``results`` that git tracks (every JSON file there when it is not
    in a git checkout); check_backward.py's ``*-backward-check.json`` are not tables; files of
    gpu_bench.py's first schema (before its sections) are not read."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--", "*.json"], cwd=results, capture_output=True, text=True, check=True
        ).stdout.split()
        paths = [results / name for name in listed]
    except (OSError, subprocess.CalledProcessError):
        paths = list(results.glob("*.json"))
    return sorted(p for p in paths if p.parent == results and not p.name.endswith("-backward-check.json"))


def _depth(commit: str) -> int:
    """How many commits lead to ``commit`` in this checkout's history (-1 when it is not there): of two runs
    on one date, the later commit's is the newer."""
    try:
        out = subprocess.run(
            ["git", "rev-list", "--count", commit.split("+")[0]],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return int(out.strip())
    except (OSError, ValueError, subprocess.CalledProcessError):
        return -1


def table(results: Path = RESULTS, include_cpu: bool = False) -> str:
    """The markdown table; ``include_cpu`` renders CPU rehearsals too (tests). Each layer and full step
    appears once per device, from the newest file that measured it (by date, then by commit); on one date a
    run with tuned tiles (``--tune``, what a user's CUDA run does by default) is preferred over the pinned
    defaults."""
    rows = {}
    runs = []
    for path in _benchmark_files(results) if results.is_dir() else []:
        r = json.loads(path.read_text())
        if r.get("schema") != 2 or (r["mode"] != "gpu" and not include_cpu):
            continue
        meta = r["meta"]
        runs.append((meta["date"], bool(meta.get("tuning")), _depth(meta["commit"]), path.name, path, r))
    for _, tuned, _, _, path, r in sorted(runs, key=lambda run: run[:4]):
        meta = r["meta"]
        versions = meta["versions"]
        device = meta["device"]["device"]
        where = (
            f"{device}, {meta['date']}, torch {versions['torch']}, triton {versions['triton']}, "
            f"{meta['commit'][:9]}{', tuned tiles' if tuned else ''}"
        )
        link = f"[{path.name}](../bench/results/{path.name})"
        sections = r["sections"]
        slowest = {
            name: unit["result"]["min_gemm_fraction_of_torch_mm"]
            for name, unit in sections.get("gemms", {}).get("units", {}).items()
            if unit["status"] == "done" and "min_gemm_fraction_of_torch_mm" in unit["result"]
        }
        for name, unit in sections.get("layers", {}).get("units", {}).items():
            if unit["status"] != "done":
                continue
            layer = unit["result"]
            step = layer["rows"]
            gemm = slowest.get(layer["shape"])
            rows[(device, "layer", name)] = (
                f"| {where} | layer {name}; standard: {step['standard-fused']['experts']}, AdamW, clipping | "
                f"{1000 * step['standard-fused']['median_s']:.2f} | {1000 * step['sonar']['median_s']:.2f} | "
                f"{step['sonar']['time_vs_standard']:.2f} | {step['sonar']['memory_vs_standard']:.2f} | "
                f"{step['sonar-8bit']['time_vs_standard']:.2f} / {step['sonar-8bit']['memory_vs_standard']:.2f} | "
                f"{'' if gemm is None else f'{gemm:.2f}'} | {link} |"
            )
        for name, unit in sections.get("full-steps", {}).get("units", {}).items():
            if unit["status"] != "done":
                continue
            entry = unit["result"]
            arms = entry["arms"]
            rows[(device, "full step", name)] = (
                f"| {where} | full step {name}, {entry['layers']} layers; standard: the sonar experts, AdamW, "
                f"global clipping | {1000 * arms['standard']['step_time_s']:.1f} | "
                f"{1000 * arms['sonar']['step_time_s']:.1f} | {arms['sonar']['time_vs_standard']:.2f} | "
                f"{arms['sonar']['memory_vs_standard']:.2f} | | | {link} |"
            )
    if not rows:
        return "No GPU results are committed yet (bench/results/ holds none), so this table is empty."
    head = [
        "| device, date, versions, commit | what | standard ms | sonar ms | time sonar / standard | peak memory "
        "sonar / standard | sonar-8bit time / peak vs standard | slowest GEMM / torch.mm | file |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + list(rows.values()))


def docs_table(docs: Path = DOCS) -> str:
    text = docs.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/benchmarks.md")
    args = parser.parse_args(argv)
    new = table()
    if args.write:
        text = DOCS.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        DOCS.write_text(text[:start] + "\n" + new + "\n" + text[end:])
    print(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
