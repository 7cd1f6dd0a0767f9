"""The host path of a layer step (docs/benchmarks.md, "The host path of a layer step"): what one training step
of one expert layer asks of the host, counted by bench/host_work.py (Triton launches, torch ops) and
reported by ``bench/gpu_bench.py --dry-run`` per provider of the layers section. A ceiling per provider
holds today's counts, so that a change that adds host work to the step fails here."""

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench")]

import host_work  # noqa: E402
import providers  # noqa: E402

# (Triton launches, torch ops, the library's Python calls) of one step per provider of gpu_bench's layers
# section, counted by its dry run at the real shapes with the GPU's "fp32" AdamW arithmetic (the same at every
# shape and token count). Before issue 58 the sonar providers took 16 launches and 132 torch ops (sonar), 137
# (remainder), 136 (spike); 14 launches and 161 (8-bit), 166 (stochastic); the update's skip, step, scalars
# and telemetry then took two launches (sonar_kernels/ops/triton_backend/update_steps.py), 18 launches and 120 torch ops
# (sonar; 4 more since the telemetry of every expert tensor is reset at the step's first update). The
# overflow bound of each update (some 25 torch ops) now takes two launches per layer step, a magnitudes pass
# and the table of every update's flag (sonar_kernels/ops/triton_backend/update_bound.py): 20 launches and 68 torch ops
# (sonar); and the hyperparameters are checked when they change, not at every update (728 -> 706 Python
# calls); an update's state as one type and the backward's own hooks (issue 62): 706 -> 666; the backends
# as a table of modules (issue 62): one call more per updated tensor's check and run, 666 -> 670.
CEILINGS = {
    "standard-fused": (0, 75, 0),
    "paper-inbwd": (12, 44, 288),
    "sonar": (20, 68, 670),
    "sonar-8bit": (20, 95, 747),
    "sonar-remainder": (20, 73, 689),
    "sonar-stochastic": (20, 100, 686),
    "sonar-spike": (20, 72, 670),
}
# docs/design.md's launches of a layer step whose two weights are updated in the backward: the forward
# (routing metadata in three, up, down, combine), the backward's core (dHpre, the magnitudes that bound the
# updates' gradients and their table of flags, the routing-weight gradient, dX rows and their combine), then
# per weight the check pass and the fused update between the update's begin (skip, step, scalars) and end
# (telemetry).
SONAR_LAUNCHES = {
    "routing_histogram_kernel": 1, "routing_scan_kernel": 1, "routing_scatter_kernel": 1,
    "expert_mlp_fwd_up_kernel": 1, "expert_mlp_grouped_mm_kernel": 2, "expert_mlp_combine_kernel": 2,
    "expert_mlp_bwd_dhpre_kernel": 1, "bound_magnitudes_kernel": 1, "bound_table_kernel": 1,
    "expert_mlp_bwd_dweights_kernel": 1, "expert_mlp_bwd_dw_kernel": 4, "update_begin_kernel": 2,
    "update_end_kernel": 2,
}  # fmt: skip
# Ops that read a value back to the host or size their output by the values: each would wait for the device
# and break a CUDA graph's capture (tests/test_cuda_graph.py shows the capture on a GPU).
CAPTURE_BREAKERS = {
    "_local_scalar_dense", "item", "equal", "is_nonzero", "nonzero", "masked_select", "unique", "_unique2",
    "unique_consecutive", "unique_dim", "bincount", "repeat_interleave", "_pin_memory",
}  # fmt: skip


@pytest.mark.timeout(600)
def test_the_dry_run_reports_each_layer_providers_host_path_within_its_ceiling(tmp_path):
    out = tmp_path / "dry.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # recorded for sm_90a
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--dry-run", "--sections", "layers",
         "--arithmetic", "fp32", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    units = json.loads(out.read_text())["sections"]["layers"]["units"]
    assert len(units) == 4
    for name, unit in units.items():
        rows = unit["result"]["rows"]
        assert set(rows) == set(CEILINGS), name
        for provider, row in rows.items():
            host = row["host"]
            launches, ops, calls = CEILINGS[provider]
            assert host["launches"] <= launches and host["torch_ops"] <= ops, (name, provider, host)
            assert host["python_calls"] <= calls, (name, provider, host["python_calls_by_module"])
            assert host["launches"] == sum(host["launches_by_kernel"].values())
            assert host["torch_ops"] == sum(host["torch_ops_by_name"].values())
            assert set(host["issue"]) >= {"issue_s", "device_s", "issue_over_device", "covered"}
            if provider != "standard-fused":  # the library's step (transformers' experts are not ours)
                assert not CAPTURE_BREAKERS & set(host["torch_ops_by_name"]), (name, provider)
        assert rows["sonar"]["host"]["launches_by_kernel"] == SONAR_LAUNCHES
        assert rows["standard-fused"]["host"]["launches"] == 0  # transformers' experts and torch's AdamW
    assert "| sonar | 20 |" in out.with_suffix(".md").read_text()


@pytest.mark.timeout(600)
def test_counting_a_step_on_the_interpreter_leaves_its_bits_and_finds_its_launches():
    """Real tensors on the Triton backend (the interpreter): the counted step is the step (the same bits as
    an uncounted one: the counting mode does not send the MLP through another path), with the design's
    launches and no more torch ops than the ceiling."""
    shape = providers.Shape(8, 32, 16, 3, 2)  # T below a tile, E prime
    inputs = providers.make_inputs(shape, torch.float32, "cpu")
    counted, plain = (providers.build("sonar", inputs, backend="triton") for _ in range(2))
    for step in (counted, plain):
        step.run()  # the optimizer state, the tuning keys
    host = host_work.count(counted.run)
    plain.run()
    for a, b in zip(counted.weights(), plain.weights(), strict=True):
        assert torch.equal(a, b)
    assert collections.Counter(host["launches_by_kernel"]) == SONAR_LAUNCHES
    assert host["torch_ops"] <= CEILINGS["sonar"][1], host["torch_ops_by_name"]
    assert host["python_calls"] > 0 and "ops.triton_backend.update_steps" in host["python_calls_by_module"]


def test_issue_time_flags_a_hold_shorter_than_the_issue():
    calls = []
    held = host_work.issue_time(lambda: calls.append(1), 3, lambda: calls.append(0), hold_s=0.0)
    assert calls == [0, 1] * 3 and held["rounds"] == 3 and not held["covered"]
    assert host_work.issue_time(lambda: None, 1, lambda: None)["covered"]  # no hold given: nothing to flag
