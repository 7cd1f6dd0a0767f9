"""Every Triton kernel, at every configuration its launcher can choose, compiles to cubin on this CPU-only
machine (tools/kernel_report.py, run without the interpreter). To keep the suite short it builds the
shipped configurations for Hopper (sm_90a) in the aligned specialisation (the one real models run), and
the tuning candidates for one dtype pair on their own architecture (sm_90a or Ampere's sm_80);
`make kernel-report` builds everything: the shipped configurations for sm_80 too, the unaligned
specialisation (correct but slow code for odd sizes, which the interpreter tests run) and the candidates
for every 16-bit pair."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
# The report compiles every kernel at about 200 configurations: minutes on 2 cores with a cold Triton
# cache, more than the suite's per-test limit.
pytestmark = pytest.mark.timeout(2400)
# The tuning candidates (ops/configs.py) are built for this dtype pair here, bf16 activations with fp32
# master weights (the pair with the most registers per tile); make kernel-report builds every 16-bit pair.
CANDIDATE_DTYPES = ("bf16/fp32",)
# Shared memory per block the architectures allow (bytes): sm_90 227 KB, sm_80 163 KB.
SHARED_LIMITS = {"sm_90a": 227 * 1024, "sm_80": 163 * 1024}


@pytest.fixture(scope="session")
def report(tmp_path_factory):
    # Built once per run: pytest-xdist workers share the parent of their temporary folders, and the first
    # worker to need the report builds it there while the others wait on the lock.
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent
    out = shared / "kernel-report.json"
    with FileLock(f"{out}.lock"):
        if not out.exists():
            _build(out)
    return json.loads(out.read_text())


def _build(out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "kernel_report.py"),
            "--json",
            str(out),
            "--targets",
            "sm_90a",
            "--unaligned-targets",
            "--candidate-dtypes",
            *CANDIDATE_DTYPES,
        ],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )


def test_every_kernel_and_configuration_builds(report):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import kernel_report
    finally:
        sys.path.pop(0)
    kernels = {s.kernel.fn.__name__ for s in kernel_report.specs()}
    assert kernels == {
        "routing_histogram_kernel",
        "routing_scan_kernel",
        "routing_scatter_kernel",
        "expert_mlp_fwd_up_kernel",
        "expert_mlp_grouped_mm_kernel",
        "expert_mlp_combine_kernel",
        "expert_mlp_bwd_dhpre_kernel",
        "expert_mlp_bwd_dw_kernel",
        "expert_mlp_bwd_dweights_kernel",
        "adamw_kernel",
        "adamw_scalars_kernel",
        "adamw_8bit_kernel",
    }
    import os

    os.environ[kernel_report.CANDIDATE_DTYPES_ENV] = ",".join(CANDIDATE_DTYPES)
    try:
        every = kernel_report.specs()
    finally:
        del os.environ[kernel_report.CANDIDATE_DTYPES_ENV]
    shipped = [s for s in every if not s.aligned_only]
    candidates = [s for s in every if s.aligned_only]
    # Each shipped configuration aligned on sm_90a; each tuning candidate aligned, on its target.
    assert len(report) == len(shipped) + len(candidates)
    assert {(r["specialisation"], r["target"]) for r in report[: len(shipped)]} == {("aligned", "sm_90a")}
    assert [(r["kernel"], r["variant"]) for r in report[: len(shipped)]] == [
        (s.kernel.fn.__name__, s.variant) for s in shipped
    ]
    # Every candidate configuration of every family was built, on its architecture.
    from sonar_kernels.ops import configs

    built = {(r["kernel"], r["target"], tuple(sorted(r["config"].items()))) for r in report}
    kernels = {"up": "expert_mlp_fwd_up_kernel", "grouped_mm": "expert_mlp_grouped_mm_kernel",
               "dhpre": "expert_mlp_bwd_dhpre_kernel", "wgrad": "expert_mlp_bwd_dw_kernel"}  # fmt: skip
    for family, lists in configs.CANDIDATES.items():
        for (_, major), options in lists.items():
            for config in options:
                blocks = config.blocks() | config.launch()
                if family == "wgrad":
                    blocks["EPILOGUE_SPLIT"] = config.EPILOGUE_SPLIT
                # The shipped configuration (fp32's only one) is built for sm_90a here.
                if config in lists[("fp32", None)]:
                    targets = ("sm_90a",)
                else:
                    targets = ("sm_90a",) if major == 9 else ("sm_80",)
                for target in targets:
                    assert any(
                        kernel == kernels[family] and arch == target and blocks.items() <= dict(items).items()
                        for kernel, arch, items in built
                    ), (family, target, config)
    assert all(row["cubin_bytes"] > 0 for row in report)
    # The AdamW hyperparameters (lr, beta1, beta2, eps, weight_decay) are read from a float64 tensor on
    # the device (so a new lr reaches a captured step), never passed as kernel scalars.
    for row in report:
        assert row["f64_params"] == 0, row
    # Each BLOCK_E the routing launcher can pick (E = 1 .. 1024) was built, for each of its three kernels.
    for kernel in ("routing_histogram_kernel", "routing_scan_kernel", "routing_scatter_kernel"):
        block_e = {row["config"]["BLOCK_E"] for row in report if row["kernel"] == kernel}
        assert block_e == {16, 32, 64, 128, 256, 512, 1024}, kernel


def test_no_register_spills_at_real_model_shapes(report):
    spills = [
        r for r in report if r["specialisation"] == "aligned" and (r["spill_stores"] or r["spill_loads"])
    ]
    assert not spills, spills


def test_shared_memory_within_each_architectures_limit(report):
    over = [r for r in report if r["shared_bytes"] > SHARED_LIMITS[r["target"]]]
    assert not over, over


def test_gemms_use_tensor_cores_and_fp32_stays_fp32(report):
    gemms = [r for r in report if r["is_gemm"]]
    # The grouped GEMMs (forward, dHpre, dX) and the wgrad kernels, with or without the AdamW epilogue.
    assert {r["kernel"] for r in gemms} == {
        "expert_mlp_fwd_up_kernel",
        "expert_mlp_grouped_mm_kernel",
        "expert_mlp_bwd_dhpre_kernel",
        "expert_mlp_bwd_dw_kernel",
    }
    for row in gemms:
        # Variants name the activation dtype first: fp32 activations are the ieee GEMMs.
        assert (row["input_precision"] == "ieee") == row["variant"].startswith("x=fp32"), row
        if row["input_precision"] == "ieee":
            # FMA, never a silent tf32 mma.
            assert not row["wgmma"] and not row["mma_sync"], row
        elif row["target"] == "sm_90a":
            assert row["wgmma"], row
        else:
            assert row["mma_sync"], row
