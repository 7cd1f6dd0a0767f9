"""The GPU benchmark in one run: correctness at the real shapes first, then one expert-MLP layer's
training step by every provider, against the dense roofline (torch.mm on the layer's GEMM shapes) and
the copy bandwidth measured in the same run.

Usage (one CUDA machine, no network; the package on PYTHONPATH or installed with
``pip install --no-deps --no-build-isolation -e .``):

    python bench/gpu_bench.py            # OLMoE-1B-7B and Granite-3.1-3B-A800M layers, bf16
    python bench/gpu_bench.py --small    # tiny shapes; on CPU the Triton interpreter (the tests run it)

Writes ``bench/results/<date>-<device>.json`` and a markdown table next to it (``--out`` changes the
JSON path). Fixed kernel configurations, no autotuning. Exit code 1 when a correctness check fails.
Not in it yet: the full training step at model dimensions (sonar-train on the real presets).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before sonar_kernels is imported

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_backward
import providers

ROOT = Path(__file__).resolve().parents[1]


def _median_seconds(fn, device: str, rounds: int) -> float:
    """Median wall time of ``fn`` in seconds: triton.testing.do_bench on CUDA (after its warm-up),
    ``rounds`` timed calls on the CPU."""
    if device == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1000
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_shapes(shape: providers.Shape) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of the layer's GEMMs over its S = T * top_k routed rows (DESIGN.md's backward):
    forward up and down projections, then G = dO W2, dX rows, dW2 and dW1."""
    S = shape.T * shape.top_k
    H, I = shape.H, shape.I
    return {
        "up": (S, H, 2 * I),
        "down": (S, I, H),
        "dgrad G": (S, H, I),
        "dgrad dX": (S, 2 * I, H),
        "wgrad dW2": (H, S, I),
        "wgrad dW1": (2 * I, S, H),
    }


def roofline(shape: providers.Shape, dtype: torch.dtype, device: str, rounds: int) -> dict:
    """torch.mm on each GEMM shape of the layer: seconds and TFLOP/s, and their total."""
    out = {}
    for name, (M, K, N) in gemm_shapes(shape).items():
        a = torch.randn(M, K, device=device, dtype=dtype)
        b = torch.randn(K, N, device=device, dtype=dtype)
        seconds = _median_seconds(lambda a=a, b=b: torch.mm(a, b), device, rounds)
        out[name] = {"seconds": seconds, "tflops": 2 * M * K * N / seconds / 1e12}
    out["total_seconds"] = sum(v["seconds"] for v in out.values())
    return out


def bandwidth(device: str, nbytes: int, rounds: int) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), device, rounds)
    return 2 * nbytes / seconds / 1e9


def layer_table(shape_name: str, dtype: torch.dtype, device: str, rounds: int) -> dict:
    shape = providers.SHAPES[shape_name]
    rows = {}
    for routing in ("uniform", "skewed"):
        inputs = providers.make_inputs(shape, dtype, device, routing=routing)
        for name in providers.PROVIDERS:
            step = providers.build(name, inputs, backend="triton")
            step.run()  # compile, create the optimizer state
            seconds = _median_seconds(step.run, device, rounds)
            rows[f"{name} {routing}"] = {
                "provider": name,
                "routing": routing,
                "seconds": seconds,
                "tflops": shape.flops() / seconds / 1e12,
                "peak_bytes": providers.peak_bytes(step),
                "experts": step.experts,
            }
            del step
        for row in (r for r in rows.values() if r["routing"] == routing):
            base = rows[f"standard {routing}"]
            row["speedup_vs_standard"] = base["seconds"] / row["seconds"]
            row["memory_vs_standard"] = row["peak_bytes"] / base["peak_bytes"]
    return {"shape": shape_name, "T_H_I_E_top_k": tuple(shape), "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"# {result['device']}, {result['date']} (torch {result['torch']}, triton {result['triton']}, "
             f"commit {result['commit'][:9]})", ""]  # fmt: skip
    lines.append(f"Copy bandwidth: {result['bandwidth_gbs']:.0f} GB/s.")
    for check in result["correctness"]:
        lines.append(
            f"- {check['shape']} {check['weight_dtype']}: fused == split bitwise: {check['fused_equals_split_bitwise']}"
        )
    for table in result["layers"]:
        roof = table["roofline"]
        lines += ["", f"## {table['shape']} {table['T_H_I_E_top_k']}", "",
                  f"torch.mm on the layer's GEMM shapes: {1000 * roof['total_seconds']:.3f} ms in all.", "",
                  "| provider | routing | ms | TFLOP/s | vs standard | peak MiB | memory vs standard | roofline / time |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in table["rows"].values():
            lines.append(
                f"| {row['provider']} | {row['routing']} | {1000 * row['seconds']:.3f} | {row['tflops']:.3f} | "
                f"{row['speedup_vs_standard']:.2f}x | {row['peak_bytes'] / 2**20:.1f} | "
                f"{row['memory_vs_standard']:.2f}x | {roof['total_seconds'] / row['seconds']:.2f} |"
            )
        lines += ["", f"standard's experts: {table['rows']['standard uniform']['experts']}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU interpreter, tests)")
    parser.add_argument("--out", type=Path, help="JSON output path (the markdown table goes next to it)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = args.small or device == "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rounds = 3 if device == "cpu" else 0
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    started = time.perf_counter()
    correctness = [
        check_backward.check("small" if small else "olmoe-1b-7b", weight_dtype, device)
        for weight_dtype in (torch.bfloat16, torch.float32)
    ]
    shapes = ("cpu-tiny",) if small else ("olmoe-1b-7b", "granite-3.1-3b-a800m")
    layers = []
    for name in shapes:
        table = layer_table(name, dtype, device, rounds)
        table["roofline"] = roofline(providers.SHAPES[name], dtype, device, rounds)
        layers.append(table)
    result = {
        "date": datetime.date.today().isoformat(),
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": check_backward._commit(),
        "dtype": str(dtype),
        "correctness": correctness,
        "bandwidth_gbs": bandwidth(device, 2**20 if small else 2**30, rounds),
        "layers": layers,
    }
    result["seconds"] = time.perf_counter() - started
    slug = device_name.split()[-1].lower() if device == "cuda" else "cpu"
    out = args.out or ROOT / "bench" / "results" / f"{result['date']}-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')} in {result['seconds']:.0f} s")
    return 0 if all(c["fused_equals_split_bitwise"] for c in correctness) else 1


if __name__ == "__main__":
    sys.exit(main())
