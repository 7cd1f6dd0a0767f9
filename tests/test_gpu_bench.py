"""bench/gpu_bench.py's rehearsal (--rehearse: every section at tiny shapes on the CPU, the same code as the
GPU run but for the device seam) runs in the suite, so the first GPU run cannot fail on a path the CPU
reaches; its deadline, SIGTERM and per-unit error handling leave a valid report (bench/README.md)."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_bench.py"
UNITS = {
    "correctness": [
        f"{m} {d}"
        for m in ("olmoe-1b-7b", "granite-3.1-3b-a800m")
        for d in ("bfloat16", "float32", "bfloat16 state kinds")
    ],
    "layers": [f"{m} T{t}" for t in (16, 32) for m in ("olmoe-1b-7b", "granite-3.1-3b-a800m")],
    "gemms": ["olmoe-1b-7b", "granite-3.1-3b-a800m", "copy bandwidth"],
    "full-steps": ["olmoe-1b-7b", "granite-3.1-3b-a800m"],
}


def _module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, *args, **kwargs):
    # From another directory and without PYTHONPATH, as on the GPU machine.
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--rehearse", *args], cwd=tmp_path, capture_output=True, text=True,
        check=False, **kwargs,
    )  # fmt: skip


@pytest.mark.timeout(900)
def test_the_rehearsal_runs_every_section_and_reports_what_the_gpu_run_would(tmp_path):
    out = tmp_path / "results" / "rehearsal.json"
    done = _run(tmp_path, "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["schema"] == 2 and result["mode"] == "rehearsal" and result["finished"]
    meta = result["meta"]
    assert {"date", "device", "versions", "commit", "deadline_s", "tuning", "configs"} <= set(meta)
    assert meta["commit"] and meta["versions"]["torch"] and meta["versions"]["triton"]
    assert meta["tuning"] is False  # tuning off unless --tune
    for section, names in UNITS.items():
        assert result["sections"][section]["status"] == "done", section
        assert list(result["sections"][section]["units"]) == names
        assert all(
            u["status"] == "done" and u["seconds"] > 0 for u in result["sections"][section]["units"].values()
        )
    units = {s: {n: u["result"] for n, u in v["units"].items()} for s, v in result["sections"].items()}
    for name, check in units["correctness"].items():
        assert check["passed"] is True, name
        if name.endswith("state kinds"):
            assert set(check["kinds"]) == {"8bit", "remainder", "stochastic", "spike"}
            assert all(all(v.values()) for v in check["kinds"].values()), check["kinds"]
        else:
            assert check["fused_equals_split_bitwise"] is True
    for layer in units["layers"].values():
        rows = layer["rows"]
        assert list(rows) == [
            "standard-fused", "paper-inbwd", "sonar", "sonar-8bit", "sonar-remainder", "sonar-stochastic",
            "sonar-spike",
        ]  # fmt: skip
        assert layer["dtype"] == "torch.bfloat16"
        for row in rows.values():
            assert 0 < row["p10_s"] <= row["median_s"] <= row["p90_s"] and row["peak_bytes"] > 0
        assert rows["standard-fused"]["time_vs_standard"] == 1.0
    gemms = ["up", "down", "dgrad G", "dgrad dX"]
    for name in ("olmoe-1b-7b", "granite-3.1-3b-a800m"):
        kernels = units["gemms"][name]["kernels"]
        assert {*gemms, "wgrad dW2 adamw", "wgrad dW1 adamw", "combine"} <= set(kernels)
        for label in [*gemms, "wgrad dW2 adamw", "wgrad dW1 adamw"]:
            assert kernels[label]["seconds"] > 0 and kernels[label]["fraction_of_torch_mm"] > 0, label
        assert set(units["gemms"][name]["torch_mm"]) == {*gemms, "wgrad dW2", "wgrad dW1"}
    assert units["gemms"]["copy bandwidth"]["gbs"] > 0
    for full in units["full-steps"].values():
        assert set(full["arms"]) == {"standard", "sonar", "all-in-backward"}
        assert all(a["step_time_s"] > 0 and a["peak_bytes"] > 0 for a in full["arms"].values())
    md = out.with_suffix(".md").read_text()
    for heading in ("## correctness: done", "## layers: done", "## gemms: done", "## full-steps: done"):
        assert heading in md
    assert "| sonar-stochastic |" in md and "| wgrad dW1 adamw (GEMM + AdamW) |" in md
    # README's results table renders such a file; a rehearsal is not a GPU result.
    table = _module("results_table", ROOT / "bench" / "results_table.py")
    assert "No GPU results" in table.table(out.parent)
    rendered = table.table(out.parent, include_cpu=True)
    layer = units["layers"]["olmoe-1b-7b T16"]["rows"]
    assert (
        f"| {1000 * layer['standard-fused']['median_s']:.2f} | {1000 * layer['sonar']['median_s']:.2f} |"
        in rendered
    )
    assert "| full step granite-3.1-3b-a800m, 1 layers;" in rendered
    # A second run of the same date with tuned tiles replaces the pinned one's rows, unit by unit.
    tuned = json.loads(out.read_text())
    tuned["meta"]["tuning"] = True
    tuned["sections"]["layers"]["units"]["olmoe-1b-7b T16"]["result"]["rows"]["sonar"]["median_s"] = 1.5
    (out.parent / "tuned.json").write_text(json.dumps(tuned))
    rendered = table.table(out.parent, include_cpu=True)
    assert rendered.count("| layer olmoe-1b-7b T16;") == 1 and "1500.00" in rendered
    assert rendered.count("| full step granite-3.1-3b-a800m, 1 layers;") == 1
    assert rendered.count("tuned tiles") == len(units["layers"]) + len(units["full-steps"])


def test_a_deadline_too_short_for_any_unit_writes_a_report_that_marks_them_not_run(tmp_path):
    out = tmp_path / "deadline.json"
    done = _run(tmp_path, "--out", str(out), "--deadline", "1")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["finished"]
    for section in result["sections"].values():
        assert section["status"] == "not run"
        assert all(
            u["status"] == "not run" and u["reason"].startswith("deadline") for u in section["units"].values()
        )
    assert "**not run** deadline" in out.with_suffix(".md").read_text()


@pytest.mark.timeout(600)
def test_sigterm_mid_run_leaves_a_valid_report_of_what_finished(tmp_path):
    out = tmp_path / "term.json"
    process = subprocess.Popen(
        # gemms (the kernels under the interpreter, tens of seconds) leaves the run work to be stopped in
        # after the first unit: with the layers and full steps alone a loaded machine's poll came too late.
        [sys.executable, str(SCRIPT), "--rehearse", "--sections", "layers", "gemms", "full-steps", "--out", str(out)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline:
            if out.exists():
                units = json.loads(out.read_text())["sections"]["layers"]["units"].values()
                if any(u["status"] == "done" for u in units):
                    break
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 2
    finally:
        process.kill()
    result = json.loads(out.read_text())
    entries = [u for s in result["sections"].values() for u in s["units"].values()]
    statuses = [u["status"] for u in entries]
    assert result["finished"] and statuses[0] == "done"
    assert "pending" not in statuses and statuses.count("interrupted") <= 1
    assert all(u["reason"].startswith(("Terminated", "deadline")) for u in entries if u["status"] != "done")
    assert "not run" in statuses or "interrupted" in statuses


def test_a_unit_that_raises_is_recorded_with_its_traceback_and_the_run_goes_on(tmp_path, monkeypatch):
    bench = _module("gpu_bench_under_test", SCRIPT)

    def broken():
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(
        bench, "units",
        lambda plan, device, sections: [("layers", "first", broken), ("layers", "second", lambda: {"passed": True})],
    )  # fmt: skip
    monkeypatch.setattr(bench, "_unit_lines", lambda section, name, unit: [f"- {name}: ok"])
    out = tmp_path / "raise.json"
    meta = {"date": "today", "device": {"device": "cpu"}, "versions": {}, "commit": "x"}
    status = bench.run(bench.Plan(True, 1), bench.Rehearsal(), ("layers",), out, None, meta)
    assert status == 1
    units = json.loads(out.read_text())["sections"]["layers"]["units"]
    assert (
        units["first"]["status"] == "failed"
        and "RuntimeError: a kernel failed" in units["first"]["traceback"]
    )
    assert units["second"]["status"] == "done"
    assert "**failed** RuntimeError: a kernel failed" in out.with_suffix(".md").read_text()


@pytest.mark.timeout(900)
def test_the_dry_run_counts_what_the_gpu_run_compiles_and_each_build_fits_the_budget(tmp_path):
    """--dry-run: the GPU run's own code at the real shapes under FakeTensorMode, every Triton launch
    recorded as the JIT's sm_90a compilation; --compile-times builds each one here (ptxas included). The
    counts are what the budget in bench/README.md is made of."""
    out = tmp_path / "dry.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--compile-times", "--arithmetic", "fp32", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "dry-run" and result["target"] == "sm_90a" and result["finished"]
    units = {f"{s}: {n}": u for s, v in result["sections"].items() for n, u in v["units"].items()}
    assert len(units) == 15 and all(u["status"] == "done" for u in units.values())
    variants = result["variants"]
    identities = {json.dumps(v["identity"], sort_keys=True) for v in variants}
    assert result["compilations"] == len(variants) == len(identities)
    # Every kernel the run launches, each variant launched at least once and built for sm_90a without spills.
    assert {v["kernel"] for v in variants} == {
        "routing_histogram_kernel", "routing_scan_kernel", "routing_scatter_kernel", "expert_mlp_fwd_up_kernel",
        "expert_mlp_grouped_mm_kernel", "expert_mlp_combine_kernel", "expert_mlp_bwd_dhpre_kernel",
        "expert_mlp_bwd_dweights_kernel", "expert_mlp_bwd_dw_kernel", "adamw_kernel", "adamw_scalars_kernel",
        "adamw_8bit_kernel",
    }  # fmt: skip
    assert all(v["launches"] >= 1 and v["compile_s"] > 0 and v["registers"] > 0 for v in variants)
    assert result["spilling"] == []
    # The layer of the other model (Granite: 40 experts, not a multiple of 16) and the other token count
    # reuse every build: no kernel is specialised on the expert count.
    new = result["by_unit"]
    for unit in units:
        if "granite" in unit or "T16384" in unit or unit.startswith(("gemms", "full-steps")):
            assert new.get(unit, 0) == 0, (unit, new.get(unit))
    # The deadline's estimates cover each unit's builds at the budget's seconds per build. (How long one
    # build takes here is the machine's load, not a property of the code: the H200 run measured the real
    # thing, bench/results/2026-12-04-h200-gpu-bench.md, the whole run in 106 s of its 420.)
    bench = _module("gpu_bench_budget", SCRIPT)
    for unit, count in new.items():
        assert count * bench.COMPILE_S < bench.ESTIMATES[unit.split(":")[0]], unit
    # The library's kernel path reads nothing back to the host at the real shapes.
    assert result["library_host_reads"] == []
