"""examples/layer_check.py (`make layer-check`) runs to its end and prints the bound its forward is held to
(at a smaller shape than its own, to keep the suite short; `make layer-check` runs the script as it is).
examples/quickstart.py is README's quick start (tests/test_readme.py runs it and keeps the two the same).
The examples that illustrate docs/usage.md and docs/distributed.md run as they are and check their own
claims against an independent reference (torch.optim.AdamW on a copy, an uninterrupted run, single-process
training); each test asserts on the line the script prints. examples/trainer_data_parallel.py is run by
tests/test_trainer_distributed.py, examples/accelerate_fsdp2.py by tests/test_accelerate_fsdp2.py,
examples/trl_sft.py by tests/test_trl.py."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_example(name: str, capsys) -> str:
    """Run examples/<name>.py's main() in this process; what it printed."""
    example = runpy.run_path(str(ROOT / "examples" / f"{name}.py"), run_name=name)
    example["main"]()
    return capsys.readouterr().out


def test_the_layer_check_runs_within_the_bf16_bound(capsys):
    layer_check = runpy.run_path(str(ROOT / "examples" / "layer_check.py"), run_name="layer_check")
    layer_check["main"](T=48, H=32, I=16, E=4, top_k=2)
    out = capsys.readouterr().out
    assert "within the bf16 bound 1.56e-02 (4 unit roundoffs)" in out, out
    assert "fused == split bitwise: True" in out, out


def test_gradient_accumulation_equals_standard_accumulation_bitwise(capsys):
    out = _run_example("gradient_accumulation", capsys)
    assert "accumulation_steps=4, 3 steps: bitwise equal to torch.optim.AdamW" in out, out
    assert "accumulating the same micro-batches: True" in out, out
    assert "larger batch: " in out and "within 1e-4" in out, out


def test_checkpoint_resume_is_bitwise_the_uninterrupted_run(capsys):
    out = _run_example("checkpoint_resume", capsys)
    assert "bitwise equal to the uninterrupted run: True" in out, out
    assert "torch.optim.AdamW with dense-only clipping, bitwise equal too: True" in out, out


def test_moments_8bit_take_2_25_bytes_and_round_trip(capsys):
    out = _run_example("moments_8bit", capsys)
    assert "expert moments take 2.25 bytes per parameter against 8.00 in fp32" in out, out
    assert "restores codes and scales and resumes bitwise: True" in out, out


def test_master_weights_remainder_follows_fp32_adamw_bitwise(capsys):
    out = _run_example("master_weights_bf16", capsys)
    assert 'master_weights="remainder" equals torch.optim.AdamW on fp32 masters bitwise at every step' in out
    assert "one seed repeats bitwise: True, another differs: True" in out, out


@pytest.mark.timeout(120)
def test_ddp_ranks_agree_and_match_single_process_training():
    # Its own process: the script spawns its ranks (start method "spawn") and they import it as a module.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ddp_data_parallel.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "2 gloo ranks, 3 steps: ranks bitwise identical: True" in out, out
    assert "bitwise equal to DDP + torch.optim.AdamW with dense-only clipping: True" in out, out
    assert "within 1e-5" in out, out
