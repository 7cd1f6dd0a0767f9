"""FSDP2 in the order accelerate and transformers' Trainer impose (the optimizer on the unsharded model, then
``prepare`` shards the model and swaps the optimizer's ``param_groups`` to the shards), on 2 gloo ranks
launched by torchrun (examples/accelerate_fsdp2.py). accelerate runs DDP instead of FSDP on a CPU; the
example sets the accelerator's state to FSDP with the plugin (``distributed_type`` and ``fsdp_plugin``),
what it holds on a GPU, so FSDP2 shards the model over gloo. The accelerate version is pinned in the test
extra (pyproject.toml): the forcing and the swap are its internals.

SonarAdamW takes the shards over and updates the expert tensors in the backward (no expert gradient is
left for the step, no UnownedExpertsWarning), bit for bit torch.optim.AdamW(fused=True) with clipping of
the dense parameters (accelerate's own clip_grad_norm_ over them)."""

from pathlib import Path

import launched
import pytest

EXAMPLE = launched.ROOT / "examples" / "accelerate_fsdp2.py"


def _torchrun(loop: str, optimizer: str, out: Path) -> str:
    return launched.run(
        EXAMPLE, ["--loop", loop, "--optimizer", optimizer, "--out", str(out)], processes=2, timeout=200
    )


@pytest.mark.timeout(450)
@pytest.mark.parametrize("loop", ["accelerate", "trainer"])
def test_fsdp2_through_accelerate_prepare_trains_the_experts_in_the_backward_bitwise(tmp_path, loop):
    printed = _torchrun(loop, "sonar", tmp_path)
    assert (
        f"{loop} sonar: 25 sharded parameters, 4 expert tensors updated in the backward, 0 expert" in printed
    )
    assert "UnownedExpertsWarning" not in printed
    reference = _torchrun(loop, "torch", tmp_path)
    assert (
        f"{loop} torch: 25 sharded parameters, 0 expert tensors updated in the backward, 12 expert"
        in reference
    )
    launched.assert_bitwise_and_trained(
        tmp_path / f"{loop}-sonar.pt",
        tmp_path / f"{loop}-torch.pt",
        "model.layers.0.mlp.experts.gate_up_proj",
    )
