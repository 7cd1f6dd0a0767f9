"""DeepSpeed through transformers' Trainer with SonarAdamW on 2 CPU processes (torchrun, DeepSpeed's CPU
accelerator): refused before anything changes, with a message that names DeepSpeed and what to use instead
(tests/deepspeed_trainer_ranks.py). ZeRO stage 1 and 2 put flat partitions of all parameters in the
optimizer's groups (refused at the first forward, when SonarAdamW sees them); without ZeRO, DeepSpeed
all-reduces the gradients after the backward, so the experts' in-backward update would use a rank's partial
gradient (refused at the first forward as every such layout). Runs where deepspeed is installed (it is not
in the test extra: docs/frameworks.md)."""

import launched
import pytest

pytest.importorskip("deepspeed")


@pytest.mark.timeout(330)
@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_through_trainer_is_refused_before_anything_changes(stage):
    printed = launched.run(
        launched.ROOT / "tests" / "deepspeed_trainer_ranks.py",
        [str(stage)],
        processes=2,
        timeout=300,
        env={"DS_ACCELERATOR": "cpu"},
    )
    refusals = [line for line in printed.splitlines() if line.startswith("refusal: ")]
    assert len(refusals) == 2, printed[-3000:]
    for line in refusals:
        assert "DeepSpeed is not supported" in line and "FSDP2" in line and "data_parallel_group" in line, (
            line
        )
    assert printed.count("changed: []") == 2, printed[-3000:]
