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

from sonar_kernels.ops.triton_backend import configs as sonar_configs

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
    "wgrad": ["olmoe-1b-7b", "granite-3.1-3b-a800m"],
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
        # Each weight's update fused into its wgrad, or its split path (the wgrad's store, then AdamW).
        wgrads = [
            f"wgrad {w} adamw" if f"wgrad {w} adamw" in kernels else f"wgrad {w} store"
            for w in ("dW2", "dW1")
        ]
        split = [f"adamw {w}" for w in ("dW2", "dW1") if f"wgrad {w} store" in kernels]
        assert {*gemms, *wgrads, *split, "combine", "combine dX"} <= set(kernels)
        for label in [*gemms, *wgrads]:
            assert kernels[label]["seconds"] > 0 and kernels[label]["fraction_of_torch_mm"] > 0, label
        assert set(units["gemms"][name]["torch_mm"]) == {*gemms, "wgrad dW2", "wgrad dW1"}
        _check_floors(units["gemms"][name], [*gemms, *wgrads, *split, "combine", "combine dX"])
    assert units["gemms"]["copy bandwidth"]["gbs"] > 0
    for unit in units["wgrad"].values():
        _check_wgrad_choices(unit)
    for full in units["full-steps"].values():
        assert set(full["arms"]) == {"standard", "sonar", "all-in-backward"}
        assert all(a["step_time_s"] > 0 and a["peak_bytes"] > 0 for a in full["arms"].values())
    md = out.with_suffix(".md").read_text()
    for heading in (
        "## correctness: done", "## layers: done", "## gemms: done", "## wgrad: done", "## full-steps: done"
    ):  # fmt: skip
        assert heading in md
    assert "| sonar-stochastic |" in md and "| wgrad dW1 " in md
    assert "| floor ms | ms / floor | torch.bmm ms | ms / torch.bmm |" in md and "| all launches |" in md
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


def _check_wgrad_choices(unit: dict) -> None:
    """The wgrad section's unit: for sonar every wgrad tile candidate timed on both paths, for the state kinds
    with their own fused tiles those on the fused path and the plain wgrad's on the split path; one chosen
    option among them; each option's floor from the bytes computed
    here (bf16 weights; bf16 moments for sonar, 8-bit codes for sonar-8bit, fp32 for sonar-stochastic: W
    and the moments of the chunk's experts read and written, and the split path's gradient written and
    read), at the copy bandwidth measured in the unit."""
    _, H, I, E, _ = unit["T_H_I_E_top_k"]
    candidates = sonar_configs.CANDIDATES["wgrad"][("16bit", 9)]
    state_bytes = {"sonar": 2 + 2, "sonar-8bit": 1 + 1, "sonar-stochastic": 4 + 4}
    assert set(unit["providers"]) == set(state_bytes)
    for provider, tensors in unit["providers"].items():
        assert set(tensors) == {"gate_up_proj", "down_proj"}
        for tensor, t in tensors.items():
            options = [(row["path"], sonar_configs.Config(**row["config"])) for row in t["options"]]
            plain = [c for c in candidates if not c.EPILOGUE_PREFETCH]
            if provider == "sonar":
                expected = [("fused", c) for c in candidates] + [("split", c) for c in plain]
            else:  # the fused update's own tiles; the split path's store at its default and every plain tile
                split = [sonar_configs.WGRAD_8BIT, *plain]
                if provider == "sonar-8bit":  # today's and the closed-form quantizer
                    split += [c._replace(EPILOGUE_PREFETCH=True) for c in split]
                expected = [("fused", c) for c in sonar_configs.OWN_CANDIDATES[9]] + [
                    ("split", c) for c in split
                ]
            assert options == expected, (provider, tensor)
            chosen = (t["chosen"]["path"], sonar_configs.Config(**t["chosen"]["config"]))
            assert chosen in options
            elements = t["chunk_experts"] * (2 * I * H if tensor == "gate_up_proj" else H * I)
            assert t["chunk_experts"] == E  # the tiny layers fit the scratch bound whole
            for (path, _), row in zip(options, t["options"], strict=True):
                per_element = 2 * (2 + state_bytes[provider] + (2 if path == "split" else 0))
                expected = elements * per_element / (unit["copy_gbs"] * 1e9)
                assert row["seconds"] > 0 and row["floor_bytes_s"] == pytest.approx(expected, rel=1e-12)


