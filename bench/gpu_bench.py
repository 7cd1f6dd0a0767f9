"""The GPU benchmark in one run: correctness at the real shapes first; then one expert-MLP layer by every
provider (forward, forward+backward, training step), each sonar kernel's own time and TFLOP/s against
torch.mm on the same GEMM shape (the dense roofline) and the copy bandwidth, all measured in the same run;
then full training steps of OLMoE-1B-7B and Granite-3.1-3B-A800M with a few layers: standard, sonar and
all-in-backward (every parameter updated in the backward, no clipping).

Usage (one CUDA machine, no network; the package on PYTHONPATH or installed with
``pip install --no-deps --no-build-isolation -e .``):

    python bench/gpu_bench.py            # OLMoE-1B-7B and Granite-3.1-3B-A800M layers, bf16
    python bench/gpu_bench.py --small    # tiny shapes; on CPU the Triton interpreter (the tests run it)
    python bench/gpu_bench.py --no-check # without the correctness checks (check_backward.py runs them alone)

Writes ``bench/results/<date>-<gpu>.json`` and a markdown table next to it (on a CPU,
``runs/bench/gpu_bench-cpu.json``; ``--out`` changes the JSON path). On CUDA the kernels' tile
configurations are tuned at the first launch of each layer shape (sonar_kernels/ops/configs.py; the
correctness checks at the real shapes run first, so the timed runs use the tuned choices), and the results
file records every choice ("configs"); ``SONAR_KERNELS_TUNING=0`` pins the defaults. Exit code 1 when a correctness check fails. The full training steps need transformers
(>= 5.13); where it is missing they are skipped and the results say so (bench/README.md: bringing it to
a machine without network as wheels).
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
import kernel_times
import providers

from sonar_kernels.ops import configs

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
    """(M, K, N) of the layer's GEMMs over its S = T * top_k routed rows (docs/design.md's backward):
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
    """Every provider's phases (providers.PHASES) at one layer shape, both routings; then the roofline
    and the sonar kernels one by one (the fused and the unfused step, uniform routing)."""
    shape = providers.SHAPES[shape_name]
    roof = roofline(shape, dtype, device, rounds)
    rows, kernels = {}, {}
    for routing in ("uniform", "skewed"):
        inputs = providers.make_inputs(shape, dtype, device, routing=routing)
        for name in providers.PROVIDERS:
            step = providers.build(name, inputs, backend="triton")
            step.run()  # compile, create the optimizer state
            for phase in (p for p in providers.PHASES if name in providers.phase_providers(p)):
                fn = step.phase(phase)
                fn()
                seconds = _median_seconds(fn, device, rounds)
                rows[f"{phase} {name} {routing}"] = {
                    "phase": phase,
                    "provider": name,
                    "routing": routing,
                    "seconds": seconds,
                    "tflops": shape.phase_flops(phase) / seconds / 1e12,
                    "peak_bytes": providers.peak_bytes(step, phase),
                    "experts": step.experts,
                }
            if name in ("sonar", "sonar-unfused") and routing == "uniform":
                mm = {k: v["seconds"] for k, v in roof.items() if k != "total_seconds"}
                kernels[name] = kernel_times.kernel_table(
                    step, gemm_shapes(shape), mm, device == "cuda", 5 if device == "cuda" else rounds
                )
            del step
    for row in rows.values():
        base = rows[f"{row['phase']} {providers.BASELINE} {row['routing']}"]
        # The ratios of the tables: provider / standard-fused (the *_vs_standard keys), below 1 is better
        # (the speedup is its inverse).
        row["time_vs_standard"] = row["seconds"] / base["seconds"]
        row["speedup_vs_standard"] = base["seconds"] / row["seconds"]
        row["memory_vs_standard"] = row["peak_bytes"] / base["peak_bytes"]
    return {
        "shape": shape_name,
        "T_H_I_E_top_k": tuple(shape),
        "rows": rows,
        "roofline": roof,
        "kernels": kernels,
    }


def goals(table: dict) -> dict:
    """The issue's goals read against one layer table (benchmarks, not tests)."""
    rows = table["rows"]
    # GEMM launches only: the fused AdamW epilogue also moves W and both moments (reported, not a GEMM).
    gemm_fractions = {
        f"{provider}: {label}": row["fraction_of_torch_mm"]
        for provider, kernels in table["kernels"].items()
        for label, row in kernels.items()
        if row.get("gemm_only")
    }
    return {
        "step_speedup_sonar_fused_vs_standard": rows["step sonar uniform"]["speedup_vs_standard"],
        "goal_step_speedup": 1.3,
        # The same goal as the tables read it: step time sonar / standard-fused at most 1 / 1.3.
        "step_time_sonar_fused_vs_standard": rows["step sonar uniform"]["time_vs_standard"],
        "goal_step_time_vs_standard": 1 / 1.3,
        "min_gemm_fraction_of_torch_mm": min(gemm_fractions.values(), default=float("nan")),
        "goal_gemm_fraction": 0.6,
        "gemm_fractions": gemm_fractions,
        "per_expert_over_batched_step_time": rows["step per-expert-inbwd uniform"]["seconds"]
        / rows["step paper-inbwd uniform"]["seconds"],
    }


