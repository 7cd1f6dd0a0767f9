"""bench/gpu_bench.py's model section (bench/model_steps.py): whole models at full depth on one GPU, each row
beside its traced prediction. Here: the committed predictions still are what the memory model computes,
the rehearsal at a reduced size (every arm, the bitwise check), an arm that runs out of memory, and the
dry run at full size (what the GPU run compiles, no host read on the kernel path, a prediction per row)."""

import gc
import importlib.util
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_bench.py"


def _module(name, path):
    sys.path[:0] = [str(ROOT / "bench")]
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.fixture(scope="module")
def model_steps():
    return _module("model_steps", ROOT / "bench" / "model_steps.py")


def _rows(model_steps):
    for model in model_steps.MODELS:
        for checkpointing in (True, False):
            for arm in model_steps.ARMS if checkpointing else model_steps.NO_CHECKPOINTING_ARMS:
                yield model, arm, checkpointing


def test_the_committed_predictions_cover_every_row_and_are_what_the_memory_model_predicts_now(model_steps):
    """The GPU run reads its predictions from a committed trace: every row has one, and bench/memory_model
    (which the trace matched when it ran, and which follows the code) still predicts it, so a change that
    moves a peak fails here until the trace is run again (bench/README.md says how)."""
    memory_real = _module("memory_real", ROOT / "bench" / "memory_real.py")
    from sonar_kernels import train

    predictions = model_steps.load_predictions()
    for model, arm, checkpointing in _rows(model_steps):
        layers = train.PRESETS[model].num_layers
        traced = predictions[(model, layers, model_steps.TRACED[arm], checkpointing)]
        modelled = memory_real.model_peak(model, model_steps.TRACED[arm], layers, checkpointing)
        assert abs(modelled / traced - 1) < 1e-3, (model, arm, checkpointing, modelled, traced)
    # The article's claim at OLMoE-1B-7B, traced: sonar's peak at most 0.80x standard's.
    olmoe = (
        predictions[("olmoe-1b-7b", 16, "sonar", True)]
        / predictions[("olmoe-1b-7b", 16, "standard bf16", True)]
    )
    assert olmoe <= 0.80


def _gpu_bench(tmp_path, *args, env=None):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True, check=False,
        env=env,
    )  # fmt: skip