def _moved(label: str, T: int, H: int, I: int, E: int, top_k: int, size: int = 2) -> int:
    """Bytes a launch must move, every tensor read or written once in a ``size``-byte dtype (the rehearsal's
    bf16 everywhere): gathered X and dO at [T, H], the updated weight and both moments read and written."""
    S = T * top_k
    w = {"dW2": E * H * I, "dW1": E * 2 * I * H}
    operands = {"dW2": T * H + T * top_k + S * I, "dW1": S * 2 * I + T * H}
    elements = {
        "up": T * H + E * 2 * I * H + S * 2 * I + S * I,
        "down": S * I + E * H * I + S * H,
        "combine": S * H + T * top_k + T * H,
        "dgrad G": T * H + E * H * I + S * 2 * I + T * top_k + S * 2 * I + S * I,
        "dgrad dX": S * 2 * I + E * 2 * I * H + S * H,
        "combine dX": S * H + T * H,
    }
    for g in ("dW2", "dW1"):
        elements[f"wgrad {g} adamw"] = operands[g] + 6 * w[g]
        elements[f"wgrad {g} store"] = operands[g] + w[g]
        elements[f"adamw {g}"] = 7 * w[g]
    return size * elements[label]


def _check_floors(unit: dict, labels: list[str]) -> None:
    """Every launch of ``labels`` has its floor, from bytes and FLOPs computed here from the shape; the
    wgrads their torch.bmm over per-expert slabs; the launches that move none of the layer's tensors none."""
    T, H, I, E, top_k = unit["T_H_I_E_top_k"]
    S = T * top_k
    assert set(unit["dtypes"].values()) == {"torch.bfloat16"}
    mnk = {"up": (S, H, 2 * I), "down": (S, I, H), "dgrad G": (S, H, I), "dgrad dX": (S, 2 * I, H),
           "wgrad dW2": (H, S, I), "wgrad dW1": (2 * I, S, H)}  # fmt: skip
    copy = unit["copy_gbs"] * 1e9
    assert copy > 0
    for label in labels:
        row = unit["kernels"][label]
        gemm = next((g for g in mnk if label == g or label.startswith(g + " ")), None)
        M, K, N = mnk.get(gemm, (0, 0, 0))
        assert row["bytes"] == sum(row["bytes_by_tensor"].values()) == _moved(label, T, H, I, E, top_k), label
        assert row["flops"] == 2 * M * K * N, label
        assert row["floor_gemm_s"] == (unit["torch_mm"][gemm]["seconds"] if gemm else 0.0), label
        assert row["floor_bytes_s"] == pytest.approx(row["bytes"] / copy, rel=1e-12), label
        assert row["floor_s"] == max(row["floor_gemm_s"], row["floor_bytes_s"]) > 0, label
        assert row["time_over_floor"] == pytest.approx(row["seconds"] / row["floor_s"], rel=1e-12), label
        if label.startswith("wgrad "):
            bmm = unit["torch_bmm"][gemm]
            assert bmm["slabs"] == [E, M, S // E, N] and bmm["seconds"] > 0
            assert row["torch_bmm_s"] == bmm["seconds"], label
            assert row["time_over_torch_bmm"] == pytest.approx(row["seconds"] / bmm["seconds"], rel=1e-12)
        else:
            assert "torch_bmm_s" not in row, label
    no_floor = [
        "routing histogram",
        "routing scan",
        "routing scatter",
        "routing-weight grad",
        "update begin",
        "update end",
    ]
    assert all("floor_s" not in unit["kernels"][label] for label in no_floor)
    rows = unit["kernels"].values()
    assert unit["floor_s"] == pytest.approx(sum(r["floor_s"] for r in rows if "floor_s" in r), rel=1e-12)
    assert unit["kernels_s"] == pytest.approx(sum(r["seconds"] for r in rows), rel=1e-12)


def test_the_floor_counts_each_tensor_once_in_its_dtype():
    """bench/kernel_times.traffic at OLMoE-1B-7B's layer (4096 tokens): the fused update moves W, exp_avg and
    exp_avg_sq in and out (12 B per element with bf16 moments, 20 with fp32), the split path writes the
    gradient and reads it back beside them (16 B per element with bf16 moments)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        kernel_times = _module("kernel_times_under_test", ROOT / "bench" / "kernel_times.py")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import torch

    T, H, I, E, top_k = shape = (4096, 2048, 1024, 64, 8)
    bf16, fp32 = torch.bfloat16, torch.float32
    moved = {
        m: kernel_times.traffic(shape, activations=bf16, weights=bf16, moments=m, routing_weights=fp32)
        for m in (bf16, fp32)
    }
    w1 = E * 2 * I * H
    operands = 2 * (T * top_k * 2 * I + T * H)  # dHpre [S, 2I], X [T, H] gathered once
    for m, per_element in ((bf16, 12), (fp32, 20)):
        assert sum(moved[m]["wgrad dW1 adamw"].values()) == operands + per_element * w1
    split = sum(moved[bf16]["wgrad dW1 store"].values()) + sum(moved[bf16]["adamw dW1"].values())
    assert split == operands + 16 * w1
    assert round(sum(moved[bf16]["wgrad dW1 adamw"].values()) / 1e6) == 3372  # MB
    for label, expected in (("up", 755), ("down", 470), ("dgrad dX", 805), ("combine", 151)):
        assert round(sum(moved[bf16][label].values()) / 1e6) == expected, label


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
    assert len(units) == 17 and all(u["status"] == "done" for u in units.values())
    variants = result["variants"]
    identities = {json.dumps(v["identity"], sort_keys=True) for v in variants}
    assert result["compilations"] == len(variants) == len(identities)
    # Every kernel the run launches, each variant launched at least once and built for sm_90a without spills
    # (the TMA kernels: the wgrad section's tuned step times the up and grouped_mm families' TMA candidates).
    assert {v["kernel"] for v in variants} == {
        "routing_histogram_kernel", "routing_scan_kernel", "routing_scatter_kernel", "expert_mlp_fwd_up_kernel",
        "expert_mlp_grouped_mm_kernel", "expert_mlp_fwd_up_tma_kernel", "expert_mlp_grouped_mm_tma_kernel",
        "expert_mlp_combine_kernel", "expert_mlp_bwd_dhpre_kernel",
        "expert_mlp_bwd_dweights_kernel", "expert_mlp_bwd_dw_kernel", "adamw_kernel",
        "adamw_8bit_kernel", "update_begin_kernel", "update_end_kernel", "bound_magnitudes_kernel",
        "bound_table_kernel",
    }  # fmt: skip
    assert all(v["launches"] >= 1 and v["compile_s"] > 0 and v["registers"] > 0 for v in variants)
    assert result["spilling"] == []
    # The layer of the other model (Granite: 40 experts, not a multiple of 16) and the other token count
    # reuse every build: no kernel is specialised on the expert count.
    new = result["by_unit"]
    for unit in units:
        if "granite" in unit or "T16384" in unit or unit.startswith(("gemms", "full-steps")):
            # (the wgrad section's OLMoE unit builds every tile candidate's update: the tuner times them)
            assert new.get(unit, 0) == 0, (unit, new.get(unit))
    # The deadline's estimates cover each unit's builds at the budget's seconds per build. (How long one
    # build takes here is the machine's load, not a property of the code: the H200 run measured the real
    # thing, bench/results/2026-12-04-h200-gpu-bench.md, the whole run in 106 s of its 420.)
    bench = _module("gpu_bench_budget", SCRIPT)
    for unit, count in new.items():
        assert count * bench.COMPILE_S < bench.ESTIMATES[unit.split(":")[0]], unit
    # The library's kernel path reads nothing back to the host at the real shapes.
    assert result["library_host_reads"] == []
    # The gemms units compute their floors at the real shapes too (the values are placeholders).
    for name in ("olmoe-1b-7b", "granite-3.1-3b-a800m"):
        gemms = units[f"gemms: {name}"]["result"]
        assert gemms["floor_s"] > 0 and set(gemms["torch_bmm"]) == {"wgrad dW2", "wgrad dW1"}
        experts = 64 if name.startswith("olmoe") else 40
        assert gemms["torch_bmm"]["wgrad dW1"]["slabs"][2] == 4096 * 8 // experts  # rows per expert
