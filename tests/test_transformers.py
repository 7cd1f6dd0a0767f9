"""moe_mlp equals transformers' own OlmoeExperts and GraniteMoeExperts (eager) on the same weights."""

import pytest
import torch
from cases import Case
from numerics import assert_close

import sonar_kernels

transformers = pytest.importorskip("transformers", minversion="5.13")


def _experts(kind, E, H, I, dtype):
    if kind == "olmoe":
        from transformers.models.olmoe.configuration_olmoe import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeExperts as Experts

        config = OlmoeConfig(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=2)
    else:
        from transformers.models.granitemoe.configuration_granitemoe import GraniteMoeConfig
        from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeExperts as Experts

        config = GraniteMoeConfig(
            hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2
        )
    config._experts_implementation = "eager"
    experts = Experts(config).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, H**-0.5)
        experts.down_proj.normal_(0, I**-0.5)
    return experts


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["olmoe", "granitemoe"])
def test_forward_equals_transformers_eager(kind, dtype, backend, device):
    device = device if backend == "triton" else "cpu"
    E, H, I = 5, 48, 24
    experts = _experts(kind, E, H, I, dtype).to(device)
    assert experts.config.hidden_act == "silu"
    x, index, w, _, _ = Case(40, H, I, E, 3).make(dtype, device=device)
    index[::4, 1] = E  # transformers' eager path accepts E (not -1) as the sentinel id
    with torch.no_grad():
        expected = experts(x, index, w)
        out = sonar_kernels.moe_mlp(x, index, w, experts.gate_up_proj, experts.down_proj, backend=backend)
    assert out.dtype == expected.dtype == dtype
    assert_close(out, expected, dtype, what=f"moe_mlp vs {type(experts).__name__}")


def test_state_dict_moves_between_sonar_and_transformers(device):
    experts = _experts("olmoe", 5, 48, 24, torch.float32).to(device)
    sonar = sonar_kernels.SonarExperts(5, 48, 24, backend="triton", device=device)
    sonar.load_state_dict(experts.state_dict())
    x, index, w, _, _ = Case(20, 48, 24, 5, 2).make(torch.float32, device=device)
    with torch.no_grad():
        assert_close(sonar(x, index, w), experts(x, index, w), torch.float32)
