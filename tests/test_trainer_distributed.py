"""transformers.Trainer launched by torchrun on 2 CPU processes (gloo) with SonarAdamW and a data-parallel
group: the ranks' experts agree bit for bit, and equal Trainer with torch.optim.AdamW(fused=True), what
SonarAdamW's default flags run (examples/trainer_data_parallel.py)."""

from pathlib import Path

import launched
import pytest
import torch


def _torchrun(optimizer: str, out: Path) -> str:
    script = launched.ROOT / "examples" / "trainer_data_parallel.py"
    return launched.run(script, ["--optimizer", optimizer, "--out", str(out)], processes=2, timeout=150)


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
