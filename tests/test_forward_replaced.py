"""An experts module whose model selects "sonar" but whose forward was rebound on the instance (Liger-Kernel's
``swiglu=True`` binds its own ``LigerExperts.forward``) no longer runs "sonar": SonarAdamW says so once,
naming the replacement and how to keep "sonar", when it takes the module's tensors or, if the forward was
rebound later, before the first update of them."""

import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import sonar_kernels
from sonar_kernels import reference
from sonar_kernels.optim.ownership import ExpertsForwardReplacedWarning

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from trainer_data_parallel import tiny_olmoe


def plain_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """What a replacement does: the same math in plain torch ops, gradients into .grad."""
    return reference.moe_mlp(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


def _experts_modules(model):
    return [layer.mlp.experts for layer in model.model.layers]


def _rebind(model):
    for module in _experts_modules(model):
        module.forward = types.MethodType(plain_experts_forward, module)  # as Liger's _bind_method_to_module


def test_a_rebound_forward_is_named_once_when_the_optimizer_takes_the_experts():
    sonar_kernels.integrations.transformers.register()
    model = tiny_olmoe()
    _rebind(model)
    with pytest.warns(ExpertsForwardReplacedWarning) as caught:
        sonar_kernels.SonarAdamW(model)
    messages = [str(w.message) for w in caught if w.category is ExpertsForwardReplacedWarning]
    assert len(messages) == 1
    assert messages[0].startswith("2 experts module(s) (OlmoeExperts)")
    assert "test_forward_replaced.plain_experts_forward" in messages[0] and "swiglu=False" in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExpertsForwardReplacedWarning)
        sonar_kernels.SonarAdamW(model.parameters())  # said once


def test_a_forward_rebound_after_the_optimizer_was_built_is_named_before_the_first_update():
    sonar_kernels.integrations.transformers.register()
    model = tiny_olmoe()
    optimizer = sonar_kernels.SonarAdamW(model)
    experts = optimizer.expert_tensors
    assert len(experts) == 4
    before = [p.detach().clone() for p in experts]
    _rebind(model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExpertsForwardReplacedWarning)  # raised in the hook: before the update
        with pytest.raises(ExpertsForwardReplacedWarning, match="plain_experts_forward"):
            model(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.equal(p, b) for p, b in zip(experts, before, strict=True))
    assert all(float(optimizer.state[p]["step"]) == 0 for p in experts)


LIGER = """
import warnings
import transformers
import sonar_kernels
from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
from sonar_kernels.optim.ownership import ExpertsForwardReplacedWarning

config = transformers.MixtralConfig(
    vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
)
config._experts_implementation = "sonar"
model = transformers.MixtralForCausalLM(config)
_apply_liger_kernel_to_instance(model=model)  # what Trainer's use_liger_kernel=True runs
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sonar_kernels.SonarAdamW(model)
for w in caught:
    if w.category is ExpertsForwardReplacedWarning:
        print("WARNED:", w.message)
"""


def test_liger_kernel_swiglu_is_named():
    # In a process of its own: Liger also replaces transformers' module attributes (MixtralExperts, its
    # norms and rotary embedding) for every model built after it in the process.
    pytest.importorskip("liger_kernel")
    done = subprocess.run([sys.executable, "-c", LIGER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [line for line in done.stdout.splitlines() if line.startswith("WARNED:")]
    assert len(warned) == 1, done.stdout
    assert "2 experts module(s) (MixtralExperts)" in warned[0]
    assert "liger_kernel.transformers.swiglu.LigerExperts.forward (Liger-Kernel's swiglu=True" in warned[0]
