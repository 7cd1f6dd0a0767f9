"""TRL's SFTTrainer with SonarAdamW (examples/trl_sft.py) on one process and on two (torchrun, gloo, DDP with
``data_parallel_group``): every expert tensor updated in the backward, and the parameters bit for bit those of
SFTTrainer with torch.optim.AdamW(fused=True) and clipping of the dense parameters. TRL's SFTConfig turns
activation checkpointing on by default, so it runs here too."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ranks
import torch

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]


def _run(processes: int, optimizer: str, out: Path) -> str:
    script = [str(ROOT / "examples" / "trl_sft.py"), "--optimizer", optimizer, "--out", str(out)]
    launch = [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(processes),
        "--master-port",
        str(ranks.free_port()),
    ]
    done = subprocess.run(
        [sys.executable, *(launch if processes > 1 else []), *script],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env=os.environ | {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.timeout(500)
@pytest.mark.parametrize("processes", [1, 2])
def test_sft_trainer_trains_the_experts_in_the_backward_bitwise(tmp_path, processes):
    printed = _run(processes, "sonar", tmp_path)
    assert f"sft sonar: {processes} ranks, 4 of 4 expert tensors updated in the backward" in printed
    assert "UnownedExpertsWarning" not in printed
    _run(processes, "torch", tmp_path)
    sonar = torch.load(tmp_path / f"sft-sonar-{processes}.pt")
    standard = torch.load(tmp_path / f"sft-torch-{processes}.pt")
    assert sonar.keys() == standard.keys() and len(sonar) == 25
    for name, p in sonar.items():
        assert torch.equal(p, standard[name]), name
    sys.path.insert(0, str(ROOT / "examples"))
    from trainer_data_parallel import tiny_olmoe

    initial = dict(tiny_olmoe().named_parameters())
    name = "model.layers.1.mlp.experts.down_proj"
    assert not torch.equal(initial[name].detach(), sonar[name])
