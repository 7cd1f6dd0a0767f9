"""transformers' own expert parallelism (its DTensor-sharded experts, sentinel ids for other ranks' experts)
with experts_implementation "sonar" and SonarAdamW, on CPU processes (tests/hf_expert_parallel_ranks.py):
bitwise equal to the same run with torch.optim.AdamW(fused=True), what SonarAdamW's default flags run;
within the expert-parallel tolerance of single-process training on the ranks' batches together; resumed
from a DCP checkpoint bit for bit; and the ShardedExpertsWarning names why the update is not fused
(docs/distributed.md, "From the stacks users run").

What DistributedConfig(ep_size=2, fsdp_size=F) builds (transformers 5.25, read in its distributed/ and
checked on these ranks): the experts sharded Shard(0) over "ep" and then fully_shard over "efsdp" = F / 2
by transformers itself, so their gradient reaches FSDP2 and .grad. With F = 2 (efsdp 1) a rank's gradient
of its experts is complete before FSDP2 (the all-to-all brings it every routed token of the group); with
F = 4 (efsdp 2) it covers its expert-parallel group's tokens only and FSDP2's reduce-scatter completes it.
With dp_replicate_size 2 as well (HSDP) the experts are replicated over "dp_replicate": refused, by name.
"""

import os
import subprocess
import sys
from pathlib import Path

import launched
import pytest
import ranks
import torch
import transformers
from hf_expert_parallel_ranks import batch
from numerics import rel_err

import sonar_kernels
from sonar_kernels.integrations import transformers as sonar_transformers

ROOT = Path(__file__).resolve().parents[1]
# docs/distributed.md: expert parallelism matches single-process training within 1e-4 (normwise).
EP_TOLERANCE = 1e-4
LR, STEPS = 1e-2, 3


def _config():
    return transformers.OlmoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip


