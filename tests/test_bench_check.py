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


def _results_table():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "bench" / "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_gpu_results_table_is_exactly_what_the_committed_results_files_say():
    module = _results_table()
    assert module.docs_table() == module.table()
    assert module.docs_table(begin=module.ARTICLE_BEGIN, end=module.ARTICLE_END) == module.article_table()
