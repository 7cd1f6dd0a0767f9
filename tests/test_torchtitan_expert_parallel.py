"""torchtitan's own expert parallelism and FSDP (torchtitan 0.3.0) with SonarGroupedExperts and SonarAdamW,
on gloo CPU ranks without torchtitan's trainer (tests/titan_expert_parallel_ranks.py): its EP
(``Module.parallelize``: experts Shard(0) over "ep", AllToAllTokenDispatcher on the "ep" mesh) and its
``apply_fsdp_to_decoder`` (dense over "fsdp", experts over "efsdp"), ParallelDims(dp_shard=W, ep=2).
Trained 3 steps through torchtitan's optimizer container with its dense clipping: bitwise equal to the
same run with torchtitan's stock container of torch.optim.AdamW(fused=True); within the expert-parallel
tolerance of single-process training on the ranks' batches together; resumed from a DCP checkpoint bit for
bit; the ShardedExpertsWarning names the (efsdp, ep) layout and whether the gradient was complete before
FSDP2 (docs/distributed.md, "From the stacks users run")."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

import launched
import ranks
import torch
from numerics import rel_err
from titan_expert_parallel_ranks import (
    LR,
    MAX_NORM,
    STEPS,
    Decoder,
    batch,
    dense_parameters,
    loss_of,
)

ROOT = Path(__file__).resolve().parents[1]
# docs/distributed.md: expert parallelism matches single-process training within 1e-4 (normwise).
EP_TOLERANCE = 1e-4
EXPERT = "layers.0.moe.routed_experts.inner_experts.w1_EFD"
CPU_AUTOCAST = "ignore:In CPU autocast, but the target dtype is not supported"


def _launch(tmp_path: Path, processes: int, kinds: str = "sonar,torch,resume") -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-port",
         str(ranks.free_port()), str(ROOT / "tests" / "titan_expert_parallel_ranks.py"), str(tmp_path),
         kinds],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _single_process(processes: int) -> tuple[dict, dict, list[float]]:
    """The same Decoder in one process (no parallelism; SonarGroupedExperts without an optimizer writes
    .grad) trained with torch.optim.AdamW at torchtitan's default hyperparameters on every rank's batch at
    once, the dense parameters clipped as the ranks clip them: (initial, final parameters, dense norms)."""
    from torchtitan.distributed.utils import clip_grad_norm_

    model = Decoder()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    norms = []
    for step in range(STEPS):
        ids = torch.cat([batch(step, r) for r in range(processes)])
        loss_of(model, ids, ids.numel()).backward()
        norms.append(float(clip_grad_norm_(dense_parameters(model), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return initial, {name: p.detach() for name, p in model.named_parameters()}, norms


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings(CPU_AUTOCAST)
@pytest.mark.filterwarnings("ignore::sonar_kernels.optim.UnownedExpertsWarning")
@pytest.mark.parametrize(
    ("processes", "efsdp"),
    [
        # efsdp 1: each rank's experts see every token of the group routed to them (complete gradient).
        pytest.param(2, 1, id="dp_shard2-ep2-efsdp1"),
        # efsdp 2: two expert-parallel groups hold the same experts; FSDP2 completes the gradient.
        pytest.param(4, 2, id="dp_shard4-ep2-efsdp2"),
    ],
)
def test_torchtitan_ep_fsdp_equals_torch_adamw_matches_single_process_and_resumes(tmp_path, processes, efsdp):
    _launch(tmp_path, processes)
    initial, expected, expected_norms = _single_process(processes)
    for r in range(processes):
        sonar, standard = torch.load(tmp_path / f"sonar-{r}.pt"), torch.load(tmp_path / f"torch-{r}.pt")
        # torchtitan placed the experts on (efsdp, ep), FSDP2's strided shard over efsdp (of 1 rank too),
        # the dense parameters on fsdp.
        placements = sonar.pop("placements")
        assert placements[EXPERT] == (("efsdp", "ep"), ("_S(0, 2)", "S(0)")), placements
        assert placements["lm_head.weight"] == (("fsdp",), ("S(0)",))
        assert standard.pop("placements") == placements
        # The clipping was active (norms above MAX_NORM) and saw the single-process dense gradients.
        norms = sonar.pop("grad_norms")
        assert standard.pop("grad_norms") == norms and min(norms) > MAX_NORM
        for norm, single in zip(norms, expected_norms, strict=True):
            assert abs(norm - single) <= EP_TOLERANCE * single
        (message,) = sonar.pop("sharded_messages")
        assert standard.pop("sharded_messages") == [] and sonar.pop("other_warnings") == []
        assert "UnownedExpertsWarning" in standard.pop("other_warnings")
        assert sonar.keys() == standard.keys() == expected.keys() and len(sonar) == 12
        resumed = torch.load(tmp_path / f"resume-{r}.pt")
        for name, p in sonar.items():
            assert torch.equal(p, standard[name]), (r, name)
            assert torch.equal(p, resumed[name]), (r, name)
            error = rel_err(p, expected[name])
            assert error <= EP_TOLERANCE, (r, name, error)
        assert rel_err(sonar[EXPERT], initial[EXPERT]) > 100 * EP_TOLERANCE
        for part in (
            f"efsdp {efsdp} x ep 2",
            "torchtitan's apply_fsdp_to_decoder gives the expert parameters",
        ):
            assert part in message, (part, message)
        if efsdp == 1:
            assert "complete before FSDP2" in message and "partial sum" not in message
        else:
            assert "partial sum" in message and "reduce-scatter over 'efsdp'" in message


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings(CPU_AUTOCAST)
def test_torchtitan_hsdp_beside_ep_is_refused_naming_the_replicate_dimension(tmp_path):
    # data_parallel_replicate_degree 2, dp_shard 2, ep 2 on 4 ranks: torchtitan puts the experts on
    # ("dp_replicate", "efsdp", "ep"), Replicate() over dp_replicate; whether FSDP2 all-reduced their
    # gradient is not known to the update: refused at the first step, nothing changed, the dimension named.
    _launch(tmp_path, 4, "hsdp")
    launched.assert_refused_unchanged(
        tmp_path,
        "hsdp",
        4,
        "RuntimeError",
        (
            "replicated over the mesh dimension(s) 'dp_replicate' (2)",
            "HSDP",
            "torchtitan's data_parallel_replicate_degree=1",
            "nothing was changed",
        ),
    )