@pytest.mark.timeout(900)
def test_the_rehearsal_runs_every_arm_and_sonar_equals_its_control_bit_for_bit(tmp_path, model_steps):
    out = tmp_path / "model.json"
    done = _gpu_bench(tmp_path, "--rehearse", "--sections", "model", "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    units = result["sections"]["model"]["units"]
    expected = [f"{m} {a}" + ("" if c else " no checkpointing") for m, a, c in _rows(model_steps)]
    assert list(units) == expected and all(u["status"] == "done" for u in units.values())
    for name, unit in units.items():
        r = unit["result"]
        assert r["layers"] == 1 and (r["batch"], r["sequence_length"]) == (2, 32) and r["dtype"] == "bfloat16"
        assert 0 < r["p10_s"] <= r["step_time_s"] <= r["p90_s"] and len(r["step_times_s"]) == 2
        assert r["tokens_per_s"] == pytest.approx(64 / r["step_time_s"])
        assert r["peak_bytes"] > 0 and r["predicted_peak_bytes"] is None  # the tiny presets are not traced
        model = next(m for m in model_steps.MODELS if name.startswith(m))
        standard = units[f"{model} standard" + (" no checkpointing" if "no checkpointing" in name else "")][
            "result"
        ]
        assert r["time_vs_standard"] == pytest.approx(r["step_time_s"] / standard["step_time_s"])
        assert r["memory_vs_standard"] == pytest.approx(r["peak_bytes"] / standard["peak_bytes"])
    for model in model_steps.MODELS:
        sonar = units[f"{model} sonar"]["result"]
        # every parameter with its two moments (the tiny presets' parameters: 3 tensors each)
        assert sonar["bitwise_equal_to_control"] is True and sonar["passed"] is True
        assert sonar["bitwise_differing"] == [] and sonar["bitwise_tensors"] % 3 == 0
        # the same training, step by step: the control's losses, bit for bit (4 steps: 1 + 2 timed + 1)
        control = units[f"{model} standard-dense-clip"]["result"]
        assert len(sonar["losses"]) == 4 and sonar["losses"] == control["losses"]
        rows = {a: units[f"{model} {a}"]["result"]["peak_bytes"] for a in model_steps.ARMS}
        # the expert gradient is never a tensor in sonar; the paper's arms hold one tensor's at a time
        # (per expert slice: the same peak but for the step counts, E scalars against one)
        assert rows["sonar"] < rows["paper-inbwd"] < rows["standard"]
        assert rows["per-expert-inbwd"] == pytest.approx(rows["paper-inbwd"], abs=64 * 8)
        assert rows["standard"] == rows["standard-dense-clip"]
    md = out.with_suffix(".md").read_text()
    assert "## model: done" in md and "| measured / traced |" in md
    assert md.count("| sonar | on |") == 2 and "| True |" in md


def test_an_arm_that_runs_out_of_memory_is_a_row_and_the_next_arm_runs(monkeypatch, model_steps):
    gpu_bench = _module("gpu_bench_oom", SCRIPT)
    from sonar_kernels import train

    plan = gpu_bench.Plan(rehearse=True, full_step_layers=1)
    section = model_steps.Section(plan, gpu_bench.Rehearsal())
    real_step = train.train_step

    def step(arm, *args, **kwargs):
        if arm.name == "sonar-8bit":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore")
        return real_step(arm, *args, **kwargs)

    built = []
    real_build = train.build_arm

    def build(*args, **kwargs):
        arm = real_build(*args, **kwargs)
        built.append([weakref.ref(arm.model), *(weakref.ref(o) for o in arm.optimizers)])
        return arm

    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(train, "build_arm", build)
    standard = section.arm("olmoe-1b-7b", "standard", True)
    failed = section.arm("olmoe-1b-7b", "sonar-8bit", True)
    # Nothing of an arm outlives its unit, the one that ran out of memory included: the next arm's peak is
    # its own (on CUDA the allocator's peak counts everything still allocated).
    gc.collect()
    assert len(built) == 2 and all(ref() is None for refs in built for ref in refs)
    assert (
        failed["out_of_memory"] is True
        and failed["message"] == "CUDA out of memory. Tried to allocate 2.00 GiB."
    )
    assert failed["time_vs_standard"] is None and "step_time_s" not in failed
    after = section.arm("olmoe-1b-7b", "sonar", True)
    assert after["peak_bytes"] > 0 and after["time_vs_standard"] == pytest.approx(
        after["step_time_s"] / standard["step_time_s"]
    )
    # A peak 5 % above its trace is marked; one within 3 % is not.
    section.predictions[("tiny-olmoe", 1, "sonar", True)] = int(after["peak_bytes"] / 1.05)
    marked = section.arm("olmoe-1b-7b", "sonar", True)
    assert marked["within_prediction"] is False and marked["measured_over_predicted"] == pytest.approx(
        1.05, rel=1e-6
    )
    assert " !" in model_steps.row_line("sonar", "on", marked)
    section.predictions[("tiny-olmoe", 1, "sonar", True)] = int(after["peak_bytes"] / 1.02)
    assert section.arm("olmoe-1b-7b", "sonar", True)["within_prediction"] is True
    line = model_steps.row_line("sonar-8bit", "on", failed)
    assert line.startswith("| sonar-8bit | on | out of memory at - GiB: CUDA out of memory.")


@pytest.mark.timeout(1500)
def test_the_dry_run_at_full_size_counts_the_builds_and_finds_a_prediction_per_row(tmp_path, model_steps):
    out = tmp_path / "dry.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    done = _gpu_bench(tmp_path, "--dry-run", "--sections", "model", "--out", str(out), env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    units = result["sections"]["model"]["units"]
    assert len(units) == 18 and all(u["status"] == "done" for u in units.values())
    predictions = model_steps.load_predictions()
    for name, unit in units.items():
        r = unit["result"]
        assert r["layers"] in (16, 32) and (r["batch"], r["sequence_length"]) == (4, 1024)
        key = (r["preset"], r["layers"], model_steps.TRACED[r["arm"]], r["checkpointing"])
        assert r["predicted_peak_bytes"] == predictions[key] > 2**30, name
        assert r["losses"] is None and r["steps"] == 3  # 1 warm-up, 1 timed, 1 under the peak
    # The builds: OLMoE-1B-7B's units compile (standard's kernels, then sonar's update and the state kinds'),
    # Granite's reuse them all, each unit's within the deadline's estimate of it; nothing on the library's
    # kernel path reads the host.
    bench = _module("gpu_bench_dry", SCRIPT)
    assert result["compilations"] > 0 and not any("granite" in unit for unit in result["by_unit"])
    for unit, count in result["by_unit"].items():
        assert count * bench.COMPILE_S < bench.unit_estimate(*unit.split(": ")), unit
    assert result["library_host_reads"] == []
