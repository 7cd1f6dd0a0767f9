"""PEFT LoRA on a tiny OLMoE whose experts run "sonar", trained by SonarAdamW: the experts frozen (PEFT's
default), trainable beside the adapters, or adapted themselves (LoRA on the expert tensors,
``target_parameters``); each bit for bit torch.optim.AdamW(fused=True) over the trainable parameters with the
dense parameters clipped (the paper's dense-only clipping)."""

import sys
from pathlib import Path

import pytest
import torch

import sonar_kernels

peft = pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from trainer_data_parallel import tiny_olmoe  # noqa: E402

EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def _train(optimizer_kind: str, mode: str):
    model = tiny_olmoe()
    targets = ["mlp.experts.gate_up_proj"] if mode == "lora-on-experts" else None
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=targets
    )
    model = peft.get_peft_model(model, config)
    if mode == "experts-trainable":
        for name, p in model.named_parameters():
            if name.endswith(EXPERTS):
                p.requires_grad_(True)
    if optimizer_kind == "sonar":
        optimizer = sonar_kernels.SonarAdamW(model, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
    else:
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1, fused=True)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        if optimizer_kind == "sonar":
            assert all(p.grad is None for name, p in model.named_parameters() if name.endswith(EXPERTS))
        else:
            dense = [
                p for name, p in model.named_parameters() if p.requires_grad and not name.endswith(EXPERTS)
            ]
            torch.nn.utils.clip_grad_norm_(dense, 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.filterwarnings("ignore::sonar_kernels.optim.ownership.UnownedExpertsWarning")  # the reference's
@pytest.mark.parametrize("mode", ["experts-frozen", "experts-trainable", "lora-on-experts"])
def test_lora_with_sonar_adamw_equals_torch_adamw_with_dense_clipping_bitwise(mode):
    sonar, standard = _train("sonar", mode), _train("torch", mode)
    assert sonar.keys() == standard.keys()
    for name, p in sonar.items():
        assert torch.equal(p, standard[name]), name
    initial = {name: p.detach() for name, p in tiny_olmoe().named_parameters()}
    expert = next(name for name in sonar if "layers.0.mlp.experts" in name and name.endswith("down_proj"))
    moved = not torch.equal(sonar[expert], initial["model.layers.0.mlp.experts.down_proj"])
    assert moved == (mode == "experts-trainable")
    assert any("lora_A" in name and not torch.equal(p, torch.zeros_like(p)) for name, p in sonar.items())
