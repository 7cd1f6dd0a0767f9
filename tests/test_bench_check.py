"""The GPU check script's small mode runs in the suite, so it cannot rot before a GPU runs it."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_backward_check_small_mode(tmp_path):
    spec = importlib.util.spec_from_file_location("check_backward", ROOT / "bench" / "check_backward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "check.json"
    assert module.main(["--small", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"date", "device", "torch", "triton", "commit", "checks"} <= set(result)
    assert [row["weight_dtype"] for row in result["checks"]] == ["torch.bfloat16", "torch.float32"]
    for row in result["checks"]:
        assert row["fused_equals_split_bitwise"] is True
        assert set(row["vs_torch_adamw_fused"]) == {
            f"{name}.{key}"
            for name in ("gate_up_proj", "down_proj")
            for key in ("W", "exp_avg", "exp_avg_sq")
        }


def test_gpu_benchmark_small_mode_runs_and_writes_its_tables(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "bench.json"
    done = subprocess.run(
        # --no-check: test_backward_check_small_mode runs the same checks (check_backward.check).
        [sys.executable, str(root / "bench" / "gpu_bench.py"), "--small", "--no-check", "--out", str(out)],
        cwd=root, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["correctness"] == []
    rows = result["layers"][0]["rows"]
    assert {r["provider"] for r in rows.values()} == {
        "sonar", "sonar-unfused", "paper-inbwd", "per-expert-inbwd", "standard-fused", "standard",
    }  # fmt: skip
    assert all(r["seconds"] > 0 and r["peak_bytes"] > 0 for r in rows.values())
    assert {r["phase"] for r in rows.values()} == {"forward", "forward+backward", "step"}
    assert rows["step sonar uniform"]["memory_vs_standard"] < 1.0
    table = result["layers"][0]
    assert set(table["roofline"]) >= {"up", "down", "wgrad dW1", "wgrad dW2", "total_seconds"}
    # Every launch of the step, labelled from its arguments (bench/kernel_times.py).
    gemms = ["up", "down", "dgrad G", "dgrad dX"]
    common = [
        "routing histogram",
        "routing scan",
        "routing scatter",
        "combine",
        "routing-weight grad",
        "combine dX",
        *gemms,
    ]
    fused, unfused = table["kernels"]["sonar"], table["kernels"]["sonar-unfused"]
    assert set(fused) == {*common, "wgrad dW2 check", "wgrad dW2 adamw", "wgrad dW1 check", "wgrad dW1 adamw",
                          "adamw scalars"}  # fmt: skip
    assert set(unfused) == {*common, "wgrad dW2 store", "wgrad dW1 store"}
    for label in [*gemms, "wgrad dW2 adamw", "wgrad dW1 adamw"]:
        assert fused[label]["seconds"] > 0 and fused[label]["fraction_of_torch_mm"] > 0, label
    assert "fraction_of_torch_mm" not in fused["wgrad dW1 check"] and "tflops" not in fused["combine"]
    assert set(table["goals"]) >= {"step_speedup_sonar_fused_vs_standard", "min_gemm_fraction_of_torch_mm",
                                   "per_expert_over_batched_step_time"}  # fmt: skip
    full = result["full_steps"]["tiny-olmoe"]["arms"]
    assert set(full) == {"standard", "sonar", "all-in-backward"} and all(
        a["step_time_s"] > 0 for a in full.values()
    )
    assert result["bandwidth_gbs"] > 0 and result["commit"]
    md = out.with_suffix(".md").read_text()
    assert (
        "- correctness: not checked in this run (--no-check)" in md
        and "| step | sonar | uniform |" in md
        and "| wgrad dW1 adamw (GEMM + AdamW) |" in md
        and "| all-in-backward |" in md
    )
    # The GEMM goal reads GEMM launches only: the plain wgrads, not the fused AdamW epilogues.
    fractions = table["goals"]["gemm_fractions"]
    assert "sonar-unfused: wgrad dW1 store" in fractions and not any(k.endswith("adamw") for k in fractions)
    assert table["goals"]["min_gemm_fraction_of_torch_mm"] == min(fractions.values())
    # README's results table renders such a file: one row per layer shape and per full-step preset.
    module = _results_table()
    assert "No GPU results" in module.table(tmp_path)  # a CPU run is not a GPU result
    rendered = module.table(tmp_path, include_cpu=True)
    assert "| layer cpu-tiny; standard: transformers OlmoeExperts" in rendered
    assert "| full step tiny-olmoe, 1 layers;" in rendered
    assert f"{1000 * rows['step standard-fused uniform']['seconds']:.2f}" in rendered


def _results_table():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "bench" / "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_results_table_is_exactly_what_the_committed_results_files_say():
    module = _results_table()
    assert module.readme_table() == module.table()
