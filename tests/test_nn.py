"""SonarExperts: parameters in the transformers v5 layout, forward equal to moe_mlp."""

import pytest
import torch
from cases import Case
from numerics import assert_close, to_double

import sonar_kernels
from sonar_kernels import reference


def test_parameters_and_forward(device):
    experts = sonar_kernels.SonarExperts(5, 32, 16, backend="triton", device=device)
    assert experts.gate_up_proj.shape == (5, 32, 32)
    assert experts.down_proj.shape == (5, 32, 16)
    assert [n for n, _ in experts.named_parameters()] == ["gate_up_proj", "down_proj"]
    x, index, w, *_ = Case(30, 32, 16, 5, 3, "sentinels").make(torch.float32, device=device)
    out = experts(x, index, w)
    expected = reference.moe_mlp(
        *to_double(x, index, w, experts.gate_up_proj.detach(), experts.down_proj.detach())
    )
    assert_close(out, expected, torch.float32)
    out.sum().backward()
    assert experts.gate_up_proj.grad.shape == experts.gate_up_proj.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtype_and_device_arguments(dtype):
    experts = sonar_kernels.SonarExperts(3, 16, 8, activation="gelu", dtype=dtype, device="cpu")
    assert experts.gate_up_proj.dtype == dtype and experts.down_proj.dtype == dtype
    assert "activation='gelu'" in repr(experts)