def _launch(tmp_path, processes: int, kinds: str, fsdp_size: int | None = None) -> dict:
    """The tiny OLMoE saved, trained on ``processes`` ranks with DistributedConfig(ep_size=2,
    fsdp_size=fsdp_size or processes); returns its initial parameters."""
    torch.manual_seed(0)
    sonar_transformers.register()
    initial = transformers.OlmoeForCausalLM(_config())
    initial.save_pretrained(tmp_path / "checkpoint")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-port",
         str(ranks.free_port()), str(ROOT / "tests" / "hf_expert_parallel_ranks.py"), str(tmp_path / "checkpoint"),
         str(tmp_path), str(fsdp_size or processes), kinds],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env=os.environ | {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {name: p.detach().clone() for name, p in initial.named_parameters()}


def _single_process(checkpoint: Path, processes: int) -> dict:
    """Single-process training of the same model (transformers' default experts, torch.optim.AdamW) on every
    rank's batch at once: each rank's loss is a mean over its tokens, equally many on every rank, so the
    mean over the concatenated batch is the mean of the ranks' losses that FSDP2 averages."""
    model = transformers.OlmoeForCausalLM.from_pretrained(checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        ids = torch.cat([batch(step, r) for r in range(processes)])
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def _assert_resumed_bitwise(saved: dict, resumed: dict) -> None:
    """The run resumed from its DCP checkpoint after step 0 ends on the weights of the run without a break."""
    assert saved.keys() == resumed.keys()
    for name, p in saved.items():
        assert torch.equal(p, resumed[name]), name


def _assert_matches_single_process(saved: dict, expected: dict, initial: dict) -> None:
    assert saved.keys() == expected.keys()
    for name, p in saved.items():
        error = rel_err(p, expected[name])
        assert error <= EP_TOLERANCE, (name, error)
    # The experts trained (a comparison of untouched weights would prove nothing).
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert rel_err(saved[name], initial[name]) > 100 * EP_TOLERANCE, name


@pytest.mark.timeout(300)
def test_transformers_expert_parallel_with_sonar_equals_torch_adamw_and_single_process(tmp_path):
    initial = _launch(tmp_path, 2, "sonar,torch,resume")
    expected = _single_process(tmp_path / "checkpoint", 2)
    for r in range(2):
        sonar, standard = torch.load(tmp_path / f"sonar-{r}.pt"), torch.load(tmp_path / f"torch-{r}.pt")
        assert sonar.pop("sharded_warnings") == 1 and standard.pop("sharded_warnings") == 0
        (message,) = sonar.pop("sharded_messages")
        assert standard.pop("sharded_messages") == []
        # transformers' expert-parallel forward still dispatches to "sonar": no ExpertsForwardReplacedWarning
        # (the torch run is told that torch.optim.AdamW trains the experts: UnownedExpertsWarning).
        assert sonar.pop("other_warnings") == [] and "UnownedExpertsWarning" in standard.pop("other_warnings")
        assert sonar.keys() == standard.keys()
        for name, p in sonar.items():
            assert torch.equal(p, standard[name]), (r, name)
        _assert_matches_single_process(sonar, expected, initial)
        _assert_resumed_bitwise(sonar, torch.load(tmp_path / f"resume-{r}.pt"))
        # efsdp 1: the warning says the gradient was complete, why it still reached .grad, and the way out.
        for part in (
            "efsdp 1 x ep 2", "DistributedConfig(ep_size=..., fsdp_size=...)", "apply_fully_sharded_data_parallelism",
            "takes no ignored_params", "each rank's gradient of its experts is complete before FSDP2",
            "the update is exact, not fused", "shard_experts", "ignored_modules",
        ):  # fmt: skip
            assert part in message, (part, message)
        assert "partial sum" not in message


@pytest.mark.timeout(300)
def test_transformers_expert_parallel_with_expert_fsdp_matches_single_process_and_says_partial(tmp_path):
    # ep_size 2, fsdp_size 4: efsdp 2, two copies of every expert group, each FSDP-sharded over its pair.
    initial = _launch(tmp_path, 4, "sonar,resume")
    expected = _single_process(tmp_path / "checkpoint", 4)
    for r in range(4):
        sonar = torch.load(tmp_path / f"sonar-{r}.pt")
        assert sonar.pop("sharded_warnings") == 1
        (message,) = sonar.pop("sharded_messages")
        assert sonar.pop("other_warnings") == []
        _assert_matches_single_process(sonar, expected, initial)
        _assert_resumed_bitwise(sonar, torch.load(tmp_path / f"resume-{r}.pt"))
        for part in ("efsdp 2 x ep 2", "'efsdp' of 2 ranks", "partial sum", "reduce-scatter over 'efsdp'"):
            assert part in message, (part, message)
        assert "complete before FSDP2" not in message


@pytest.mark.timeout(300)
def test_transformers_expert_parallel_with_hsdp_is_refused_naming_the_replicate_dimension(tmp_path):
    # dp_replicate_size 2, fsdp_size 2, ep_size 2 on 4 ranks: the experts are Replicate() over
    # "dp_replicate"; whether FSDP2 all-reduced their gradient is not known to the update: refused at the
    # first step, nothing changed, the dimension named.
    _launch(tmp_path, 4, "hsdp", fsdp_size=2)
    launched.assert_refused_unchanged(
        tmp_path,
        "hsdp",
        4,
        "RuntimeError",
        (
            "replicated over the mesh dimension(s) 'dp_replicate' (2)",
            "HSDP",
            "dp_replicate_size=1",
        ),
    )


def _full(p: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor of ``p`` (gathered if it is a DTensor)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ignored", [False, True], ids=["experts-under-fsdp2", "experts-ignored"])
def test_shard_experts_under_fsdp2_is_refused_unless_the_experts_are_left_out(one_rank_mesh, ignored):
    # shard_experts' tensors under fully_shard would have FSDP2 reduce-scatter the gradients of different
    # experts (each rank holds its own): refused at the experts' forward, before anything is updated.
    from torch.distributed.fsdp import fully_shard

    config = _config()
    config._experts_implementation = "sonar"
    torch.manual_seed(0)
    model = transformers.OlmoeForCausalLM(config)
    sonar_transformers.shard_experts(model, one_rank_mesh)
    experts = [layer.mlp.experts for layer in model.model.layers]
    fully_shard(
        model,
        mesh=one_rank_mesh,
        ignored_params={p for m in experts for p in m.parameters()} if ignored else None,
    )
    optimizer = sonar_kernels.SonarAdamW(model, lr=LR)
    before = {name: _full(p) for name, p in experts[0].named_parameters()}
    ids = batch(0, 0)
    if ignored:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        assert all(p.grad is None for m in experts for p in m.parameters())
        assert not torch.equal(_full(experts[0].gate_up_proj), before["gate_up_proj"])
        return
    with pytest.raises(ValueError, match="FSDP2 manages its expert tensors") as raised:
        model(input_ids=ids, labels=ids).loss.backward()
    assert "ignored_params" in str(raised.value) and "Nothing was updated" in str(raised.value)
    for name, p in experts[0].named_parameters():
        assert torch.equal(_full(p), before[name]), name
