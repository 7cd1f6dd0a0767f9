"""transformers.Trainer launched by torchrun on 2 CPU processes (gloo) with SonarAdamW and a data-parallel
group: the ranks' experts agree bit for bit, and equal Trainer with torch.optim.AdamW(fused=True), what
SonarAdamW's default flags run (examples/trainer_data_parallel.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ranks
import torch

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(optimizer: str, out: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(ranks.free_port()), str(ROOT / "examples" / "trainer_data_parallel.py"),
         "--optimizer", optimizer, "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=150, env=os.environ | {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(330)
def test_trainer_on_two_processes_keeps_the_experts_identical_and_equal_to_torch_adamw(tmp_path):
    printed = _torchrun("sonar", tmp_path)
    assert "sonar: 2 ranks" in printed and "identical: True" in printed
    _torchrun("torch", tmp_path)
    sonar = [torch.load(tmp_path / f"sonar-{r}.pt") for r in range(2)]
    standard = [torch.load(tmp_path / f"torch-{r}.pt") for r in range(2)]
    experts = [name for name in sonar[0] if name.endswith(("gate_up_proj", "down_proj"))]
    assert len(experts) == 4
    for r in range(2):
        for name, p in sonar[r].items():
            assert torch.equal(p, sonar[0][name]), (r, name)
            assert torch.equal(p, standard[r][name]), (r, name)
