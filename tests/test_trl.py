"""TRL's SFTTrainer with SonarAdamW (examples/trl_sft.py) on one process and on two (torchrun, gloo, DDP with
``data_parallel_group``): every expert tensor updated in the backward, and the parameters bit for bit those of
SFTTrainer with torch.optim.AdamW(fused=True) and clipping of the dense parameters. TRL's SFTConfig turns
activation checkpointing on by default, so it runs here too."""

from pathlib import Path

import launched
import pytest

pytest.importorskip("trl")

EXAMPLE = launched.ROOT / "examples" / "trl_sft.py"


def _run(processes: int, optimizer: str, out: Path) -> str:
    return launched.run(EXAMPLE, ["--optimizer", optimizer, "--out", str(out)], processes=processes)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("processes", [1, 2])
def test_sft_trainer_trains_the_experts_in_the_backward_bitwise(tmp_path, processes):
    printed = _run(processes, "sonar", tmp_path)
    assert f"sft sonar: {processes} ranks, 4 of 4 expert tensors updated in the backward" in printed
    assert "UnownedExpertsWarning" not in printed
    _run(processes, "torch", tmp_path)
    launched.assert_bitwise_and_trained(
        tmp_path / f"sft-sonar-{processes}.pt", tmp_path / f"sft-torch-{processes}.pt",
        "model.layers.1.mlp.experts.down_proj",
    )  # fmt: skip
