"""Compile every Triton kernel, at every configuration its launcher can choose, for NVIDIA GPUs.

Runs on a machine without a GPU: ``triton.compile`` on an ``ASTSource`` with a ``GPUTarget`` goes down to
cubin (Hopper sm_90a and Ampere sm_80), and ``ptxas -v`` from the triton wheel reports registers, spills
and shared memory. The interpreter accepts code that the compiler rejects, so this is what proves the
kernels are GPU code.

Each kernel is compiled in two specialisations, as Triton's JIT would compile it:
- ``aligned``: pointers 16-byte aligned, sizes and strides multiples of 16, unit innermost strides: the
  real model shapes (OLMoE-1B-7B, Granite-3.1-3B-A800M). These must not spill.
- ``unaligned``: no divisibility known (H or I not a multiple of 16): correct but slow code whose spills
  are reported, not gated.

Usage: ``python tools/kernel_report.py`` prints a table; ``--json PATH`` also writes the rows.
Must run without TRITON_INTERPRET (kernels decorated under the interpreter cannot be compiled).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sonar_kernels import ops
from sonar_kernels.kernels import expert_mlp_fwd, routing

TARGETS = {"sm_90a": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
TL_TYPES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


@dataclass
class Spec:
    """One kernel at one configuration: pointer dtypes, constexprs, launch options."""

    kernel: object
    variant: str
    pointers: dict[str, str]  # pointer arg -> Triton element type ("bf16", "i32", ...)
    constexprs: dict[str, object]
    options: dict[str, int]
    unit_strides: tuple[str, ...] = ()  # innermost strides; the JIT turns a stride of 1 into a constexpr
    is_gemm: bool = False
    config: dict = field(default_factory=dict)


def _source(spec: Spec, aligned: bool) -> ASTSource:
    fn = spec.kernel
    constexprs = dict(spec.constexprs)
    constexprs.update({name: 1 for name in spec.unit_strides})
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = f"*{spec.pointers[name]}" if name in spec.pointers else "i32"
        if name in spec.pointers or aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, signature, constexprs, attrs)


def specs() -> list[Spec]:
    """Every kernel at every configuration ops.py can choose, for each dtype combination it launches."""
    out = []
    # Routing metadata: BLOCK_E/BLOCK_S depend on E only; one spec per distinct choice.
    seen = set()
    for E in range(1, ops.MAX_EXPERTS + 1):
        cfg = ops.routing_block_config(E)
        key = (cfg["BLOCK_E"], cfg["BLOCK_S"])
        if key in seen:
            continue
        seen.add(key)
        for index in ("i64", "i32") if cfg["BLOCK_E"] == 64 else ("i64",):
            out.append(
                Spec(
                    routing._routing_metadata_kernel,
                    f"index={index}",
                    {"top_k_index_ptr": index} | dict.fromkeys(
                        ("expert_offsets_ptr", "tile_offsets_ptr", "row_of_slot_ptr", "token_of_row_ptr", "slot_of_row_ptr"), "i32"),
                    {"TILE_M": expert_mlp_fwd.TILE_M, "BLOCK_S": cfg["BLOCK_S"], "BLOCK_E": cfg["BLOCK_E"]},
                    {"num_warps": cfg["num_warps"]},
                    unit_strides=("stride_index_j",),
                    config={"BLOCK_E": cfg["BLOCK_E"], "BLOCK_S": cfg["BLOCK_S"]},
                )
            )  # fmt: skip
    # Grouped GEMMs: (activation dtype, weight dtype) pairs the launcher accepts.
    pairs = (("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32"), ("fp16", "fp32"))
    for act_dtype, w_dtype in pairs:
        cfg = expert_mlp_fwd.FWD_GEMM_CONFIG
        blocks = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
        options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
        common = {"INPUT_PRECISION": "ieee" if act_dtype == "fp32" else "tf32", "INTERPRET": False} | blocks
        for activation in ("silu", "gelu") if (act_dtype, w_dtype) == ("bf16", "bf16") else ("silu",):
            out.append(
                Spec(
                    expert_mlp_fwd._expert_mlp_fwd_up_kernel,
                    f"x={act_dtype} w={w_dtype} {activation}",
                    {"x_ptr": act_dtype, "w1_ptr": w_dtype, "token_of_row_ptr": "i32", "expert_offsets_ptr": "i32",
                     "tile_offsets_ptr": "i32", "hpre_ptr": act_dtype, "a_ptr": act_dtype},
                    common | {"ACTIVATION": activation},
                    options,
                    unit_strides=("stride_xh", "stride_wh", "stride_hn", "stride_an"),
                    is_gemm=True,
                    config=blocks,
                )
            )  # fmt: skip
        out.append(
            Spec(
                expert_mlp_fwd._expert_mlp_grouped_mm_kernel,
                f"x={act_dtype} w={w_dtype}",
                {"a_ptr": act_dtype, "w2_ptr": w_dtype, "expert_offsets_ptr": "i32", "tile_offsets_ptr": "i32",
                 "y_ptr": act_dtype},
                common,
                options,
                unit_strides=("stride_ai", "stride_wi", "stride_yh"),
                is_gemm=True,
                config=blocks,
            )
        )  # fmt: skip
    cc = expert_mlp_fwd.COMBINE_CONFIG
    # Routing weights may come in any supported dtype, independent of the activations.
    for act_dtype in ("fp32", "bf16", "fp16"):
        for w_dtype in ("fp32", "bf16", "fp16"):
            out.append(
                Spec(
                    expert_mlp_fwd._expert_mlp_combine_kernel,
                    f"y={act_dtype} w={w_dtype}",
                    {
                        "y_ptr": act_dtype,
                        "row_of_slot_ptr": "i32",
                        "weights_ptr": w_dtype,
                        "out_ptr": act_dtype,
                    },
                    {"BLOCK_M": cc["BLOCK_M"], "BLOCK_N": cc["BLOCK_N"], "INTERPRET": False},
                    {"num_warps": cc["num_warps"]},
                    unit_strides=("stride_yh", "stride_wj", "stride_oh"),
                    config={"BLOCK_M": cc["BLOCK_M"], "BLOCK_N": cc["BLOCK_N"]},
                )
            )
    return out


def _ptxas_stats(ptx: str, arch: str) -> dict:
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


def compile_all() -> list[dict]:
    rows = []
    for spec in specs():
        for aligned in (True, False):
            for arch, target in TARGETS.items():
                compiled = triton.compile(_source(spec, aligned), target=target, options=spec.options)
                ptx = compiled.asm["ptx"]
                rows.append(
                    {
                        "kernel": spec.kernel.fn.__name__,
                        "variant": spec.variant,
                        "config": spec.config | spec.options,
                        "specialisation": "aligned" if aligned else "unaligned",
                        "target": arch,
                        "cubin_bytes": len(compiled.asm["cubin"]),
                        "shared_bytes": compiled.metadata.shared,
                        "is_gemm": spec.is_gemm,
                        "wgmma": "wgmma.mma_async" in ptx,
                        "mma_sync": "mma.sync" in ptx,
                        **_ptxas_stats(ptx, arch),
                    }
                )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled for a GPU", file=sys.stderr)
        return 2
    rows = compile_all()
    header = f"{'kernel':34} {'variant':22} {'spec':9} {'target':6} {'regs':>4} {'spill st/ld':>11} {'smem':>6} mma"
    print(header)
    print("-" * len(header))
    for r in rows:
        mma = "wgmma" if r["wgmma"] else ("mma.sync" if r["mma_sync"] else "-")
        cfg = ",".join(f"{k}={v}" for k, v in r["config"].items() if k.startswith("BLOCK"))
        print(
            f"{r['kernel']:34} {r['variant']:22} {r['specialisation']:9} {r['target']:6} {r['registers']:4d} "
            f"{r['spill_stores']:5d}/{r['spill_loads']:<5d} {r['shared_bytes']:6d} {mma}  {cfg}"
        )
    aligned_spills = [
        r for r in rows if r["specialisation"] == "aligned" and (r["spill_stores"] or r["spill_loads"])
    ]
    print(f"\n{len(rows)} builds; aligned builds with spills: {len(aligned_spills)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
