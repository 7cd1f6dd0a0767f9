"""docs/benchmarks.md's GPU results table ("GPU results"), built only from the files gpu_bench.py wrote under
bench/results/ and that git tracks (committed or staged; a CPU run of gpu_bench.py is not a result).

    python bench/results_table.py            # print the table
    python bench/results_table.py --write    # replace the tables between docs/benchmarks.md's markers

It also builds the article's whole-model table beside ours (:func:`article_table`, docs/benchmarks.md's
"The article's table"), from the model section's files and the committed traced peaks.

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
ARTICLE_BEGIN, ARTICLE_END = "<!-- article:begin -->", "<!-- article:end -->"


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
        for model, units in _model_units(sections).items():
            std, sonar = units.get("standard"), units.get("sonar")
            if std is None or sonar is None or std.get("out_of_memory") or sonar.get("out_of_memory"):
                continue
            eight = units.get("sonar-8bit")
            eight = (
                "" if eight is None or eight.get("out_of_memory")
                else f"{eight['time_vs_standard']:.2f} / {eight['memory_vs_standard']:.2f}"
            )  # fmt: skip
            rows[(device, "model", model)] = (
                f"| {where} | model {sonar['preset']}, {sonar['layers']} layers, {sonar['batch']} x "
                f"{sonar['sequence_length']} tokens, checkpointing; standard: AdamW, global clipping; sonar "
                f"= control bitwise: {sonar.get('bitwise_equal_to_control')} | {1000 * std['step_time_s']:.1f} | "
                f"{1000 * sonar['step_time_s']:.1f} | {sonar['time_vs_standard']:.2f} | "
                f"{sonar['memory_vs_standard']:.2f} | {eight} | | {link} |"
            )
    if not rows:
        return "No GPU results are committed yet (bench/results/ holds none), so this table is empty."
    head = [
        "| device, date, versions, commit | what | standard ms | sonar ms | time sonar / standard | peak memory "
        "sonar / standard | sonar-8bit time / peak vs standard | slowest GEMM / torch.mm | file |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + list(rows.values()))


def _model_units(sections: dict) -> dict[str, dict[str, dict]]:
    """The model section's finished rows with checkpointing on: {model: {arm: row}}."""
    out: dict[str, dict[str, dict]] = {}
    for unit in sections.get("model", {}).get("units", {}).values():
        if unit["status"] == "done" and unit["result"]["checkpointing"]:
            r = unit["result"]
            out.setdefault(r["model"], {})[r["arm"]] = r
    return out


def _pct(ratio: float) -> str:
    return f"{100 * (ratio - 1):+.1f} %"


def article_table(results: Path = RESULTS, include_cpu: bool = False) -> str:
    """The article's whole-model figures beside ours (docs/benchmarks.md, "The article's table"): the newest
    model section of gpu_bench.py per device and model (checkpointing on), else "not measured on a GPU
    yet", and the traced peaks that the section compares with (bench/model_steps.py's PREDICTIONS)."""
    sys.path[:0] = [str(ROOT / "bench")]
    try:
        import model_steps
    finally:
        sys.path.remove(str(ROOT / "bench"))
    predictions = model_steps.load_predictions()
    traced = json.loads(model_steps.PREDICTIONS.read_text())
    measured: dict[str, tuple[str, dict]] = {}  # model -> (where, {arm: row}), the newest run
    runs = []
    for path in _benchmark_files(results) if results.is_dir() else []:
        r = json.loads(path.read_text())
        if r.get("schema") == 2 and (r["mode"] == "gpu" or include_cpu) and "model" in r["sections"]:
            runs.append((r["meta"]["date"], _depth(r["meta"]["commit"]), path.name, r))
    for _, _, name, r in sorted(runs, key=lambda run: run[:3]):
        meta = r["meta"]
        where = f"{meta['device']['device']}, {meta['date']}, {meta['commit'][:9]}, [{name}](../bench/results/{name})"
        for model, arms in _model_units(r["sections"]).items():
            measured[model] = (where, arms)
    cells = {"memory": [], "time": [], "bitwise": [], "per-expert": [], "traced": [], "traced per-expert": []}
    for model in model_steps.MODELS:
        layers = next(k[1] for k in predictions if k[0] == model)
        peak = {
            arm: predictions.get((model, layers, model_steps.TRACED[arm], True)) for arm in model_steps.ARMS
        }
        cells["traced"].append(f"{model}: {_pct(peak['sonar'] / peak['standard'])}")
        cells["traced per-expert"].append(
            f"{model}: memory x{peak['per-expert-inbwd'] / peak['paper-inbwd']:.2f} of paper-inbwd's "
            f"({peak['per-expert-inbwd'] / 2**30:.1f} GiB)"
        )
        key = model if model in measured else None
        if key is None:
            for cell in ("memory", "time", "bitwise", "per-expert"):
                cells[cell].append(f"{model}: not measured on a GPU yet")
            continue
        where, arms = measured[key]
        sonar, std = arms.get("sonar", {}), arms.get("standard", {})
        ok = lambda r: r and not r.get("out_of_memory")  # noqa: E731
        cells["memory"].append(
            f"{key}: {_pct(sonar['memory_vs_standard'])} ({where})"
            if ok(sonar) and ok(std)
            else f"{key}: not run"
        )
        cells["time"].append(
            f"{key}: {sonar['time_vs_standard']:.2f}x standard's time ({where})"
            if ok(sonar) and ok(std)
            else f"{key}: not run"
        )
        cells["bitwise"].append(f"{key}: {sonar.get('bitwise_equal_to_control')} ({where})")
        per, paper = arms.get("per-expert-inbwd"), arms.get("paper-inbwd")
        cells["per-expert"].append(
            f"{key}: {_pct(per['step_time_s'] / paper['step_time_s'])} time, memory x"
            f"{per['peak_bytes'] / paper['peak_bytes']:.2f} ({where})"
            if ok(per) and ok(paper)
            else f"{key}: not run"
        )
    source = f"`make memory-real`, {traced['commit'][:9]}, {traced['date']}"
    lines = [
        "| claim | the article | ours, measured on one GPU | ours, traced on the CPU |",
        "|---|---|---|---|",
        f"| peak memory, sonar vs standard (global-norm clipping), full depth, bf16 | -19 % to -22 % | "
        f"{'; '.join(cells['memory'])} | {'; '.join(cells['traced'])} ({source}) |",
        f"| step time, sonar vs standard | 17 % to 23 % faster | {'; '.join(cells['time'])} | - |",
        f"| updates vs standard, experts not clipped | bitwise identical | {'; '.join(cells['bitwise'])} | - |",
        f"| per-expert in-backward updates vs batched | 20 % to 72 % slower, no memory saved | "
        f"{'; '.join(cells['per-expert'])} | {'; '.join(cells['traced per-expert'])} |",
    ]
    return "\n".join(lines)


def docs_table(docs: Path = DOCS, begin: str = BEGIN, end: str = END) -> str:
    text = docs.read_text()
    return text[text.index(begin) + len(begin) : text.index(end)].strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/benchmarks.md")
    args = parser.parse_args(argv)
    tables = {(BEGIN, END): table(), (ARTICLE_BEGIN, ARTICLE_END): article_table()}
    if args.write:
        text = DOCS.read_text()
        for (begin, end), new in tables.items():
            start, stop = text.index(begin) + len(begin), text.index(end)
            text = text[:start] + "\n" + new + "\n" + text[stop:]
        DOCS.write_text(text)
    print("\n\n".join(tables.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
