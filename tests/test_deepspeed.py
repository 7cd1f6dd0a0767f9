"""DeepSpeed through transformers' Trainer with SonarAdamW on 2 CPU processes (torchrun, DeepSpeed's CPU
accelerator): refused before anything changes, with a message that names DeepSpeed and what to use instead
(tests/deepspeed_trainer_ranks.py). ZeRO stage 1 and 2 put flat partitions of all parameters in the
optimizer's groups (refused at the first forward, when SonarAdamW sees them); without ZeRO, DeepSpeed
all-reduces the gradients after the backward, so the experts' in-backward update would use a rank's partial
gradient (refused at the first forward as every such layout). Runs where deepspeed is installed (it is not
in the test extra: docs/frameworks.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ranks

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(330)
@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_through_trainer_is_refused_before_anything_changes(stage):
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(ranks.free_port()), str(ROOT / "tests" / "deepspeed_trainer_ranks.py"), str(stage)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    refusals = [line for line in done.stdout.splitlines() if line.startswith("refusal: ")]
    assert len(refusals) == 2, done.stdout[-3000:]
    for line in refusals:
        assert "DeepSpeed is not supported" in line and "FSDP2" in line and "data_parallel_group" in line, (
            line
        )
    assert done.stdout.count("changed: []") == 2, done.stdout[-3000:]
