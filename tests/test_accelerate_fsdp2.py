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


def _torchrun(loop: str, optimizer: str, out: Path, *extra: str) -> str:
    return launched.run(
        EXAMPLE,
        ["--loop", loop, "--optimizer", optimizer, "--out", str(out), *extra],
        processes=2,
        timeout=200,
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


@pytest.mark.timeout(450)
def test_expert_parallelism_beside_fsdp2_through_accelerate_keeps_the_update_in_the_backward(tmp_path):
    """accelerate's FSDP2 plugin with ignored_modules (a regex naming the experts modules) on a model whose
    experts are expert-parallel (shard_experts over the 2 ranks): FSDP2 shards the dense layers only, and
    SonarAdamW updates each rank's experts in the backward from their complete gradient (no gradient in
    .grad, no ShardedExpertsWarning: they are not shards), bit for bit torch.optim.AdamW(fused=True) on the
    same layout (the experts' gradients in .grad, dense-only clipping)."""
    import torch

    printed = _torchrun("accelerate", "sonar", tmp_path, "--ep")
    # 21 dense shards (25 parameters less the 4 expert tensors); each rank's 2 layers x 2 expert tensors.
    assert (
        "accelerate sonar: 21 sharded parameters, 4 expert tensors updated in the backward, 0 expert"
        in printed
    )
    assert "UnownedExpertsWarning" not in printed and "ShardedExpertsWarning" not in printed
    reference = _torchrun("accelerate", "torch", tmp_path, "--ep")
    assert (
        "accelerate torch: 21 sharded parameters, 0 expert tensors updated in the backward, 12 expert"
        in reference
    )
    sonar, standard = (torch.load(tmp_path / f"accelerate-ep-{k}.pt") for k in ("sonar", "torch"))
    assert sonar.keys() == standard.keys() and len(sonar) == 25
    for name, p in sonar.items():
        assert torch.equal(p, standard[name]), name
    # Rank 0 holds experts 0 and 1 of the 4, and trained them.
    import sys

    sys.path.insert(0, str(launched.ROOT / "examples"))
    from trainer_data_parallel import tiny_olmoe

    name = "model.layers.0.mlp.experts.gate_up_proj"
    initial = dict(tiny_olmoe().named_parameters())[name].detach()
    assert sonar[name].shape[0] == 2 and not torch.equal(sonar[name], initial[:2])
