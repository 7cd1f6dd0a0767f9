"""Every Triton kernel, at every configuration its launcher can choose, compiles to cubin on this CPU-only
machine (tools/kernel_report.py, run without the interpreter). To keep the suite short it builds the
shipped configurations for Hopper (sm_90a) in the aligned specialisation (the one real models run), and
the tuning candidates for one dtype pair on their own architecture (sm_90a or Ampere's sm_80);
`make kernel-report` builds everything: the shipped configurations for sm_80 too, the unaligned
specialisation (correct but slow code for odd sizes, which the interpreter tests run) and the candidates
for every 16-bit pair. The wgrad's fused update at the default configuration and each sm_90 candidate is
also built on its own (12 builds) and read for what decides its speed on an H100/H200: CTAs per SM, the
main loop's prefetch depth, the epilogue's instructions; so are the forward and dgrad GEMMs a bf16 GPU run
compiles (up, down, dX, dHpre), at the default and each sm_90 candidate (about 30 builds)."""

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
# The tuning candidates (ops/triton_backend/configs.py) are built for this dtype pair here, bf16 activations with fp32
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


def _build(out: Path, *options: str) -> None:
    """tools/kernel_report.py with ``options`` (default: the shipped configurations for sm_90a, aligned,
    and the candidates for CANDIDATE_DTYPES), its rows written to ``out``."""
    options = options or (
        "--targets",
        "sm_90a",
        "--unaligned-targets",
        "--candidate-dtypes",
        *CANDIDATE_DTYPES,
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # This checkout's package, whatever the environment has installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "kernel_report.py"), "--json", str(out), *options],
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )


def _kernel_report():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import kernel_report
    finally:
        sys.path.pop(0)
    return kernel_report


