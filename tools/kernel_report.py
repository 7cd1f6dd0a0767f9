"""Compile every Triton kernel, at every configuration its launcher can choose, for NVIDIA GPUs.

Runs on a machine without a GPU: ``triton.compile`` on an ``ASTSource`` with a ``GPUTarget`` goes down to
cubin (Hopper sm_90a and Ampere sm_80), and ``ptxas -v`` from the triton wheel reports registers, spills
and shared memory. The interpreter accepts code that the compiler rejects, so this is what proves the
kernels are GPU code.

Each kernel is compiled in two specialisations, as Triton's JIT would compile it:
- ``aligned``: pointers 16-byte aligned, integer sizes and strides multiples of 16 (but top_k and the
  routing tensors' row strides, :data:`TOP_K_INTS`), unit innermost strides: the real model shapes
  (OLMoE-1B-7B, Granite-3.1-3B-A800M). These must not spill.
- ``unaligned``: no divisibility known (H or I not a multiple of 16): correct but slow code whose spills
  are reported, not gated.

Scalar arguments are i32, or the type their annotation gives (``lr: tl.float64`` -> fp64), or i64 where a
spec says so (a separate layout's half stride: the distance between two allocations).

For the wgrad kernel's variants that a bf16 GPU run compiles (WGRAD_TABLE_KINDS, at the default and
each sm_90 tuning candidate) a second table, "wgrad variants on sm_90a", reads what decides their speed
from the sm_90a build: CTAs per SM (from registers, shared memory and warps), the main loop's pipeline (the
operands' shared-memory buffers, its ``cp.async.wait_group`` depth in the PTX) and the epilogue's SASS
instructions per output element (:func:`read_sm90_code`). The forward and dgrad GEMMs a bf16 GPU run compiles
(GEMM_TABLE_KINDS, likewise) get a third, "forward and dgrad variants on sm_90a".

Usage: ``python tools/kernel_report.py`` prints the tables; ``--json PATH`` also writes the rows; ``--jobs N``
compiles in N processes (default: one per CPU); ``--wgrad-variants [KIND ...]`` builds only the wgrad
table's rows, ``--gemm-variants [KIND ...]`` only those of the forward and dgrad table.
Must run without TRITON_INTERPRET (kernels decorated under the interpreter cannot be compiled).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sonar_kernels import ops
from sonar_kernels.kernels import (
    adamw,
    expert_mlp_bwd,
    expert_mlp_fwd,
    expert_wgrad,
    moments_8bit,
    routing,
    update_bound,
    update_steps,
)
from sonar_kernels.ops.triton_backend import update_bound as ops_update_bound
from sonar_kernels.ops.triton_backend import update_steps as ops_update_steps
from sonar_kernels.specs import ACTIVATIONS

# Integers that are never multiples of 16, even at aligned shapes: top_k (1 to 8 in the models) and the row
# strides of the [T, top_k] routing tensors.
TOP_K_INTS = ("top_k", "stride_wt", "stride_index_t")

TARGETS = {"sm_90a": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
CUOBJDUMP = PTXAS.parent / "cuobjdump"
TL_DTYPES = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}
# The wgrad kernel's 8-bit moments' pointers where its moments are exact (never read; typed as the JIT
# types the placeholder tensor ops.triton_backend.wgrad passes).
# The pointers a launch passes where the kernel does not read them (the hyperparameters' tensor): the 8-bit
# moments' scales and tables, and bf16 master weights' remainder and stochastic rounding's key.
NO_8BIT_POINTERS = {
    "exp_avg_scales_ptr": "fp64", "exp_avg_sq_scales_ptr": "fp64", "tables_ptr": "fp64", "remainder_ptr": "fp64",
    "rng_ptr": "fp64", "clipped_ptr": "fp64",
}  # fmt: skip
# (activation dtype, weight dtype) pairs the launchers accept: weights in the activation dtype, or fp32
# master weights.
DTYPE_PAIRS = (("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32"), ("fp16", "fp32"))
# The wgrad variants the GPU benchmark compiles for a bf16 model with bf16 moments (bench/dry_run.py
# records them), at the default configuration and at each sm_90 tuning candidate (the tuner times the fused
# update against the split path at each), as the table "wgrad variants on sm_90a" shows them: the fused
# update in AdamW's fp32 arithmetic (torch's on the GPU) and fp64, the split path's store (EPILOGUE "store",
# the gradient and its norm), the plain gradient (the store without the norm: paper-inbwd's) and the check
# pass. Some differ from the JIT's key only where the code does not look, and give the same cubin: the check
# pass and the split path's store are built with ARITHMETIC "fp64" (the GPU run passes "fp32"), the plain
# gradient with the unread pointers' types of the other specs (ops.triton_backend.wgrad passes int32 offsets).
# The fused update with 8-bit moments and with bf16 master weights (a remainder, stochastic rounding; fp32
# moments, AdamW's fp64 arithmetic: the 8-bit update's, and torch 2.11's) at their own tiles
# (configs.OWN_CANDIDATES) are its last three kinds.
WGRAD_TABLE_KINDS = ("adamw-fp32", "adamw-fp64", "split", "grad", "check", "8bit", "remainder", "stochastic")
# The forward and dgrad GEMMs a bf16 GPU run compiles (OLMoE and Granite: SwiGLU, the concatenated layout, no
# biases), at the default configuration and at each sm_90 tuning candidate, as the table "forward and dgrad
# variants on sm_90a" shows them: the up-projection with its GLU, the grouped GEMM of the down projection and
# of the dX rows, and dHpre with every output (A, the routing-weight partial sums, the magnitudes: sonar's
# update follows) and without the magnitudes (a plain gradient: paper-inbwd's).
GEMM_TABLE_KINDS = ("up", "down", "dX", "dHpre", "dHpre-plain")


@dataclass
class Spec:
    """One kernel at one configuration: pointer dtypes, constexprs, launch options."""

    kernel: object
    variant: str
    pointers: dict[str, str]  # pointer arg -> Triton element type ("bf16", "i32", ...)
    constexprs: dict[str, object]
    options: dict[str, int]
    unit_strides: tuple[str, ...] = ()  # innermost strides; the JIT turns a stride of 1 into a constexpr
    wide_ints: tuple[str, ...] = ()  # integers the JIT types i64 (values of 2**31 or more)
    is_gemm: bool = False
    config: dict = field(default_factory=dict)
    targets: tuple[str, ...] = tuple(TARGETS)  # a tuning candidate: its architecture's target only
    aligned_only: bool = False  # a tuning candidate: the tuner times it at the layer's real shapes
    # A row of the wgrad variants' table ("dW1 adamw-fp32", ...; WGRAD_TABLE_KINDS): its sm_90a build's
    # main loop and epilogue are read too (read_sm90_code).
    wgrad_table: str = ""
    # A row of the forward and dgrad variants' table ("up", "down", "dX", "dHpre", "dHpre-plain";
    # GEMM_TABLE_KINDS): its sm_90a build's main loop and epilogue are read too (read_sm90_code).
    gemm_table: str = ""
    # Tensor-descriptor arguments (host-side TMA descriptors): argument -> the JIT's type,
    # "tensordesc<bf16[1, 64, 32]>" (element type and block shape).
    descriptors: dict[str, str] = field(default_factory=dict)


def _source(spec: Spec, aligned: bool) -> ASTSource:
    """The kernel as the JIT would specialise it: pointers from ``spec.pointers``, scalars i32 unless
    annotated (``lr: tl.float64`` -> "fp64"), divisibility 16 on pointers and, if aligned, on the integers
    the JIT specialises (not those in the kernel's ``do_not_specialize``)."""
    fn = spec.kernel
    constexprs = dict(spec.constexprs)
    constexprs.update({name: 1 for name in spec.unit_strides})
    # Expert clipping is off unless a spec turns it on; its count pointer is then the hyperparameters'
    # placeholder, as ops.triton_backend.wgrad passes it.
    pointers = dict(spec.pointers)
    if any(param.name == "CLIP" for param in fn.params):
        constexprs.setdefault("CLIP", False)
        pointers.setdefault("clipped_ptr", "i32" if constexprs["CLIP"] else "fp64")
    signature, attrs = {}, {}
    for param in fn.params:
        name = param.name
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if param.is_constexpr:
            raise ValueError(f"{fn.__name__}: constexpr {name} has no value in spec {spec.variant!r}")
        if name in spec.descriptors:
            signature[name] = spec.descriptors[name]
            continue
        if name in pointers:
            signature[name] = f"*{pointers[name]}"
        else:
            signature[name] = "i64" if name in spec.wide_ints else param.annotation or "i32"
        if name in pointers or (
            aligned
            and signature[name] in ("i32", "i64")
            and not param.do_not_specialize
            and name not in TOP_K_INTS
        ):
            attrs[(param.num,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, signature, constexprs, attrs)


def specs() -> list[Spec]:
    """Every kernel at every configuration ops.py can choose, for each dtype combination it launches."""
    out = []
    # Routing metadata (histogram, scan, scatter): BLOCK_E/BLOCK_S/BLOCK_B depend on E only; one spec per
    # distinct choice.
    seen = set()
    for E in range(1, ops.MAX_EXPERTS + 1):
        cfg = ops.routing_block_config(E)
        key = (cfg["BLOCK_E"], cfg["BLOCK_S"], cfg["BLOCK_B"])
        if key in seen:
            continue
        seen.add(key)
        blocks = {"BLOCK_S": cfg["BLOCK_S"], "BLOCK_E": cfg["BLOCK_E"]}
        config = {"BLOCK_E": cfg["BLOCK_E"], "BLOCK_S": cfg["BLOCK_S"], "BLOCK_B": cfg["BLOCK_B"]}
        launch = {"num_warps": cfg["num_warps"]}
        for index in ("i64", "i32") if cfg["BLOCK_E"] == 64 else ("i64",):
            out.append(
                Spec(routing.routing_histogram_kernel, f"index={index}",
                     {"top_k_index_ptr": index, "block_rows_ptr": "i32"}, blocks, launch,
                     unit_strides=("stride_index_j",), config=config)
            )  # fmt: skip
            out.append(
                Spec(routing.routing_scatter_kernel, f"index={index}",
                     {"top_k_index_ptr": index} | dict.fromkeys(
                         ("block_rows_ptr", "row_of_slot_ptr", "token_of_row_ptr", "slot_of_row_ptr"), "i32"),
                     blocks, launch, unit_strides=("stride_index_j",), config=config)
            )  # fmt: skip
        out.append(
            Spec(routing.routing_scan_kernel, "",
                 dict.fromkeys(("block_rows_ptr", "expert_offsets_ptr", "tile_offsets_ptr"), "i32"),
                 {"TILE_M": expert_mlp_fwd.TILE_M, "BLOCK_B": cfg["BLOCK_B"], "BLOCK_E": cfg["BLOCK_E"]}, launch,
                 config=config)
        )  # fmt: skip
    return (
        out
        + _forward_specs()
        + _backward_specs()
        + _wgrad_8bit_specs()
        + _adamw_specs()
        + _candidate_specs()
        + _own_candidate_specs()
        + _tma_specs()
    )


# The 16-bit (activation, weight) dtype pairs the tuning candidates are built for; ``--candidate-dtypes``
# (passed to the compiler processes through this environment variable) chooses fewer.
CANDIDATE_DTYPES = [f"{a}/{w}" for a, w in DTYPE_PAIRS if a != "fp32"]
CANDIDATE_DTYPES_ENV = "SONAR_KERNEL_REPORT_CANDIDATE_DTYPES"


def _candidate_specs() -> list[Spec]:
    """Every tuning candidate of ops/triton_backend/configs.py beyond the default (which the specs above build), at its
    architecture, aligned, for the kernels' main variants and each 16-bit dtype pair (the wgrad's fused
    update in both AdamW arithmetics: fp64 has the most registers, fp32 is the one a tuned update runs in on
    the GPU; its split path's store, gradient and norm, which the tuner times against it)."""
    from sonar_kernels.ops.triton_backend import configs

    variants = {
        "up": (expert_mlp_fwd.expert_mlp_fwd_up_kernel, ["silu"]),
        "grouped_mm": (expert_mlp_fwd.expert_mlp_grouped_mm_kernel, ["fwd", "dX"]),
        "dhpre": (expert_mlp_bwd.expert_mlp_bwd_dhpre_kernel, ["silu", "silu no-update"]),
        "wgrad": (
            expert_wgrad.expert_mlp_bwd_dw_kernel,
            [
                f"{role} {kind}"
                for role in ("dW1", "dW2")
                for kind in ("adamw-fp64", "adamw-fp32", "check", "grad", "split")
            ],
        ),
    }
    base = {(s.kernel.fn.__name__, s.variant): s for s in _forward_specs() + _backward_specs()}
    arches = {"sm_90a": 9, "sm_80": 8}
    out = []
    for family, (kernel, names) in variants.items():
        default = configs.CANDIDATES[family][("fp32", None)][0]
        for arch, major in arches.items():
            for config in configs.CANDIDATES[family][("16bit", major)]:
                if config == default or config.TMA:
                    continue  # the TMA candidates are another kernel: _tma_specs
                chosen = os.environ.get(CANDIDATE_DTYPES_ENV, ",".join(CANDIDATE_DTYPES))
                for pair in filter(None, chosen.split(",")):  # empty: --candidate-dtypes with no pair
                    act_dtype, w_dtype = pair.split("/")
                    for name in names:
                        key = (kernel.fn.__name__, f"x={act_dtype} w={w_dtype} {name}")
                        if name.endswith((" split", " no-update")) and key not in base:
                            continue  # the split path's store, dHpre without an update: for the pairs the
                            # shipped specs build them for
                        spec = base[key]
                        blocks = config.blocks() | (
                            config.epilogue()
                            if family == "wgrad"
                            else {"EPILOGUE_SPLIT": config.EPILOGUE_SPLIT}
                            if family == "dhpre"
                            else {}
                        )
                        options = spec.options | config.launch()
                        out.append(
                            replace(
                                spec,
                                variant=f"{spec.variant} candidate",
                                constexprs=spec.constexprs | blocks,
                                options=options,
                                config=blocks,
                                targets=(arch,),
                                aligned_only=True,
                                wgrad_table=spec.wgrad_table if arch == "sm_90a" else "",
                                gemm_table=spec.gemm_table if arch == "sm_90a" else "",
                            )
                        )
    return out


def _own_candidate_specs() -> list[Spec]:
    """Every tuning candidate of the fused update with 8-bit moments or bf16 master weights
    (configs.OWN_CANDIDATES) beyond the default, at its architecture, aligned, for the variants a bf16 GPU
    run compiles (the rows of the wgrad table's kinds 8bit, remainder and stochastic; the split path's store
    runs at the exact update's candidates, which :func:`_candidate_specs` builds)."""
    from sonar_kernels.ops.triton_backend import configs

    fused = [s for s in _wgrad_8bit_specs() if s.wgrad_table]
    out = []
    for arch, major in {"sm_90a": 9, "sm_80": 8}.items():
        for config in configs.OWN_CANDIDATES[major]:
            if config == configs.WGRAD_8BIT:
                continue
            blocks = config.blocks() | config.epilogue()
            for spec in fused:
                out.append(
                    replace(
                        spec,
                        variant=f"{spec.variant} candidate",
                        constexprs=spec.constexprs | blocks,
                        options=spec.options | config.launch(),
                        config=blocks,
                        targets=(arch,),
                        aligned_only=True,
                        wgrad_table=spec.wgrad_table if arch == "sm_90a" else "",
                    )
                )
    return out


def _tma_specs() -> list[Spec]:
    """The grouped GEMMs through TMA descriptors (kernels/expert_mlp_tma.py) at each TMA candidate of
    ops/triton_backend/configs.py (sm_90a, aligned), for each 16-bit dtype pair of the candidates: the down projection (W2
    [E, H, I], unit stride along K) and dX (W1's halves, unit stride along N), with bf16 weights also the
    transposed layouts (the other unit stride); the up-projection (W1 through a descriptor, SwiGLU); the
    rows of the forward and dgrad table for bf16."""
    from sonar_kernels.kernels.expert_mlp_tma import expert_mlp_grouped_mm_tma_kernel
    from sonar_kernels.ops.triton_backend import configs

    out = []
    chosen = os.environ.get(CANDIDATE_DTYPES_ENV, ",".join(CANDIDATE_DTYPES))
    for config in configs.TMA_CANDIDATES:
        blocks = config.blocks()
        bm, bn, bk = blocks["BLOCK_M"], blocks["BLOCK_N"], blocks["BLOCK_K"]
        for pair in filter(None, chosen.split(",")):
            act_dtype, w_dtype = pair.split("/")
            kinds = [("fwd", 1, False, "down"), ("dX", 2, True, "dX")]
            if act_dtype == w_dtype:
                kinds += [("fwd transposed", 1, True, ""), ("dX transposed", 2, False, "")]
            for name, halves, w_kn, table in kinds:
                w_block = [1, 1, bk, bn] if w_kn else [1, 1, bn, bk]
                out.append(
                    Spec(
                        expert_mlp_grouped_mm_tma_kernel,
                        f"x={act_dtype} w={w_dtype} {name} tma" + (" persistent" if config.PERSISTENT else ""),
                        {"b2_ptr": w_dtype, "expert_offsets_ptr": "i32", "tile_offsets_ptr": "i32",
                         "y_ptr": act_dtype},
                        _precision(act_dtype) | blocks
                        | {"HALVES": halves, "W_KN": w_kn, "HAS_BIAS": False, "PERSISTENT": config.PERSISTENT},
                        config.launch(),
                        unit_strides=("stride_yh", "stride_bh"),
                        is_gemm=True,
                        config=blocks | {"TMA": True, "PERSISTENT": config.PERSISTENT},
                        targets=("sm_90a",),
                        aligned_only=True,
                        gemm_table=table if (act_dtype, w_dtype) == ("bf16", "bf16") else "",
                        descriptors={
                            "a_desc": f"tensordesc<{act_dtype}[1, {bm}, {bk}]>",
                            "w_desc": f"tensordesc<{w_dtype}[{', '.join(map(str, w_block))}]>",
                        },
                    )
                )  # fmt: skip
    from sonar_kernels.kernels.expert_mlp_tma import expert_mlp_fwd_up_tma_kernel

    for config in configs.UP_TMA_CANDIDATES:
        blocks = config.blocks()
        for pair in filter(None, chosen.split(",")):
            act_dtype, w_dtype = pair.split("/")
            out.append(
                Spec(
                    expert_mlp_fwd_up_tma_kernel,
                    f"x={act_dtype} w={w_dtype} silu tma",
                    {"x_ptr": act_dtype, "b1_ptr": w_dtype, "token_of_row_ptr": "i32", "expert_offsets_ptr": "i32",
                     "tile_offsets_ptr": "i32", "hpre_ptr": act_dtype, "a_ptr": act_dtype},
                    _precision(act_dtype) | blocks | {"ACTIVATION": "silu", "GATED": True, "HAS_BIAS": False},
                    config.launch(),
                    unit_strides=("stride_xh", "stride_hn", "stride_an"),
                    is_gemm=True,
                    config=blocks | {"TMA": True},
                    targets=("sm_90a",),
                    aligned_only=True,
                    gemm_table="up" if (act_dtype, w_dtype) == ("bf16", "bf16") else "",
                    descriptors={"w1_desc": f"tensordesc<{w_dtype}[1, 2, {blocks['BLOCK_N']}, {blocks['BLOCK_K']}]>"},
                )
            )  # fmt: skip
    return out


def _gemm_launch(cfg: dict) -> tuple[dict, dict]:
    """(BLOCK_* constexprs, launch options) of a GEMM config dict."""
    blocks = {k: v for k, v in cfg.items() if k.startswith(("BLOCK", "EPILOGUE_"))}
    return blocks, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}


def _precision(act_dtype: str) -> dict:
    # ops.common.input_precision: full fp32 products for fp32, never a silent tf32.
    return {"INPUT_PRECISION": "ieee" if act_dtype == "fp32" else "tf32", "INTERPRET": False}


def _forward_specs() -> list[Spec]:
    """ops.triton_backend.forward.moe_mlp_fwd, and the dX of ops.triton_backend.backward (the grouped GEMM with W1's strides swapped, the unweighted combine)."""
    out = []
    blocks, options = _gemm_launch(expert_mlp_fwd.FWD_GEMM_CONFIG)
    for act_dtype, w_dtype in DTYPE_PAIRS:
        common = _precision(act_dtype) | blocks
        for activation in ACTIVATIONS if (act_dtype, w_dtype) == ("bf16", "bf16") else ("silu",):
            out.append(
                Spec(
                    expert_mlp_fwd.expert_mlp_fwd_up_kernel,
                    f"x={act_dtype} w={w_dtype} {activation}",
                    {"x_ptr": act_dtype, "w1_ptr": w_dtype, "b1_ptr": w_dtype, "token_of_row_ptr": "i32",
                     "expert_offsets_ptr": "i32", "tile_offsets_ptr": "i32", "hpre_ptr": act_dtype, "a_ptr": act_dtype},
                    common | {"ACTIVATION": activation, "GATED": True, "HAS_BIAS": False},
                    options,
                    unit_strides=("stride_xh", "stride_wh", "stride_hn", "stride_an"),
                    is_gemm=True,
                    config=blocks,
                    gemm_table="up" if (act_dtype, w_dtype, activation) == ("bf16", "bf16", "silu") else "",
                )
            )  # fmt: skip
        if (act_dtype, w_dtype) == ("bf16", "bf16"):
            # The transposed layouts: W1 [E, H, 2I], its unit stride along the rows of a half
            # (concatenated: Aria) or between the halves (interleaved, with the biases and the clamped
            # SwiGLU: gpt-oss); specs.gate_up_view.
            # And the ungated one (Nemotron-H: the up projection alone, the squared ReLU, one half), and
            # separate gate and up tensors (torchtitan), their distance an i64 half stride.
            for layout, unit, activation, bias, gated in (
                ("transposed", "stride_wn", "silu", False, True),
                ("interleaved transposed bias", "stride_wg", "clamped_swiglu", True, True),
                ("ungated", "stride_wh", "relu2", False, False),
                ("separate", "stride_wh", "silu", False, True),
            ):
                out.append(
                    Spec(
                        expert_mlp_fwd.expert_mlp_fwd_up_kernel,
                        f"x={act_dtype} w={w_dtype} {activation} {layout}",
                        {"x_ptr": act_dtype, "w1_ptr": w_dtype, "b1_ptr": w_dtype, "token_of_row_ptr": "i32",
                         "expert_offsets_ptr": "i32", "tile_offsets_ptr": "i32", "hpre_ptr": act_dtype,
                         "a_ptr": act_dtype},
                        common | {"ACTIVATION": activation, "GATED": gated, "HAS_BIAS": bias},
                        options,
                        unit_strides=("stride_xh", unit, "stride_hn", "stride_an", *(("stride_bg",) if bias else ())),
                        wide_ints=("stride_wg",) if layout == "separate" else (),
                        is_gemm=True,
                        config=blocks,
                    )
                )  # fmt: skip
        pointers = {"a_ptr": act_dtype, "w2_ptr": w_dtype, "b2_ptr": w_dtype, "expert_offsets_ptr": "i32",
                    "tile_offsets_ptr": "i32", "y_ptr": act_dtype}  # fmt: skip
        # Forward: Y = A @ W2[e]^T (+ b2[e]), W2 [E, H, I] contiguous (unit stride along I, the reduction).
        for bias in (False, True) if (act_dtype, w_dtype) == ("bf16", "bf16") else (False,):
            out.append(
                Spec(
                    expert_mlp_fwd.expert_mlp_grouped_mm_kernel,
                    f"x={act_dtype} w={w_dtype} fwd" + (" bias" if bias else ""),
                    pointers,
                    common | {"HALVES": 1, "HAS_BIAS": bias},
                    options,
                    unit_strides=("stride_ai", "stride_wi", "stride_yh", "stride_bh"),
                    is_gemm=True,
                    config=blocks,
                    gemm_table="down" if (act_dtype, w_dtype, bias) == ("bf16", "bf16", False) else "",
                )
            )
        # dX rows = dHpre @ W1[e] over W1's two halves, each [I, H] read as [H, I]: the unit stride is
        # along H (N); transposed layouts: along I (K), or between the halves (interleaved).
        dx_layouts = [("", "stride_wh")]
        if (act_dtype, w_dtype) == ("bf16", "bf16"):
            dx_layouts += [
                (" transposed", "stride_wi"),
                (" interleaved transposed", "stride_whalf"),
                (" ungated", "stride_wh"),
                (" separate", "stride_wh"),
            ]
        for layout, unit in dx_layouts:
            out.append(
                Spec(
                    expert_mlp_fwd.expert_mlp_grouped_mm_kernel,
                    f"x={act_dtype} w={w_dtype} dX{layout}",
                    pointers,
                    common | {"HALVES": 1 if "ungated" in layout else 2, "HAS_BIAS": False},
                    options,
                    unit_strides=("stride_ai", unit, "stride_yh"),
                    wide_ints=("stride_whalf",) if "separate" in layout else (),
                    is_gemm=True,
                    config=blocks,
                    gemm_table="dX" if (act_dtype, w_dtype, layout) == ("bf16", "bf16", "") else "",
                )
            )
    cc = expert_mlp_fwd.COMBINE_CONFIG
    combine = {"BLOCK_M": cc["BLOCK_M"], "BLOCK_N": cc["BLOCK_N"]}
    for act_dtype in TL_DTYPES:
        # Routing weights may come in any supported dtype, independent of the activations.
        for w_dtype in TL_DTYPES:
            out.append(
                Spec(
                    expert_mlp_fwd.expert_mlp_combine_kernel,
                    f"y={act_dtype} w={w_dtype}",
                    {"y_ptr": act_dtype, "row_of_slot_ptr": "i32", "weights_ptr": w_dtype, "out_ptr": act_dtype},
                    combine | {"HAS_WEIGHTS": True, "INTERPRET": False},
                    {"num_warps": cc["num_warps"]},
                    unit_strides=("stride_yh", "stride_wj", "stride_oh"),
                    config=combine,
                )
            )  # fmt: skip
        # dX = sum_j of the dX rows: no weights (ops.triton_backend.backward passes the rows again, with strides 0).
        out.append(
            Spec(
                expert_mlp_fwd.expert_mlp_combine_kernel,
                f"y={act_dtype} unweighted",
                {"y_ptr": act_dtype, "row_of_slot_ptr": "i32", "weights_ptr": act_dtype, "out_ptr": act_dtype},
                combine | {"HAS_WEIGHTS": False, "INTERPRET": False},
                {"num_warps": cc["num_warps"]},
                unit_strides=("stride_yh", "stride_oh"),
                config=combine,
            )
        )  # fmt: skip
    return out


def _backward_specs() -> list[Spec]:
    """ops.triton_backend.backward.moe_mlp_bwd_core and ops.triton_backend.wgrad.expert_wgrad. Routing weights are given the activation dtype (any is accepted;
    the pointer dtype only changes one load)."""
    out = []
    blocks, options = _gemm_launch(expert_mlp_bwd.DHPRE_CONFIG)
    # STORE_GRAD_HPRE (dX or dW1 needed), STORE_A (dW2), COMPUTE_DW (routing weights), HAS_ABSMAX (an
    # update follows): all four for every dtype pair; for bf16 also without the routing-weight gradient,
    # without dW2, and without an update (plain gradients).
    all_flags = {"STORE_GRAD_HPRE": True, "STORE_A": True, "COMPUTE_DW": True, "HAS_ABSMAX": True}
    for act_dtype, w_dtype in DTYPE_PAIRS:
        variants = [("silu", all_flags, "")]
        if (act_dtype, w_dtype) == ("bf16", "bf16"):
            variants += [
                ("gelu", all_flags, ""),
                ("gelu_tanh", all_flags, ""),
                ("silu", all_flags | {"COMPUTE_DW": False}, " no-dw"),
                ("silu", all_flags | {"STORE_A": False}, " no-A"),
                ("silu", all_flags | {"HAS_ABSMAX": False}, " no-update"),
                ("silu", all_flags, " transposed"),  # W2 [E, I, H]: the unit stride along H
                ("clamped_swiglu", all_flags, ""),
                ("relu2", all_flags, " ungated"),
            ]
        for activation, flags, suffix in variants:
            out.append(
                Spec(
                    expert_mlp_bwd.expert_mlp_bwd_dhpre_kernel,
                    f"x={act_dtype} w={w_dtype} {activation}{suffix}",
                    {"grad_out_ptr": act_dtype, "w2_ptr": w_dtype, "hpre_ptr": act_dtype, "weights_ptr": act_dtype,
                     "token_of_row_ptr": "i32", "slot_of_row_ptr": "i32", "expert_offsets_ptr": "i32",
                     "tile_offsets_ptr": "i32", "grad_hpre_ptr": act_dtype, "a_ptr": act_dtype,
                     "dw_partial_ptr": "fp32", "absmax_ptr": "fp32"},
                    _precision(act_dtype) | blocks | flags | {"ACTIVATION": activation, "GATED": "ungated" not in suffix},
                    options,
                    unit_strides=(
                        "stride_goh", "stride_wh" if "transposed" in suffix else "stride_wi", "stride_hn",
                        "stride_wj", "stride_gn", "stride_an",
                    ),
                    is_gemm=True,
                    config=blocks,
                    gemm_table={"": "dHpre", " no-update": "dHpre-plain"}.get(suffix, "")
                    if (act_dtype, w_dtype, activation) == ("bf16", "bf16", "silu")
                    else "",
                )
            )  # fmt: skip

    blocks, options = _gemm_launch(expert_wgrad.WGRAD_CONFIG)
    # (activation, weight, moments) dtypes; the gradient is rounded to the weight dtype.
    wgrad_dtypes = [(a, w, w) for a, w in DTYPE_PAIRS] + [("bf16", "bf16", "fp32")]
    # dW2 = (w dO[token])^T A: P gathered by token; dW1 = dHpre^T X: Q gathered by token.
    roles = {"dW2": (True, False), "dW1": (False, True)}
    # The fused epilogue in both AdamW arithmetics (kernels/adamw.py), its check pass (ops.backward: the
    # skip decision for non-finite gradients); the plain gradient. The last micro-batch of gradient
    # accumulation adds the earlier ones' gradient (HAS_GRAD_IN).
    # (EPILOGUE, ARITHMETIC, HAS_GRAD_IN, HAS_NORM): fused update and its check; plain gradient; and, for
    # fp32 and bf16, the split path (gradient written, its norm summed) and the accumulation variants.
    variants = [("adamw", "fp64", False, True), ("adamw", "fp32", False, True), ("check", "fp64", False, False),
                ("store", "fp64", False, False)]  # fmt: skip
    accumulation = [
        ("adamw", "fp64", True, True),
        ("adamw", "fp32", True, True),
        ("check", "fp64", True, False),
        ("store", "fp64", False, True),
        ("store", "fp64", True, True),
    ]
    for act_dtype, w_dtype, m_dtype in wgrad_dtypes:
        for role, (p_from_tokens, q_from_tokens) in roles.items():
            chosen = variants if m_dtype == w_dtype else variants[:3]
            if act_dtype == w_dtype == m_dtype and w_dtype in ("fp32", "bf16"):
                chosen = chosen + accumulation
            for epilogue, arithmetic, has_grad_in, has_norm in chosen:
                moments = f" m={m_dtype}" if m_dtype != w_dtype else ""
                kind = {"adamw": f"adamw-{arithmetic}", "check": "check"}.get(
                    epilogue, "split" if has_norm else "grad"
                )
                kind += " +grad_in" if has_grad_in else ""
                out.append(
                    Spec(
                        expert_wgrad.expert_mlp_bwd_dw_kernel,
                        f"x={act_dtype} w={w_dtype}{moments} {role} {kind}",
                        _wgrad_pointers(act_dtype, w_dtype, m_dtype, m_dtype),
                        _precision(act_dtype) | blocks
                        | {"P_FROM_TOKENS": p_from_tokens, "Q_FROM_TOKENS": q_from_tokens, "EPILOGUE": epilogue,
                           "HAS_GRAD_IN": has_grad_in, "HAS_NORM": has_norm, "ARITHMETIC": arithmetic,
                           "MOMENTS_8BIT": False, "REMAINDER": False, "STOCHASTIC": False,
                           "GRAD_DTYPE": TL_DTYPES[w_dtype], "DOT_DTYPE": TL_DTYPES[act_dtype]},
                        # ops.triton_backend.backward compiles the AdamW launch without automatic fma contraction.
                        options | ({"enable_fp_fusion": False} if epilogue == "adamw" else {}),
                        unit_strides=("stride_pm", "stride_qn", "stride_n"),
                        is_gemm=True,
                        config=blocks,
                        wgrad_table=f"{role} {kind}"
                        if (act_dtype, w_dtype, m_dtype) == ("bf16",) * 3 and kind in WGRAD_TABLE_KINDS
                        else "",
                    )
                )  # fmt: skip
    # Expert clipping's fused update (kernels/adamw.py, clip_tile: the hyperparameters [7], one count per
    # program), bf16 in both arithmetics.
    for role, (p_from_tokens, q_from_tokens) in roles.items():
        for arithmetic in ("fp64", "fp32"):
            out.append(
                Spec(
                    expert_wgrad.expert_mlp_bwd_dw_kernel,
                    f"x=bf16 w=bf16 {role} adamw-{arithmetic} clip",
                    _wgrad_pointers("bf16", "bf16", "bf16", "bf16") | {"clipped_ptr": "i32"},
                    _precision("bf16") | blocks
                    | _bf16_adamw_constexprs(p_from_tokens, q_from_tokens, arithmetic, CLIP=True),
                    options | {"enable_fp_fusion": False},
                    unit_strides=("stride_pm", "stride_qn", "stride_n"),
                    is_gemm=True,
                    config=blocks,
                )
            )  # fmt: skip
    # The transposed layouts' fused update (bf16): the weight's unit stride along M (the rows of a half;
    # dW2's H), or between W1's halves (interleaved).
    layouts = [("dW2", "transposed", "stride_m"), ("dW1", "transposed", "stride_m"),
               ("dW1", "interleaved transposed", "stride_half")]  # fmt: skip
    # The biases' fused update (ops.triton_backend.wgrad): the wgrad with a stride-0 column of ones for Q (N = 1, a
    # constexpr as the JIT specialises it; db2: P gathered by token, db1: dHpre), the bias seen as [E, M, 1].
    layouts += [("db2", "bias", "stride_m"), ("db1", "bias", "stride_m")]
    for role, layout, unit in layouts:
        bias = layout == "bias"
        p_from_tokens, q_from_tokens = roles["dW2" if role == "db2" else "dW1" if bias else role]
        q_from_tokens = q_from_tokens and not bias
        out.append(
            Spec(
                expert_wgrad.expert_mlp_bwd_dw_kernel,
                f"x=bf16 w=bf16 {role} adamw-fp64 {layout}",
                {"p_ptr": "bf16", "q_ptr": "bf16", "weight_of_row_ptr": "fp32", "token_of_row_ptr": "i32",
                 "expert_offsets_ptr": "i32", "dw_ptr": "bf16", "grad_in_ptr": "bf16", "w_ptr": "bf16",
                 "exp_avg_ptr": "bf16", "exp_avg_sq_ptr": "bf16", "scalars_ptr": "fp32", "flag_ptr": "fp32",
                 "partial_ptr": "fp32", "hyper_ptr": "fp64"} | NO_8BIT_POINTERS,
                _precision("bf16") | blocks
                | {"P_FROM_TOKENS": p_from_tokens, "Q_FROM_TOKENS": q_from_tokens, "EPILOGUE": "adamw",
                   "HAS_GRAD_IN": False, "HAS_NORM": True, "ARITHMETIC": "fp64", "MOMENTS_8BIT": False, "REMAINDER": False, "STOCHASTIC": False,
                   "GRAD_DTYPE": TL_DTYPES["bf16"],
                   "DOT_DTYPE": TL_DTYPES["bf16"]} | ({"N": 1} if bias else {}),
                options | {"enable_fp_fusion": False},
                # The bias's [E, M, 1] view has unit strides along M and N.
                unit_strides=("stride_pm", "stride_qn", unit, *(("stride_n",) if bias else ())),
                is_gemm=True,
                config=blocks,
            )
        )  # fmt: skip

    dc = expert_mlp_bwd.DWEIGHTS_CONFIG
    # HAS_EXTRA: the down bias's term of the routing-weight gradient (ops/bias.py).
    for g_dtype, extra in [(g, False) for g in TL_DTYPES] + [("bf16", True)]:
        out.append(
            Spec(
                expert_mlp_bwd.expert_mlp_bwd_dweights_kernel,
                f"grad_w={g_dtype}" + (" bias" if extra else ""),
                {
                    "dw_partial_ptr": "fp32",
                    "extra_ptr": "fp32",
                    "row_of_slot_ptr": "i32",
                    "grad_weights_ptr": g_dtype,
                },
                {"BLOCK": dc["BLOCK"], "HAS_EXTRA": extra, "INTERPRET": False},
                {"num_warps": dc["num_warps"]},
                config={"BLOCK": dc["BLOCK"]},
            )
        )
    return out


def _bf16_adamw_constexprs(p_from_tokens: bool, q_from_tokens: bool, arithmetic: str, **flags) -> dict:
    """The wgrad kernel's constexprs for a bf16 fused AdamW update (no gradient accumulation, the norm
    summed, exact moments), with ``flags`` (REMAINDER, STOCHASTIC, CLIP) turned on where given."""
    return {
        "P_FROM_TOKENS": p_from_tokens, "Q_FROM_TOKENS": q_from_tokens, "EPILOGUE": "adamw", "HAS_GRAD_IN": False,
        "HAS_NORM": True, "ARITHMETIC": arithmetic, "MOMENTS_8BIT": False, "REMAINDER": False, "STOCHASTIC": False,
        "CLIP": False, "GRAD_DTYPE": TL_DTYPES["bf16"], "DOT_DTYPE": TL_DTYPES["bf16"],
    } | flags  # fmt: skip


def _wgrad_pointers(act_dtype: str, w_dtype: str, exp_avg: str, exp_avg_sq: str) -> dict:
    """The wgrad kernel's pointer types for a launch without 8-bit moments' scales or bf16 master weights
    (those pointers are passed, not read)."""
    return {
        "p_ptr": act_dtype, "q_ptr": act_dtype, "weight_of_row_ptr": "fp32", "token_of_row_ptr": "i32",
        "expert_offsets_ptr": "i32", "dw_ptr": w_dtype, "grad_in_ptr": w_dtype, "w_ptr": w_dtype,
        "exp_avg_ptr": exp_avg, "exp_avg_sq_ptr": exp_avg_sq, "scalars_ptr": "fp32", "flag_ptr": "fp32",
        "partial_ptr": "fp32", "hyper_ptr": "fp64",
    } | NO_8BIT_POINTERS  # fmt: skip


def _wgrad_8bit_specs() -> list[Spec]:
    """The fused update with 8-bit moments (ops.triton_backend.wgrad with an AdamWUpdate of codes and scales): int8 and
    uint8 codes, fp32 scales, slices of one 32-column block (EPILOGUE_SPLIT = BLOCK_N / 32)."""
    blocks, options = _gemm_launch(expert_wgrad.WGRAD_8BIT_CONFIG)
    out = []
    # (activations, weight, bf16 master weights): the last two with the weight as its int16 bits.
    variants = (("fp32", "fp32", None), ("bf16", "bf16", None), ("bf16", "fp32", None),
                ("bf16", "bf16", "remainder"), ("bf16", "bf16", "stochastic"))  # fmt: skip
    for act_dtype, w_dtype, master in variants:
        for role, (p_from_tokens, q_from_tokens) in {"dW2": (True, False), "dW1": (False, True)}.items():
            out.append(
                Spec(
                    expert_wgrad.expert_mlp_bwd_dw_kernel,
                    f"x={act_dtype} w={w_dtype} {role} adamw-8bit" + (f" {master}" if master else ""),
                    {"p_ptr": act_dtype, "q_ptr": act_dtype, "weight_of_row_ptr": "fp32", "token_of_row_ptr": "i32",
                     "expert_offsets_ptr": "i32", "dw_ptr": w_dtype, "grad_in_ptr": w_dtype,
                     "w_ptr": "i16" if master else w_dtype,
                     "exp_avg_ptr": "i8", "exp_avg_sq_ptr": "u8", "scalars_ptr": "fp32", "flag_ptr": "fp32",
                     "partial_ptr": "fp32", "hyper_ptr": "fp64", "exp_avg_scales_ptr": "fp32",
                     "exp_avg_sq_scales_ptr": "fp32", "tables_ptr": "fp32",
                     "remainder_ptr": "i16" if master == "remainder" else "fp64",
                     "rng_ptr": "i64" if master == "stochastic" else "fp64"},
                    _precision(act_dtype) | blocks
                    | {"P_FROM_TOKENS": p_from_tokens, "Q_FROM_TOKENS": q_from_tokens, "EPILOGUE": "adamw",
                       "HAS_GRAD_IN": False, "HAS_NORM": True, "ARITHMETIC": "fp64", "MOMENTS_8BIT": True,
                       "REMAINDER": master == "remainder", "STOCHASTIC": master == "stochastic",
                       "GRAD_DTYPE": TL_DTYPES[w_dtype], "DOT_DTYPE": TL_DTYPES[act_dtype]},
                    options | {"enable_fp_fusion": False},
                    unit_strides=("stride_pm", "stride_qn", "stride_n"),
                    is_gemm=True,
                    config=blocks,
                    wgrad_table=f"{role} 8bit" if (act_dtype, w_dtype, master) == ("bf16", "bf16", None) else "",
                )
            )  # fmt: skip
    # The split path of the 8-bit update and of bf16 master weights: the gradient written (its norm summed)
    # on the fused epilogue's tiles, which it must equal bit for bit (ops.triton_backend.wgrad); the moments' pointers are
    # passed though not read (int8 and uint8 codes, or fp32 / bf16 moments).
    for (act_dtype, w_dtype, m_avg, m_sq), role in itertools.product(
        (("fp32", "fp32", "i8", "u8"), ("bf16", "bf16", "i8", "u8"), ("bf16", "fp32", "i8", "u8"),
         ("bf16", "bf16", "fp32", "fp32"), ("bf16", "bf16", "bf16", "bf16")),
        ("dW2", "dW1"),
    ):  # fmt: skip
        p_from_tokens, q_from_tokens = role == "dW2", role == "dW1"
        moments = "8bit" if m_avg == "i8" else f"master m={m_avg}"
        out.append(
            Spec(
                expert_wgrad.expert_mlp_bwd_dw_kernel,
                f"x={act_dtype} w={w_dtype} {role} split on the {moments} tiles",
                _wgrad_pointers(act_dtype, w_dtype, m_avg, m_sq),
                _precision(act_dtype) | blocks
                | {"P_FROM_TOKENS": p_from_tokens, "Q_FROM_TOKENS": q_from_tokens, "EPILOGUE": "store",
                   "HAS_GRAD_IN": False, "HAS_NORM": True, "ARITHMETIC": "fp64", "MOMENTS_8BIT": False,
                   "REMAINDER": False, "STOCHASTIC": False, "GRAD_DTYPE": TL_DTYPES[w_dtype],
                   "DOT_DTYPE": TL_DTYPES[act_dtype]},
                options,
                unit_strides=("stride_pm", "stride_qn", "stride_n"),
                is_gemm=True,
                config=blocks,
            )
        )  # fmt: skip
    # bf16 master weights (a remainder, or stochastic rounding's key): the weight as its int16 bits, fp32
    # or bf16 moments, the 8-bit update's tiles (the exact update's spill on sm_80 with the remainder).
    blocks, options = _gemm_launch(expert_wgrad.WGRAD_8BIT_CONFIG)
    roles = {"dW2": (True, False), "dW1": (False, True)}
    for arithmetic, remainder, m_dtype, role in itertools.product(
        ("fp64", "fp32"), (True, False), ("fp32", "bf16"), roles
    ):
        p_from_tokens, q_from_tokens = roles[role]
        out.append(
            Spec(
                expert_wgrad.expert_mlp_bwd_dw_kernel,
                f"x=bf16 w=bf16 m={m_dtype} {role} adamw-{arithmetic} {'remainder' if remainder else 'stochastic'}",
                {"p_ptr": "bf16", "q_ptr": "bf16", "weight_of_row_ptr": "fp32", "token_of_row_ptr": "i32",
                 "expert_offsets_ptr": "i32", "dw_ptr": "bf16", "grad_in_ptr": "bf16", "w_ptr": "i16",
                 "exp_avg_ptr": m_dtype, "exp_avg_sq_ptr": m_dtype, "scalars_ptr": "fp32", "flag_ptr": "fp32",
                 "partial_ptr": "fp32", "hyper_ptr": "fp64"} | NO_8BIT_POINTERS
                | ({"remainder_ptr": "i16"} if remainder else {"rng_ptr": "i64"}),
                _precision("bf16") | blocks
                | _bf16_adamw_constexprs(
                    p_from_tokens, q_from_tokens, arithmetic, REMAINDER=remainder, STOCHASTIC=not remainder
                ),
                options | {"enable_fp_fusion": False},
                unit_strides=("stride_pm", "stride_qn", "stride_n"),
                is_gemm=True,
                config=blocks,
                wgrad_table=f"{role} {'remainder' if remainder else 'stochastic'}"
                if (arithmetic, m_dtype) == ("fp64", "fp32")
                else "",
            )
        )  # fmt: skip
    return out


def _adamw_specs() -> list[Spec]:
    """The split path's standalone AdamW (ops.triton_backend.backward with a non-fused update): gradient in the weight dtype,
    moments in the weight dtype or fp32."""
    ac = adamw.ADAMW_CONFIG
    out = []
    pairs = (("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32"))
    for (w_dtype, m_dtype), arithmetic in itertools.product(pairs, ("fp64", "fp32")):
        out.append(
            Spec(
                adamw.adamw_kernel,
                f"w={w_dtype} m={m_dtype} {arithmetic}",
                {"w_ptr": w_dtype, "grad_ptr": w_dtype, "exp_avg_ptr": m_dtype, "exp_avg_sq_ptr": m_dtype,
                 "scalars_ptr": "fp32", "skip_ptr": "fp32", "hyper_ptr": "fp64", "remainder_ptr": "fp64",
                 "rng_ptr": "fp64"},
                {"BLOCK": ac["BLOCK"], "ARITHMETIC": arithmetic, "REMAINDER": False, "STOCHASTIC": False,
                 "INTERPRET": False},
                {"num_warps": ac["num_warps"], "enable_fp_fusion": False},
                config={"BLOCK": ac["BLOCK"]},
            )
        )  # fmt: skip
    # The split path with bf16 master weights: the weight's int16 bits, the remainder (or stochastic
    # rounding's key), fp32 moments; its own launch configuration.
    ac = adamw.ADAMW_MASTER_CONFIG
    for arithmetic, remainder, m_dtype in itertools.product(
        ("fp64", "fp32"), (True, False), ("fp32", "bf16")
    ):
        out.append(
            Spec(
                adamw.adamw_kernel,
                f"w=bf16 m={m_dtype} {arithmetic} {'remainder' if remainder else 'stochastic'}",
                {"w_ptr": "i16", "grad_ptr": "bf16", "exp_avg_ptr": m_dtype, "exp_avg_sq_ptr": m_dtype,
                 "scalars_ptr": "fp32", "skip_ptr": "fp32", "hyper_ptr": "fp64",
                 "remainder_ptr": "i16" if remainder else "fp64", "rng_ptr": "fp64" if remainder else "i64"},
                {"BLOCK": ac["BLOCK"], "ARITHMETIC": arithmetic, "REMAINDER": remainder, "STOCHASTIC": not remainder,
                 "INTERPRET": False},
                {"num_warps": ac["num_warps"], "enable_fp_fusion": False},
                config={"BLOCK": ac["BLOCK"]},
            )
        )  # fmt: skip
    # The split path with 8-bit moments (ops/triton_backend/moments_8bit.py, the launcher), with the binary-search and the
    # closed-form quantizer (the latter the tuner's candidate beside it).
    c8 = moments_8bit.ADAMW_8BIT_CONFIG
    for (w_dtype, master), closed in itertools.product(
        (("fp32", None), ("bf16", None), ("fp16", None), ("bf16", "remainder"), ("bf16", "stochastic")),
        (False, True),
    ):
        out.append(
            Spec(
                moments_8bit.adamw_8bit_kernel,
                f"w={w_dtype} 8-bit moments" + (f" {master}" if master else "") + (" closed-form" if closed else ""),
                {"w_ptr": "i16" if master else w_dtype, "grad_ptr": w_dtype, "exp_avg_codes_ptr": "i8",
                 "exp_avg_scales_ptr": "fp32", "exp_avg_sq_codes_ptr": "u8", "exp_avg_sq_scales_ptr": "fp32",
                 "magnitudes_ptr": "fp32", "levels_ptr": "fp32", "scalars_ptr": "fp32", "skip_ptr": "fp32",
                 "hyper_ptr": "fp64", "remainder_ptr": "i16" if master == "remainder" else "fp64",
                 "rng_ptr": "i64" if master == "stochastic" else "fp64"},
                {"BLOCK_R": c8["BLOCK_R"], "BLOCK_C": c8["BLOCK_C"], "REMAINDER": master == "remainder",
                 "STOCHASTIC": master == "stochastic", "INTERPRET": False, "CLOSED_FORM": closed},
                {"num_warps": c8["num_warps"], "enable_fp_fusion": False},
                config={"BLOCK_R": c8["BLOCK_R"], "BLOCK_C": c8["BLOCK_C"]},
            )
        )  # fmt: skip
    # The small steps around each update (ops/triton_backend/update_steps.py): before it the skip, the step and (but for
    # 8-bit moments and stochastic rounding) the scalars; after it the telemetry.
    begin = {"flags_ptr": "fp32", "step_ptr": "fp32", "hyper_ptr": "fp64", "powers_ptr": "fp32", "skip_ptr": "fp32",
             "scalars_ptr": "fp32"}  # fmt: skip
    for arithmetic, scalars in (("fp64", True), ("fp32", True), ("fp64", False)):
        out.append(
            Spec(
                update_steps.update_begin_kernel,
                f"{arithmetic}{'' if scalars else ' no scalars'}",
                begin,
                {"BLOCK": ops_update_steps.FLAGS_BLOCK, "SCALARS": scalars, "ARITHMETIC": arithmetic,
                 "INTERPRET": False},
                {"num_warps": 1, "enable_fp_fusion": False},
            )
        )  # fmt: skip
    out.append(
        Spec(
            update_steps.update_end_kernel,
            "norm, skips, clipped",
            {"skip_ptr": "fp32", "norm_ptr": "fp32", "skipped_ptr": "i64", "clipped_ptr": "i64",
             "clipped_in_ptr": "i64"},
            {"HAS_NORM": True, "HAS_SKIPPED": True, "HAS_CLIPPED": True, "HAS_CLIPPED_IN": True},
            {"num_warps": 1},
        )
    )  # fmt: skip
    # The overflow bound before each update's check pass (ops/triton_backend/update_bound.py): the layer's magnitudes pass
    # over X, dO and the routing weights (each activation dtype; the weights fp32 or the activation's), its
    # table of flags, and the flag of an update with the gradient of earlier micro-batches (every operand set).
    for act_dtype, w_dtype in (("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32")):
        out.append(
            Spec(
                update_bound.bound_magnitudes_kernel,
                f"x={act_dtype} w={w_dtype}",
                {"x_ptr": act_dtype, "grad_out_ptr": act_dtype, "weights_ptr": w_dtype, "absmax_ptr": "fp32",
                 "offsets_ptr": "i32", "out_ptr": "fp32"},
                {"BLOCK_T": ops_update_bound.BLOCK_T, "BLOCK_H": 256, "BLOCK_J": 8, "BLOCK_A": 64, "BLOCK_E": 64},
                {"num_warps": 4},
                unit_strides=("stride_xh", "stride_gh", "stride_wj"),
            )
        )  # fmt: skip
    out.append(
        Spec(
            update_bound.bound_table_kernel,
            "every tensor and limit",
            {"magnitudes_ptr": "fp32"},
            {"BLOCK_ROWS": 128},
            {"num_warps": 4, "enable_fp_fusion": False},
        )
    )
    for p_from_tokens, q_column, grad_in in ((True, 0, False), (False, 4, False), (False, -1, True)):
        out.append(
            Spec(
                update_bound.bound_flag_kernel,
                f"{'w * dO' if p_from_tokens else 'dHpre'} q={q_column}{' grad_in' if grad_in else ''}",
                {"magnitudes_ptr": "fp32", "grad_in_max_ptr": "fp32", "flag_ptr": "fp32"},
                {"P_FROM_TOKENS": p_from_tokens, "Q_COLUMN": q_column, "HAS_GRAD_IN": grad_in, "BLOCK_ROWS": 128},
                {"num_warps": 4, "enable_fp_fusion": False},
            )
        )  # fmt: skip
    return out


def _ptxas_stats(ptx: str, arch: str, log: str = "") -> dict:
    """Registers and spills from ptxas -v: ``log`` when the compile above printed one (a fresh build),
    else from running ptxas on ``ptx`` here (a build served from Triton's cache)."""
    if "Used" not in log:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.ptx"
            path.write_text(ptx)
            res = subprocess.run(
                [str(PTXAS), "-v", f"--gpu-name={arch}", str(path), "-o", str(Path(tmp) / "k.cubin")],
                capture_output=True,
                text=True,
                check=True,
            )
        log = res.stdout + res.stderr

    def grab(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {
        "registers": grab(r"Used (\d+) registers"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
    }


# What one sm_90 SM (H100, H200) holds at once: 65,536 registers, allocated per warp in units of 256 (a
# thread's count rounded up to a multiple of 8); 228 KB of shared memory, 1 KB of it reserved per block;
# 2,048 threads; 32 blocks.
SM90_REGISTERS, SM90_SHARED, SM90_BLOCK_RESERVED, SM90_THREADS, SM90_BLOCKS = (
    65536,
    228 * 1024,
    1024,
    2048,
    32,
)


def ctas_per_sm(registers: int, shared_bytes: int, num_warps: int) -> int:
    """Blocks (CTAs) of a kernel resident on one sm_90 SM at once: the fewest that its registers, shared
    memory, threads and the block limit allow."""
    threads = 32 * num_warps
    by_registers = SM90_REGISTERS // (-(-registers // 8) * 8 * threads)
    by_shared = SM90_SHARED // (shared_bytes + SM90_BLOCK_RESERVED)
    return min(by_registers, by_shared, SM90_THREADS // threads, SM90_BLOCKS)


def operand_buffers(ttgir: str) -> list[int]:
    """The shared-memory buffers of each floating-point GEMM operand the pipeliner allocates (the leading
    dimension of each ``ttg.local_alloc`` of 3 or more dimensions without an initial value; a TMA copy's
    buffer keeps its descriptor's block shape, [stages, 1, 2, BLOCK_N, BLOCK_K] for the up-projection's W1),
    in allocation order."""
    pattern = r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)(?:x\d+){2,}x(?:bf16|f16|f32|tf32|f8)"
    return [int(n) for n in re.findall(pattern, ttgir)]


def loop_wait_groups(ptx: str) -> list[int]:
    """The ``cp.async.wait_group N`` values inside the GEMM's main loop in the PTX, sorted, without repeats.

    The main loop is each innermost loop that issues a tensor-core MMA (``wgmma.mma_async`` or
    ``mma.sync``): the lines from a label to a branch back to it. The loop waits there until at most N
    groups of its copies are in flight: with N = 0 every copy issued so far must land, the operands of the
    next iteration were issued one iteration ahead, and each iteration waits on memory latency; with N > 0
    the copies of N more iterations stay in flight. Empty: no such loop, or one without cp.async (plain
    loads, or TMA)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(\$L__\w+):", line))}
    mma = [i for i, line in enumerate(lines) if "wgmma.mma_async" in line or "mma.sync" in line]
    loops = []  # (label line, backward branch line) of each loop holding an MMA
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        start = labels.get(m.group(1), i) if m else i
        if start < i and any(start < j < i for j in mma):
            loops.append((start, i))
    innermost = [(a, b) for a, b in loops if not any(a <= c < d <= b and (c, d) != (a, b) for c, d in loops)]
    waits = {
        int(n)
        for a, b in innermost
        for line in lines[a:b]
        for n in re.findall(r"cp\.async\.wait_group\s+(\d+);", line)
    }
    return sorted(waits)


def epilogue_sass(cubin: bytes) -> list[str] | None:
    """The SASS instructions after the GEMM's main loop, in program order, each once however often it runs
    (the epilogue's column slices are unrolled).

    ``cuobjdump --dump-sass`` (from the triton wheel) disassembles the cubin. The main loop ends at the
    last innermost backward branch (a ``BRA`` to a lower address, before the last ``EXIT``) whose range
    holds an ``HGMMA`` (sm_90a's wgmma);
    kept: every instruction after it to the end of the kernel, the slow-path subroutines it calls (IEEE
    division and square root) included, the padding after the kernel (``NOP``s, the closing branch to
    itself) not. None: no loop with an HGMMA."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run(
            [str(CUOBJDUMP), "--dump-sass", str(path)], capture_output=True, text=True, check=True
        ).stdout
    # (address, instruction) pairs, e.g. (0x1760, "@!P4 BRA 0x1000").
    code = [(int(a, 16), t.strip()) for a, t in re.findall(r"^\s*/\*([0-9a-f]+)\*/\s+([^;]*);", sass, re.M)]
    hgmma = [address for address, text in code if "HGMMA" in text]
    # Branches after the kernel's last EXIT are out-of-line stubs (a TMA loop's mbarrier retry, which
    # jumps back into the loop), not loops; of the loops holding an HGMMA the innermost (a persistent
    # kernel's tile loop holds its K loop and its epilogue).
    last_exit = max((address for address, text in code if re.search(r"\bEXIT\b", text)), default=None)
    loops = []
    for address, text in code:
        m = re.search(r"\bBRA\b.*\b0x([0-9a-f]+)$", text)
        if m and (last_exit is None or address < last_exit):
            start = int(m.group(1), 16)
            if any(start <= a < address for a in hgmma):
                loops.append((start, address))
    innermost = [
        (a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)
    ]
    if not innermost:
        return None
    loop_end = max(b for _, b in innermost)
    padding = ("NOP",)
    return [t for a, t in code if a > loop_end and t not in padding and t != f"BRA 0x{a:x}"]


def loads_before_first_store(epilogue: list[str]) -> int:
    """The 128-bit global loads (``LDG.E.128``: the tiles of W, exp_avg, exp_avg_sq, the accumulated
    gradient) the epilogue issues before its first 128-bit global store: one slice's loads (3) when each
    slice waits for the previous slice's stores, two slices' (6) when the next slice is prefetched."""
    count = 0
    for text in epilogue:
        if "STG.E.128" in text:
            break
        count += "LDG.E.128" in text
    return count


def read_sm90_code(compiled, registers: int, num_warps: int, tile_elements: int) -> dict:
    """What an sm_90a build of a GEMM says about its speed beyond registers: CTAs per SM
    (:func:`ctas_per_sm`), its main loop's pipeline (:func:`operand_buffers`, :func:`loop_wait_groups`)
    and its epilogue's SASS instructions (:func:`epilogue_sass`), in all and per output element a
    thread owns (``tile_elements`` / (32 * num_warps))."""
    sass = epilogue_sass(compiled.asm["cubin"])
    epilogue = None if sass is None else len(sass)
    per_thread = tile_elements / (32 * num_warps)
    return {
        "ctas_per_sm": ctas_per_sm(registers, compiled.metadata.shared, num_warps),
        "operand_buffers": operand_buffers(compiled.asm["ttgir"]),
        "loop_wait_groups": loop_wait_groups(compiled.asm["ptx"]),
        "epilogue_instructions": epilogue,
        "epilogue_per_element": None if epilogue is None else epilogue / per_thread,
        "epilogue_loads_ahead": None if sass is None else loads_before_first_store(sass),
        # TMA loads in the PTX (cp.async.bulk.tensor: the grouped GEMM's descriptor candidates), 0 elsewhere.
        "tma_loads": compiled.asm["ptx"].count("cp.async.bulk.tensor"),
    }


def _build(task: tuple[int, bool, str]) -> dict:
    """Compile specs()[index] for one specialisation and target; one row of the report."""
    index, aligned, arch = task
    spec = specs()[index]
    # Triton runs ptxas -v for the cubin; with dump_ptxas_log it prints that log, which is read here
    # instead of running ptxas a second time.
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        compiled = triton.compile(_source(spec, aligned), target=TARGETS[arch], options=spec.options)
    ptx = compiled.asm["ptx"]
    row = {
        "kernel": spec.kernel.fn.__name__,
        "variant": spec.variant,
        "config": spec.config | spec.options,
        "specialisation": "aligned" if aligned else "unaligned",
        "target": arch,
        "cubin_bytes": len(compiled.asm["cubin"]),
        "shared_bytes": compiled.metadata.shared,
        "is_gemm": spec.is_gemm,
        "input_precision": spec.constexprs.get("INPUT_PRECISION"),
        "wgmma": "wgmma.mma_async" in ptx,
        "mma_sync": "mma.sync" in ptx,
        # Kernel parameters passed as doubles (none: the AdamW hyperparameters are read from memory).
        "f64_params": len(re.findall(r"\.param \.f64\b", ptx)),
        **_ptxas_stats(ptx, arch, log.getvalue()),
    }
    if (spec.wgrad_table or spec.gemm_table) and arch == "sm_90a":
        # The output elements of a program: its BLOCK_M x BLOCK_N tile (the up-projection and dHpre: of
        # (gate, up) column pairs, each pair two Hpre or dHpre elements and one of A).
        tile = spec.constexprs["BLOCK_M"] * spec.constexprs["BLOCK_N"]
        row["wgrad_table" if spec.wgrad_table else "gemm_table"] = spec.wgrad_table or spec.gemm_table
        row |= read_sm90_code(compiled, row["registers"], spec.options["num_warps"], tile)
    return row


def compile_all(
    jobs: int = 1,
    kernels: tuple[str, ...] = (),
    unaligned_targets: tuple[str, ...] = tuple(TARGETS),
    targets: tuple[str, ...] = tuple(TARGETS),
    wgrad_kinds: tuple[str, ...] | None = None,
    gemm_kinds: tuple[str, ...] | None = None,
) -> list[dict]:
    """Rows for every spec x {aligned, unaligned} x TARGETS, in that order; ``jobs`` compiler processes;
    ``kernels``: only the kernels whose name contains one of these strings (all when empty);
    ``targets``: the targets the shipped configurations are built for (a tuning candidate is built for
    its own architecture); ``unaligned_targets``: those of them the unaligned specialisation is built for;
    ``wgrad_kinds``: only the rows of the wgrad variants' table of these kinds (WGRAD_TABLE_KINDS), aligned,
    for sm_90a; ``gemm_kinds``: likewise for the forward and dgrad variants' table (GEMM_TABLE_KINDS); with
    both, the rows of either."""
    every = specs()
    chosen = [
        i for i, spec in enumerate(every) if not kernels or any(k in spec.kernel.fn.__name__ for k in kernels)
    ]
    if wgrad_kinds is not None or gemm_kinds is not None:
        # wgrad_table is "<role> <kind>", gemm_table the kind; "" outside the tables.
        tasks = [
            (i, True, "sm_90a")
            for i in chosen
            if (every[i].wgrad_table and every[i].wgrad_table.rpartition(" ")[2] in (wgrad_kinds or ()))
            or (every[i].gemm_table and every[i].gemm_table in (gemm_kinds or ()))
        ]
    else:
        tasks = [
            (i, aligned, arch)
            for i in chosen
            for aligned in (True, False)
            for arch in every[i].targets
            if (every[i].aligned_only or arch in targets)
            and (aligned or arch in unaligned_targets)
            and not (every[i].aligned_only and not aligned)
        ]
    if jobs <= 1:
        return [_build(task) for task in tasks]
    # spawn: a fresh interpreter per worker, nothing inherited from this process's threads.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_build, tasks, chunksize=1))


def _print_wgrad_table(rows: list[dict]) -> None:
    """The section "wgrad variants on sm_90a": one line per configuration, role and kind (the default
    configuration first, then the sm_90 candidates in ops/triton_backend/configs.py's order)."""
    from sonar_kernels.ops.triton_backend import configs

    order = [
        c.blocks() | c.launch() | c.epilogue()
        for c in (*configs.CANDIDATES["wgrad"][("16bit", 9)], *configs.OWN_CANDIDATES[9])
    ]

    def key(r):
        cfg = {k: r["config"][k] for k in order[0]}
        role, kind = r["wgrad_table"].split()
        return (order.index(cfg) if cfg in order else len(order), role, WGRAD_TABLE_KINDS.index(kind))

    print(
        "\n## wgrad variants on sm_90a (expert_mlp_bwd_dw_kernel; bf16 activations, weights and moments)\n"
        "CTAs/SM: blocks one SM holds (65,536 registers, a thread's count rounded up to 8; 228 KB of shared "
        "memory, 1 KB more a block; 2,048 threads; 32 blocks).\n"
        "buffers: shared-memory buffers of each operand. wait: cp.async.wait_group N in the main loop's PTX "
        "(0: the loop prefetches one iteration ahead).\n"
        "epilogue: SASS instructions after the main loop (after the last backward branch of the loop that "
        "holds the HGMMA), in all and per output element of a thread. ahead: 128-bit global loads the epilogue "
        "issues before its first 128-bit store (3: one slice's W, exp_avg, exp_avg_sq; 6: the next slice's "
        "too, the prefetched epilogue)."
    )
    header = (
        f"{'BMxBNxBK warps stages split':28} {'role':4} {'kind':10} {'regs':>4} {'spill':>5} {'smem KB':>7} "
        f"{'CTAs/SM':>7} {'buffers':>7} {'wait':>4} {'epilogue':>8} {'/elem':>5} {'ahead':>5}"
    )
    print(header)
    print("-" * len(header))
    for r in sorted(rows, key=key):
        c = r["config"]
        cfg = f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']} split{c['EPILOGUE_SPLIT']}"
        cfg += " pf" if c.get("EPILOGUE_PREFETCH") else ""
        role, kind = r["wgrad_table"].split()
        buffers = ",".join(map(str, r["operand_buffers"])) or "-"
        waits = ",".join(map(str, r["loop_wait_groups"])) or "-"
        epilogue, per = r["epilogue_instructions"], r["epilogue_per_element"]
        print(
            f"{cfg:28} {role:4} {kind:10} {r['registers']:4d} {r['spill_stores'] + r['spill_loads']:5d} "
            f"{r['shared_bytes'] / 1024:7.1f} {r['ctas_per_sm']:7d} {buffers:>7} {waits:>4} "
            + (
                "       -     -     -"
                if epilogue is None
                else f"{epilogue:8d} {per:5.1f} {r['epilogue_loads_ahead']:5d}"
            )
        )


def _print_gemm_table(rows: list[dict]) -> None:
    """The section "forward and dgrad variants on sm_90a": one line per kernel kind and configuration (the
    default configuration first, then the family's sm_90 candidates in ops/triton_backend/configs.py's order)."""
    from sonar_kernels.ops.triton_backend import configs

    family = {"up": "up", "down": "grouped_mm", "dX": "grouped_mm", "dHpre": "dhpre", "dHpre-plain": "dhpre"}

    def fields(r):
        return configs.Config._field_defaults | r["config"]

    def key(r):
        kind = r["gemm_table"]
        order = [c._asdict() for c in configs.CANDIDATES[family[kind]][("16bit", 9)]]
        cfg = {f: fields(r)[f] for f in configs.Config._fields}
        return (GEMM_TABLE_KINDS.index(kind), order.index(cfg) if cfg in order else len(order))

    print(
        "\n## forward and dgrad variants on sm_90a (bf16 activations and weights, SwiGLU, concatenated layout)\n"
        "up: expert_mlp_fwd_up_kernel; down, dX: expert_mlp_grouped_mm_kernel (HALVES 1, 2); dHpre: "
        "expert_mlp_bwd_dhpre_kernel with A, the routing-weight partial sums and the magnitudes (dHpre-plain: "
        "without the magnitudes); tma: expert_mlp_grouped_mm_tma_kernel (both operands through TMA descriptors; "
        "wait TMA: its loop waits on mbarriers, no cp.async groups).\n"
        "CTAs/SM, buffers, wait: as in the wgrad table. epilogue: SASS instructions after the main loop, in all "
        "and per element of a thread's share of the BLOCK_M x BLOCK_N tile (up and dHpre: per (gate, up) "
        "column pair)."
    )
    header = (
        f"{'kind':11} {'BMxBNxBK warps stages split':31} {'regs':>4} {'spill':>5} {'smem KB':>7} {'CTAs/SM':>7} "
        f"{'buffers':>7} {'wait':>5} {'epilogue':>8} {'/elem':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in sorted(rows, key=key):
        c = fields(r)
        cfg = f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}"
        cfg += f" split{r['config']['EPILOGUE_SPLIT']}" if "EPILOGUE_SPLIT" in r["config"] else ""
        cfg += (" tma persistent" if c["PERSISTENT"] else " tma") if c["TMA"] else ""
        buffers = ",".join(map(str, r["operand_buffers"])) or "-"
        waits = ",".join(map(str, r["loop_wait_groups"])) or ("TMA" if r.get("tma_loads") else "-")
        epilogue, per = r["epilogue_instructions"], r["epilogue_per_element"]
        print(
            f"{r['gemm_table']:11} {cfg:31} {r['registers']:4d} {r['spill_stores'] + r['spill_loads']:5d} "
            f"{r['shared_bytes'] / 1024:7.1f} {r['ctas_per_sm']:7d} {buffers:>7} {waits:>5} "
            + ("       -      -" if epilogue is None else f"{epilogue:8d} {per:6.1f}")
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=(),
        help="only kernels whose name contains one of these (default: all)",
    )
    parser.add_argument(
        "--targets",
        nargs="+",
        choices=tuple(TARGETS),
        default=tuple(TARGETS),
        help="targets to build the shipped configurations for (default: all; the test suite builds sm_90a "
        "only, to save time; each tuning candidate is built for its own architecture)",
    )
    parser.add_argument(
        "--unaligned-targets",
        nargs="*",
        choices=tuple(TARGETS),
        default=tuple(TARGETS),
        help="targets to build the unaligned specialisation for (default: all; the test suite builds it "
        "for none, to save time)",
    )
    parser.add_argument(
        "--candidate-dtypes",
        nargs="*",
        choices=CANDIDATE_DTYPES,
        default=CANDIDATE_DTYPES,
        help="the (activation/weight) dtype pairs the tuning candidates are built for (default: every 16-bit "
        "pair; none: no candidates; the test suite builds bf16/fp32 only, to save time)",
    )
    parser.add_argument(
        "--wgrad-variants",
        nargs="*",
        choices=WGRAD_TABLE_KINDS,
        help="build only the rows of the table of wgrad variants on sm_90a, of these kinds (none named: "
        "all); its candidates' rows need bf16/bf16 among --candidate-dtypes",
    )
    parser.add_argument(
        "--gemm-variants",
        nargs="*",
        choices=GEMM_TABLE_KINDS,
        help="build only the rows of the table of forward and dgrad variants on sm_90a, of these kinds (none "
        "named: all; with --wgrad-variants, the rows of both); its candidates' rows need bf16/bf16 among "
        "--candidate-dtypes",
    )
    args = parser.parse_args(argv)
    os.environ[CANDIDATE_DTYPES_ENV] = ",".join(args.candidate_dtypes)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled for a GPU", file=sys.stderr)
        return 2
    wgrad_kinds = None if args.wgrad_variants is None else tuple(args.wgrad_variants or WGRAD_TABLE_KINDS)
    gemm_kinds = None if args.gemm_variants is None else tuple(args.gemm_variants or GEMM_TABLE_KINDS)
    rows = compile_all(
        args.jobs, tuple(args.kernels), tuple(args.unaligned_targets), tuple(args.targets), wgrad_kinds,
        gemm_kinds,
    )  # fmt: skip
    header = f"{'kernel':34} {'variant':30} {'spec':9} {'target':6} {'regs':>4} {'spill st/ld':>11} {'smem':>6} mma"
    print(header)
    print("-" * len(header))
    for r in rows:
        mma = "wgmma" if r["wgmma"] else ("mma.sync" if r["mma_sync"] else "-")
        cfg = ",".join(f"{k}={v}" for k, v in r["config"].items())
        print(
            f"{r['kernel']:34} {r['variant']:30} {r['specialisation']:9} {r['target']:6} {r['registers']:4d} "
            f"{r['spill_stores']:5d}/{r['spill_loads']:<5d} {r['shared_bytes']:6d} {mma}  {cfg}"
        )
    aligned_spills = [
        r for r in rows if r["specialisation"] == "aligned" and (r["spill_stores"] or r["spill_loads"])
    ]
    print(f"\n{len(rows)} builds; aligned builds with spills: {len(aligned_spills)}")
    table = [r for r in rows if "wgrad_table" in r]
    if table:
        _print_wgrad_table(table)
    gemm_table = [r for r in rows if "gemm_table" in r]
    if gemm_table:
        _print_gemm_table(gemm_table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
