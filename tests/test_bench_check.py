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
        [sys.executable, str(root / "bench" / "gpu_bench.py"), "--small", "--out", str(out)],
        cwd=root, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert all(c["fused_equals_split_bitwise"] for c in result["correctness"])
    rows = result["layers"][0]["rows"]
    assert {r["provider"] for r in rows.values()} == {
        "sonar-fused", "sonar-unfused", "paper-inbwd", "per-expert-inbwd", "standard",
    }  # fmt: skip
    assert all(r["seconds"] > 0 and r["peak_bytes"] > 0 for r in rows.values())
    assert rows["sonar-fused uniform"]["memory_vs_standard"] < 1.0
    assert set(result["layers"][0]["roofline"]) >= {"up", "down", "wgrad dW1", "wgrad dW2", "total_seconds"}
    assert result["bandwidth_gbs"] > 0 and result["commit"]
    assert "| sonar-fused | uniform |" in out.with_suffix(".md").read_text()
