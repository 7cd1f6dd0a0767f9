"""DeepSpeed through transformers' Trainer with SonarAdamW on 2 CPU processes (torchrun, DeepSpeed's CPU
accelerator): refused before anything changes, with a message that names DeepSpeed and what to use instead
(tests/deepspeed_trainer_ranks.py). ZeRO stage 1 and 2 put flat partitions of all parameters in the
optimizer's groups (refused at the first forward, when SonarAdamW sees them); without ZeRO, DeepSpeed
all-reduces the gradients after the backward, so the experts' in-backward update would use a rank's partial
gradient (refused at the first forward as every such layout). Runs where deepspeed is installed (it is not
in the test extra: docs/frameworks.md). Where it is not, ZeRO's flat partitions are put in the optimizer's
groups by hand, with a stand-in deepspeed module imported, to check that the refusal names DeepSpeed also
after steps and after a checkpoint load."""

import sys
import types

import launched
import pytest
import torch
from test_replacement import HYPER, Tiny, _batch

import sonar_kernels
from sonar_kernels.optim.in_backward import expert_optimizer


@pytest.mark.timeout(330)
@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_through_trainer_is_refused_before_anything_changes(stage):
    pytest.importorskip("deepspeed")
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


@pytest.mark.parametrize("when", ["before_any_step", "after_a_step", "after_a_checkpoint_load"])
def test_zero_flat_partitions_are_refused_naming_deepspeed_whenever_they_come(when, monkeypatch):
    # deepspeed.initialize over an optimizer that already stepped, or that loaded a checkpoint (a resumed
    # run), puts ZeRO's flat partitions in its groups like before any step: the refusal names DeepSpeed,
    # never accelerate's FSDP2 shards, and changes nothing.
    if "deepspeed" not in sys.modules:
        monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    model = Tiny()
    optimizer = sonar_kernels.SonarAdamW(model.parameters(), **HYPER)
    if when == "after_a_step":
        model(_batch(0, torch.float32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    elif when == "after_a_checkpoint_load":
        trained = Tiny()
        trained_optimizer = sonar_kernels.SonarAdamW(trained.parameters(), **HYPER)
        trained(_batch(0, torch.float32)).square().mean().backward()
        trained_optimizer.step()
        optimizer.load_state_dict(trained_optimizer.state_dict())
    experts = list(model.experts.parameters())
    before = [{key: value.clone() for key, value in optimizer.state[p].items()} for p in experts]
    held = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:  # what ZeRO stage 1 and 2 do: one flat partition per group
        group["params"] = [torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in group["params"]]))]
    with pytest.raises(RuntimeError, match=r"replaced by DeepSpeed's ZeRO optimizer") as refusal:
        optimizer.step()
    assert "DeepSpeed is not supported" in str(refusal.value) and "accelerate's prepare" not in str(
        refusal.value
    )
    assert all(expert_optimizer(p) is optimizer for p in experts)
    for p, state in zip(experts, before, strict=True):
        assert all(torch.equal(optimizer.state[p][key], value) for key, value in state.items())
    for group, params in zip(optimizer.param_groups, held, strict=True):
        group["params"] = params  # back: every live SonarAdamW follows its groups at any experts' forward
