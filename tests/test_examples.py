"""examples/quickstart.py (`make quickstart`) runs to its end and prints the bound its forward is held to
(at a smaller shape than its own, to keep the suite short; `make quickstart` runs the script as it is).
examples/trainer_data_parallel.py is run by tests/test_trainer_distributed.py, examples/accelerate_fsdp2.py by
tests/test_accelerate_fsdp2.py, examples/trl_sft.py by tests/test_trl.py."""

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs_within_the_bf16_bound(capsys):
    quickstart = runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="quickstart")
    quickstart["main"](T=48, H=32, I=16, E=4, top_k=2)
    out = capsys.readouterr().out
    assert "within the bf16 bound 1.56e-02 (4 unit roundoffs)" in out, out
    assert "fused == split bitwise: True" in out, out