def full_steps(presets: dict[str, int], device: str, small: bool, steps: int) -> dict:
    """Median step time and peak memory of whole-model training steps, per preset (name -> layers), for
    the arms standard, sonar and all-in-backward of sonar-train (bf16 on CUDA, activation checkpointing
    on). Skipped, with the reason, where transformers is missing."""
    try:
        from sonar_kernels import train
        from sonar_kernels.integrations import transformers as hf

        hf.register()  # the models' experts use the "auto" backend (no set_backend)
    except ImportError as e:
        return {"skipped": f"transformers is needed for the full training step: {e}"}
    out = {}
    for preset_name, layers in presets.items():
        preset = train.PRESETS[preset_name]
        argv = ["--preset", preset_name, "--layers", str(layers), "--device", device, "--quiet"]
        argv += ["--fused"] if device == "cuda" else []
        args = train.parse_args(argv)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        batch, seq = (2, 32) if small else (preset.batch_size, preset.sequence_length)
        data = train.ByteData(train.default_text(), seq, batch, seed=0)
        arms = {}
        for name in ("standard", "sonar", "all-in-backward"):
            # The same initial weights (same seed, same device) for each arm; no copy stays alive.
            initial = train.build_model(preset, layers, 0, dtype, args.device_obj)
            arm = train.build_arm(name, initial, args, steps=steps + 2)
            del initial
            tokens = [data.batch(i).to(device) for i in range(steps + 2)]
            for t in tokens[:2]:  # compile, create the optimizer state
                train.train_step(arm, t, args.max_grad_norm)
            times = []
            for t in tokens[2:]:
                train.sync(args.device_obj)
                start = time.perf_counter()
                train.train_step(arm, t, args.max_grad_norm)
                train.sync(args.device_obj)
                times.append(time.perf_counter() - start)
            row = {"step_time_s": statistics.median(times)}
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                train.train_step(arm, tokens[-1], args.max_grad_norm)
                torch.cuda.synchronize()
                row["peak_bytes"] = int(torch.cuda.max_memory_allocated())
            arms[name] = row
            del arm
        for row in arms.values():
            row["time_vs_standard"] = row["step_time_s"] / arms["standard"]["step_time_s"]
            row["speedup_vs_standard"] = arms["standard"]["step_time_s"] / row["step_time_s"]
            if "peak_bytes" in row:
                row["memory_vs_standard"] = row["peak_bytes"] / arms["standard"]["peak_bytes"]
        out[preset_name] = {"layers": layers, "batch": batch, "sequence_length": seq, "arms": arms}
    return out