def test_every_kernel_and_configuration_builds(report):
    kernel_report = _kernel_report()
    kernels = {s.kernel.fn.__name__ for s in kernel_report.specs()}
    assert kernels == {
        "routing_histogram_kernel",
        "routing_scan_kernel",
        "routing_scatter_kernel",
        "expert_mlp_fwd_up_kernel",
        "expert_mlp_grouped_mm_kernel",
        "expert_mlp_fwd_up_tma_kernel",
        "expert_mlp_grouped_mm_tma_kernel",
        "expert_mlp_combine_kernel",
        "expert_mlp_bwd_dhpre_kernel",
        "expert_mlp_bwd_dw_kernel",
        "expert_mlp_bwd_dweights_kernel",
        "adamw_kernel",
        "adamw_8bit_kernel",
        "update_begin_kernel",
        "update_end_kernel",
        "bound_magnitudes_kernel",
        "bound_table_kernel",
        "bound_flag_kernel",
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
    from sonar_kernels.ops.triton_backend import configs

    built = {(r["kernel"], r["target"], tuple(sorted(r["config"].items()))) for r in report}
    kernels = {"up": "expert_mlp_fwd_up_kernel", "grouped_mm": "expert_mlp_grouped_mm_kernel",
               "dhpre": "expert_mlp_bwd_dhpre_kernel", "wgrad": "expert_mlp_bwd_dw_kernel"}  # fmt: skip
    for family, lists in configs.CANDIDATES.items():
        for (_, major), options in lists.items():
            for config in options:
                blocks = config.blocks() | config.launch()
                if family in ("wgrad", "dhpre"):
                    blocks["EPILOGUE_SPLIT"] = config.EPILOGUE_SPLIT
                # The shipped configuration (fp32's only one) is built for sm_90a here.
                if config in lists[("fp32", None)]:
                    targets = ("sm_90a",)
                else:
                    targets = ("sm_90a",) if major == 9 else ("sm_80",)
                # The TMA candidates are kernels of their own (kernels/expert_mlp_tma.py).
                name = kernels[family].replace("_kernel", "_tma_kernel") if config.TMA else kernels[family]
                for target in targets:
                    assert any(
                        kernel == name and arch == target and blocks.items() <= dict(items).items()
                        for kernel, arch, items in built
                    ), (family, target, config)
    # The fused update's own tiles (8-bit moments, bf16 master weights), beyond the default, on sm_90a.
    for config in configs.OWN_CANDIDATES[9][1:]:
        blocks = config.blocks() | config.launch() | config.epilogue()
        variants = {
            r["variant"]
            for r in report
            if r["kernel"] == "expert_mlp_bwd_dw_kernel" and r["config"].items() >= blocks.items()
        }
        for kind in ("adamw-8bit", "remainder", "stochastic"):
            assert any(kind in v and "candidate" in v for v in variants), (config, kind)
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
        "expert_mlp_fwd_up_tma_kernel",
        "expert_mlp_grouped_mm_tma_kernel",
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


@pytest.fixture(scope="module")
def wgrad_adamw(tmp_path_factory):
    """The rows of kernel_report's table "wgrad variants on sm_90a" for the fused update in AdamW's fp32
    arithmetic (the one torch's fused AdamW uses on the GPU, so the one a GPU run's update compiles), bf16
    weights and moments, dW1 and dW2, at the default and each sm_90 candidate: 12 builds, about 30 s."""
    out = tmp_path_factory.mktemp("wgrad") / "wgrad-adamw.json"
    _build(out, "--wgrad-variants", "adamw-fp32", "--candidate-dtypes", "bf16/bf16", "--jobs", "1")
    return json.loads(out.read_text())


def test_wgrad_update_on_sm90a_occupancy_pipeline_and_epilogue(wgrad_adamw):
    from sonar_kernels.ops.triton_backend import configs

    candidates = configs.CANDIDATES["wgrad"][("16bit", 9)]
    rows = {}
    for r in wgrad_adamw:
        # The Config the row was built at (a field its config does not name at the field's default).
        fields = configs.Config._field_defaults | r["config"]
        rows[configs.Config(*(fields[f] for f in configs.Config._fields)), r["wgrad_table"]] = r
    # Every configuration the GPU's tuner can pick, for both weights.
    assert set(rows) == {(c, f"{role} adamw-fp32") for c in candidates for role in ("dW1", "dW2")}
    for (config, name), r in rows.items():
        assert r["target"] == "sm_90a" and r["wgmma"], (config, name)
        assert r["spill_stores"] == r["spill_loads"] == 0, (config, name, r)
        # The main loop and the epilogue were found: a loop holding the wgmma that waits on its cp.async
        # copies, and SASS after it.
        assert r["loop_wait_groups"] and r["epilogue_instructions"], (config, name, r)
        # At 5 stages the loop waits with copies still in flight (wait_group 3, 3 buffers of Q). At 3 and 4
        # the gathered rows' index load takes a stage: 2 buffers, wait_group 0, each iteration's operands
        # fetched only one iteration ahead.
        if config.num_stages >= 5:
            assert min(r["loop_wait_groups"]) >= 1, (config, name, r["loop_wait_groups"])
        # The update's epilogue costs about 85 SASS instructions per element at 128x64 and 78 at 128x128
        # (IEEE division and square root as torch's kernel, int64 offsets), which bounds its issue rate.
        assert r["epilogue_per_element"] <= 90, (config, name, r["epilogue_per_element"])
    # The default configuration runs 2 blocks per SM (109 registers x 256 threads), for both weights.
    for role in ("dW1", "dW2"):
        assert rows[candidates[0], f"{role} adamw-fp32"]["ctas_per_sm"] == 2
    # The prefetched epilogue keeps 2 blocks per SM (128 registers) and issues the next column slice's loads
    # of W, exp_avg and exp_avg_sq before the first slice's stores: 6 loads ahead of the first store where
    # the plain epilogue has 3.
    prefetched = [c for c in candidates if c.EPILOGUE_PREFETCH]
    assert prefetched
    for config in prefetched:
        plain = rows[config._replace(EPILOGUE_PREFETCH=False), "dW1 adamw-fp32"]
        for role in ("dW1", "dW2"):
            r = rows[config, f"{role} adamw-fp32"]
            assert r["ctas_per_sm"] == 2, (config, role, r["registers"])
            assert r["epilogue_loads_ahead"] == 2 * plain["epilogue_loads_ahead"] == 6, (config, role)


def test_sm90_occupancy_and_main_loop_reading():
    kernel_report = _kernel_report()
    # Registers decide (109 round up to 112: 28,672 a block of 256 threads), or shared memory (120 KB and 1
    # KB reserved), or the 2,048 threads, or the 32 blocks.
    assert kernel_report.ctas_per_sm(109, 24704, 8) == 2
    assert kernel_report.ctas_per_sm(59, 24704, 8) == 4
    assert kernel_report.ctas_per_sm(63, 120 * 1024, 4) == 1
    assert kernel_report.ctas_per_sm(24, 0, 16) == 4
    assert kernel_report.ctas_per_sm(16, 0, 1) == 32
    # Only the waits inside the loop that issues the MMA count: not the prologue's, nor the epilogue's.
    ptx = """
\tcp.async.wait_group \t2;
$L__BB0_4:                              // =>This Inner Loop Header: Depth=1
\tcp.async.wait_group \t0;
\tbar.sync \t0;
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, %p1, 1, 1, 1, 1;
\twgmma.wait_group.sync.aligned 1;
\t@%p18 bra \t$L__BB0_4;
\tcp.async.wait_group \t0;
$L__BB0_6:
\tcp.async.wait_group \t5;
\t@%p2 bra \t$L__BB0_6;
"""
    assert kernel_report.loop_wait_groups(ptx) == [0]
    assert kernel_report.loop_wait_groups(ptx.replace("group \t0;\n\tbar", "group \t3;\n\tbar")) == [3]
    assert kernel_report.operand_buffers(
        "%p = ttg.local_alloc : () -> !ttg.memdesc<3x128x32xbf16, #shared1, #smem, mutable>\n"
        "%s = ttg.local_alloc : () -> !ttg.memdesc<1x32xi32, #shared, #smem, mutable>\n"
        "%q = ttg.local_alloc : () -> !ttg.memdesc<2x32x64xbf16, #shared2, #smem, mutable>"
    ) == [3, 2]


@pytest.fixture(scope="module")
def wgrad_own(tmp_path_factory):
    """The rows of kernel_report's table "wgrad variants on sm_90a" for the fused update with 8-bit moments
    and with bf16 master weights (a remainder, stochastic rounding), dW1 and dW2, at each of their own
    sm_90 candidates: 12 builds."""
    out = tmp_path_factory.mktemp("wgrad") / "wgrad-own.json"
    _build(out, "--wgrad-variants", "8bit", "remainder", "stochastic", "--candidate-dtypes", "--jobs", "1")
    return json.loads(out.read_text())


def test_the_rebuilt_8bit_epilogue_on_sm90a(wgrad_own):
    from sonar_kernels.ops.triton_backend import configs

    rows = {}
    for r in wgrad_own:
        fields = configs.Config._field_defaults | r["config"]
        rows[configs.Config(*(fields[f] for f in configs.Config._fields)), r["wgrad_table"]] = r
    kinds = ("8bit", "remainder", "stochastic")
    own = configs.OWN_CANDIDATES[9]
    assert set(rows) == {(c, f"{role} {kind}") for c in own for role in ("dW1", "dW2") for kind in kinds}
    for key, r in rows.items():
        assert r["wgmma"] and r["spill_stores"] == r["spill_loads"] == 0, (key, r)
    rebuilt = [c for c in own if c.EPILOGUE_PREFETCH]
    assert rebuilt
    for config in rebuilt:
        for role in ("dW1", "dW2"):
            today = rows[config._replace(EPILOGUE_PREFETCH=False), f"{role} 8bit"]
            r = rows[config, f"{role} 8bit"]
            # The closed-form quantizer replaces 17 dependent gathers of its binary search per element (8 for
            # exp_avg's 128 entries, 9 for exp_avg_sq's 256): at least 15 % fewer epilogue instructions per
            # element (411 -> 340 at 64x64), and the right slice's W, codes and scales loaded before the left
            # slice's first store.
            assert r["epilogue_per_element"] <= 0.85 * today["epilogue_per_element"], (role, r, today)
            assert r["epilogue_loads_ahead"] > today["epilogue_loads_ahead"], (role, r, today)


@pytest.fixture(scope="module")
def gemm_variants(tmp_path_factory):
    """The rows of kernel_report's table "forward and dgrad variants on sm_90a": the up-projection, the down
    projection's and dX's grouped GEMM, dHpre with and without the magnitudes (bf16, SwiGLU), at the default
    and each sm_90 candidate of their families: about 30 builds."""
    out = tmp_path_factory.mktemp("gemm") / "gemm-variants.json"
    _build(out, "--gemm-variants", "--candidate-dtypes", "bf16/bf16", "--jobs", "1")
    return json.loads(out.read_text())


def test_forward_and_dgrad_gemms_on_sm90a_occupancy_pipeline_and_epilogue(gemm_variants):
    from sonar_kernels.ops.triton_backend import configs

    kernel_report = _kernel_report()
    family = {"up": "up", "down": "grouped_mm", "dX": "grouped_mm", "dHpre": "dhpre", "dHpre-plain": "dhpre"}
    rows = {}
    for r in gemm_variants:
        fields = configs.Config._field_defaults | r["config"]
        rows[configs.Config(*(fields[f] for f in configs.Config._fields)), r["gemm_table"]] = r
    # Every configuration the GPU's tuner can pick, for every kind.
    assert set(rows) == {
        (c, kind)
        for kind in kernel_report.GEMM_TABLE_KINDS
        for c in configs.CANDIDATES[family[kind]][("16bit", 9)]
    }
    for (config, kind), r in rows.items():
        assert r["target"] == "sm_90a" and r["wgmma"], (config, kind)
        assert r["spill_stores"] == r["spill_loads"] == 0, (config, kind, r)
        assert r["shared_bytes"] <= SHARED_LIMITS["sm_90a"], (config, kind)
        assert r["operand_buffers"] and set(r["operand_buffers"]) == {config.num_stages}, (config, kind)
        assert r["epilogue_instructions"], (config, kind)
        if config.TMA and kind == "up":
            # W1 through TMA (cp.async.bulk.tensor), the gathered X by cp.async: one group per stage.
            assert r["tma_loads"] >= config.num_stages, (config, kind, r)
            assert r["loop_wait_groups"] == [config.num_stages - 2], (config, kind, r)
            continue
        if config.TMA:
            # Both operands through TMA (cp.async.bulk.tensor, 2 per K step per half, with the pipeline's
            # prologue), one buffer per stage each, no cp.async groups to wait on (mbarriers instead).
            assert r["tma_loads"] >= 2 * config.num_stages and r["loop_wait_groups"] == [], (config, kind, r)
            continue
        # The main loop waits with copies in flight (its operands are not gathered by an index loaded in the
        # loop): 2 at 3 stages, 4 at 4 (a group for each operand per stage), 6 at 5.
        assert r["loop_wait_groups"] == [2 * (config.num_stages - 2)], (config, kind, r["loop_wait_groups"])
        assert r["tma_loads"] == 0, (config, kind)
    # Today's defaults: the up-projection at 4 CTAs per SM (63 registers), the down projection and dX at 5 (45
    # and 46), dHpre at 1 (146 registers, 95 epilogue instructions per (gate, up) pair with the magnitudes).
    ctas = {"up": 4, "down": 5, "dX": 5, "dHpre": 1, "dHpre-plain": 1}
    for kind, count in ctas.items():
        assert rows[configs.CANDIDATES[family[kind]][("16bit", 9)][0], kind]["ctas_per_sm"] == count, kind
    # The 128-row candidates of the up-projection, the down projection and dX: 2 CTAs per SM, and a deeper
    # pipeline than today's (wait_group 4 or 6).
    for kind in ("up", "down", "dX"):
        deep = [
            c
            for c in configs.CANDIDATES[family[kind]][("16bit", 9)]
            if c.BLOCK_M == 128 and c.num_stages >= 4
        ]
        assert len(deep) >= 2, kind
        for config in deep:
            assert rows[config, kind]["ctas_per_sm"] >= 2, (config, kind, rows[config, kind]["registers"])
    # The TMA grouped GEMM (ops/triton_backend/tma.py): at the default's tile as many CTAs per SM as today's (5), at
    # 128x128x64 2 (90 registers where the pointer kernel's dX has 164 and 1 CTA per SM), and the persistent
    # candidates at least ops.triton_backend.tma.PERSISTENT_CTAS_PER_SM, the programs per SM its grid launches.
    from sonar_kernels.ops.triton_backend import tma

    for kind in ("down", "dX"):
        for config in configs.TMA_CANDIDATES:
            r = rows[config, kind]
            pointer = rows.get((config._replace(TMA=False, PERSISTENT=False), kind))
            assert r["ctas_per_sm"] >= (pointer or r)["ctas_per_sm"], (config, kind)
            if config.PERSISTENT:
                assert r["ctas_per_sm"] >= tma.PERSISTENT_CTAS_PER_SM, (config, kind, r["registers"])
    assert rows[configs.TMA_CANDIDATES[1], "dX"]["ctas_per_sm"] == 2
    # The up-projection with W1 through TMA: as many CTAs per SM as the pointer kernel at the same tile.
    for config in configs.UP_TMA_CANDIDATES:
        pointer = config._replace(TMA=False)
        assert rows[config, "up"]["ctas_per_sm"] >= rows[pointer, "up"]["ctas_per_sm"], config
    # dHpre's epilogue in column slices: at most 128 registers (2 CTAs per SM or more) where the whole-tile
    # epilogue at the same tile has 146 to 252 (1 CTA), and at least 25 % fewer epilogue instructions per
    # (gate, up) pair (the magnitudes kept elementwise and reduced once per tile, as integer bits).
    sliced = [c for c in configs.CANDIDATES["dhpre"][("16bit", 9)] if c.EPILOGUE_SPLIT > 1]
    assert len(sliced) >= 2
    for config in sliced:
        for kind in ("dHpre", "dHpre-plain"):
            r = rows[config, kind]
            assert r["registers"] <= 128 and r["ctas_per_sm"] >= 2, (config, kind, r["registers"])
        # Against today's epilogue at the same tile where that is a candidate, else at the default tile.
        whole = config._replace(EPILOGUE_SPLIT=1)
        today = rows[
            whole if (whole, "dHpre") in rows else configs.CANDIDATES["dhpre"][("16bit", 9)][0], "dHpre"
        ]
        r = rows[config, "dHpre"]
        assert r["epilogue_per_element"] <= 0.75 * today["epilogue_per_element"], (config, r, today)
