"""Bad input is refused before any kernel runs, with the argument named in the message."""

import pytest
import torch
from cases import Case

import sonar_kernels
from sonar_kernels import ops


def good():
    x, index, w, w1, w2 = Case(6, 32, 16, 4, 2).make(torch.float32)
    return {"hidden_states": x, "top_k_index": index, "top_k_weights": w, "gate_up_proj": w1, "down_proj": w2}


def replaced(**changes):
    args = good()
    args.update(changes)
    return args


BAD = [
    # (changes, exception, words the message must contain)
    pytest.param(
        {"gate_up_proj": torch.randn(4, 32, 40)}, ValueError, "gate_up_proj.shape[2]", id="H-gate_up_proj"
    ),
    pytest.param({"down_proj": torch.randn(4, 40, 16)}, ValueError, "down_proj.shape[1]", id="H-down_proj"),
    pytest.param({"down_proj": torch.randn(4, 32, 24)}, ValueError, "gate_up_proj.shape[1]", id="I-mismatch"),
    pytest.param({"down_proj": torch.randn(5, 32, 16)}, ValueError, "down_proj.shape[0]", id="E-mismatch"),
    pytest.param({"top_k_weights": torch.rand(6, 3)}, ValueError, "top_k_weights", id="weights-shape"),
    pytest.param(
        {"top_k_index": torch.zeros(7, 2, dtype=torch.long)}, ValueError, "top_k_index", id="index-T"
    ),
    pytest.param({"top_k_index": torch.zeros(6, 2)}, TypeError, "top_k_index", id="float-index"),
    pytest.param(
        {"hidden_states": torch.randn(6, 32, dtype=torch.float64)}, TypeError, "hidden_states", id="fp64"
    ),
    pytest.param(
        {"gate_up_proj": torch.randn(4, 32, 32).half()}, TypeError, "gate_up_proj", id="weight-dtype"
    ),
    pytest.param(
        {"top_k_weights": torch.ones(6, 2, dtype=torch.long)}, TypeError, "top_k_weights", id="int-weights"
    ),
    pytest.param(
        {"hidden_states": torch.randn(6, 32, device="meta")}, ValueError, "top_k_index", id="devices"
    ),
    pytest.param({"hidden_states": torch.randn(2, 6, 32)}, ValueError, "hidden_states", id="x-3d"),
    pytest.param({"gate_up_proj": torch.randn(32, 32)}, ValueError, "gate_up_proj", id="w1-2d"),
    pytest.param({"gate_up_proj": [[1.0]]}, TypeError, "gate_up_proj", id="not-a-tensor"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("changes,exc,words", BAD)
def test_bad_input_is_refused(changes, exc, words, backend):
    # Shape, dtype and device checks come before the backend is resolved, so CPU tensors do here.
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        sonar_kernels.moe_mlp(**replaced(**changes), backend=backend)


def test_bf16_activations_with_fp32_weights_are_accepted():
    args = replaced(hidden_states=torch.randn(6, 32).bfloat16())
    assert sonar_kernels.moe_mlp(**args, backend="torch").dtype == torch.bfloat16


def test_too_many_slots():
    args = replaced(top_k_index=torch.zeros(6, 1, dtype=torch.long).expand(6, 2**31 // 6 + 1))
    args["top_k_weights"] = torch.zeros(1).expand(*args["top_k_index"].shape)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        sonar_kernels.moe_mlp(**args)


def test_unknown_activation_and_backend():
    with pytest.raises(ValueError, match="activation"):
        sonar_kernels.moe_mlp(**good(), activation="relu")
    with pytest.raises(ValueError, match="backend"):
        sonar_kernels.moe_mlp(**good(), backend="cuda")


def test_triton_backend_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setattr(ops.validation, "triton_interpreting", lambda: False)
    with pytest.raises(ValueError, match=r"backend='triton'.*TRITON_INTERPRET"):
        sonar_kernels.moe_mlp(**good(), backend="triton")
    # "auto" falls back to the torch reference on CPU.
    sonar_kernels.moe_mlp(**good(), backend="auto")


def test_no_kernel_runs_on_bad_input(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a launcher ran before validation")

    monkeypatch.setattr(ops, "moe_mlp_fwd", fail)
    monkeypatch.setattr(ops, "routing_metadata", fail)
    with pytest.raises(ValueError):
        sonar_kernels.moe_mlp(**replaced(down_proj=torch.randn(5, 32, 16)), backend="triton")


@pytest.mark.parametrize(
    "kwargs,exc,words",
    [
        ({"num_experts": 0}, ValueError, "num_experts"),
        ({"hidden_size": 2.0}, ValueError, "hidden_size"),
        ({"activation": "tanh"}, ValueError, "activation"),
        ({"backend": "cuda"}, ValueError, "backend"),
        ({"dtype": torch.float64}, TypeError, "dtype"),
    ],
)
def test_sonar_experts_bad_arguments(kwargs, exc, words):
    args = {"num_experts": 4, "hidden_size": 32, "intermediate_size": 16} | kwargs
    n, h, i = args.pop("num_experts"), args.pop("hidden_size"), args.pop("intermediate_size")
    with pytest.raises(exc, match=words):
        sonar_kernels.SonarExperts(n, h, i, **args)