def markdown(result: dict) -> str:
    lines = [f"# {result['device']}, {result['date']} (torch {result['torch']}, triton {result['triton']}, "
             f"commit {result['commit'][:9]}, {result['dtype']})", ""]  # fmt: skip
    lines.append(f"Copy bandwidth: {result['bandwidth_gbs']:.0f} GB/s. Whole run: {result['seconds']:.0f} s.")
    if not result["correctness"]:
        lines.append("- correctness: not checked in this run (--no-check)")
    for check in result["correctness"]:
        lines.append(
            f"- {check['shape']} {check['weight_dtype']}: fused == split bitwise: {check['fused_equals_split_bitwise']}"
        )
    for table in result["layers"]:
        roof = table["roofline"]
        lines += ["", f"## {table['shape']} (T, H, I, E, top_k) = {table['T_H_I_E_top_k']}", "",
                  f"torch.mm on the layer's GEMM shapes: {1000 * roof['total_seconds']:.3f} ms in all.", "",
                  "Ratios: provider / standard-fused, below 1 is better.", "",
                  "| phase | provider | routing | ms | TFLOP/s | time / standard-fused | peak MiB | memory / standard-fused |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in table["rows"].values():
            lines.append(
                f"| {row['phase']} | {row['provider']} | {row['routing']} | {1000 * row['seconds']:.3f} | "
                f"{row['tflops']:.3f} | {row['time_vs_standard']:.2f} | {row['peak_bytes'] / 2**20:.1f} | "
                f"{row['memory_vs_standard']:.2f} |"
            )
        experts = next(r["experts"] for r in table["rows"].values() if r["provider"] == providers.BASELINE)
        lines += ["", f"standard's experts: {experts}. forward and forward+backward of sonar-unfused are those "
                  "of all four sonar providers (the same kernels).", ""]  # fmt: skip
        for provider, kernels in table["kernels"].items():
            lines += [f"{provider} (uniform routing), kernel by kernel:", "",
                      "| launch | ms | TFLOP/s | of torch.mm on the same GEMM |", "|---|---|---|---|"]  # fmt: skip
            for label, row in kernels.items():
                gemm = (
                    f"{row['tflops']:.3f} | {row['fraction_of_torch_mm']:.2f}" if "tflops" in row else " | "
                )
                what = label if row.get("gemm_only", True) else f"{label} (GEMM + AdamW)"
                lines.append(f"| {what} | {1000 * row['seconds']:.3f} | {gemm} |")
            lines.append("")
        g = table["goals"]
        lines += [
            "Goals (read, not asserted): training step time sonar / standard-fused "
            f"{g['step_time_sonar_fused_vs_standard']:.2f} (goal <= {g['goal_step_time_vs_standard']:.2f}, "
            f"i.e. {g['goal_step_speedup']}x faster); slowest "
            f"grouped GEMM at {g['min_gemm_fraction_of_torch_mm']:.2f} of torch.mm (goal >= {g['goal_gemm_fraction']}); "
            f"a training step with per-expert in-backward updates (per-expert-inbwd) takes "
            f"{g['per_expert_over_batched_step_time']:.2f}x the time of one with batched ones (paper-inbwd)."
        ]
    full = result["full_steps"]
    lines += ["", "## Full training steps (sonar-train's arms)", ""]
    if "skipped" in full:
        lines.append(f"Skipped: {full['skipped']}")
    else:
        lines += ["| preset | layers | batch x seq | arm | step ms | time / standard | peak MiB | memory / standard |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for preset, entry in full.items():
            for arm, row in entry["arms"].items():
                peak = (
                    f"{row['peak_bytes'] / 2**20:.0f} | {row['memory_vs_standard']:.2f}"
                    if "peak_bytes" in row
                    else "(CUDA only) | "
                )
                lines.append(
                    f"| {preset} | {entry['layers']} | {entry['batch']} x {entry['sequence_length']} | {arm} | "
                    f"{1000 * row['step_time_s']:.1f} | {row['time_vs_standard']:.2f} | {peak} |"
                )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU interpreter, tests)")
    parser.add_argument("--out", type=Path, help="JSON output path (the markdown table goes next to it)")
    parser.add_argument("--full-step-layers", type=int, default=4,
                        help="decoder layers of the full-step models (default: %(default)s)")  # fmt: skip
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the correctness checks (bench/check_backward.py runs them alone)")  # fmt: skip
    parser.add_argument("--no-full-step", dest="full_step", action="store_false",
                        help="skip the full training steps")  # fmt: skip
    args = parser.parse_args(argv)
    if args.full_step_layers < 1:
        parser.error(f"--full-step-layers must be >= 1, got {args.full_step_layers}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = args.small or device == "cpu"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    # On a CPU the kernels run under the interpreter: its times mean nothing, so each is taken once (a smoke
    # test of the script); on CUDA triton.testing.do_bench decides the repetitions.
    rounds = 1 if device == "cpu" else 0
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    started = time.perf_counter()
    correctness = [
        check_backward.check("small" if small else "olmoe-1b-7b", weight_dtype, device)
        for weight_dtype in (torch.bfloat16, torch.float32)
        if args.check
    ]
    shapes = ("cpu-tiny",) if small else ("olmoe-1b-7b", "granite-3.1-3b-a800m")
    layers = []
    for name in shapes:
        table = layer_table(name, dtype, device, rounds)
        table["goals"] = goals(table)
        layers.append(table)
    if not args.full_step:
        full = {"skipped": "--no-full-step"}
    elif small:
        full = full_steps({"tiny-olmoe": 1}, device, small=True, steps=3)
    else:
        presets = {"olmoe-1b-7b": args.full_step_layers, "granite-3.1-3b-a800m": args.full_step_layers}
        full = full_steps(presets, device, small=False, steps=5)
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
        "full_steps": full,
        # The tile configuration tuned for each kernel family and layer shape (empty when nothing was tuned).
        "tuning": configs.tuning_enabled(torch.device(device)),
        "configs": {key: config._asdict() for key, config in configs.chosen().items()},
    }
    result["seconds"] = time.perf_counter() - started
    # GPU results go to bench/results/ (to be committed; README's table is built from them); a CPU run is
    # a smoke test and goes to runs/.
    if device == "cuda":
        default = ROOT / "bench" / "results" / f"{result['date']}-{device_name.split()[-1].lower()}.json"
    else:
        default = ROOT / "runs" / "bench" / "gpu_bench-cpu.json"
    out = args.out or default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')} in {result['seconds']:.0f} s")
    return 0 if all(c["fused_equals_split_bitwise"] for c in correctness) else 1


if __name__ == "__main__":
    sys.exit(main())
