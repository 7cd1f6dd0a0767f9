"""sonar-train's command line: arguments, the run of every arm, report.json and report.png."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from sonar_kernels.ops.validation import resolve_backend
from sonar_kernels.train import distributed
from sonar_kernels.train.arms import ARMS, EXPERT_PARAMS, OTHER_ARMS, build_arm, build_model, run_arm
from sonar_kernels.train.data import PRESETS, ByteData, UsageError, load_text
from sonar_kernels.train.memory import LABELS, measure_memory
from sonar_kernels.train.report import plot, summary_table


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="sonar-train",
        description=(
            "Train an MoE model (a transformers OLMoE or Granite MoE preset: tiny ones for a CPU, the real "
            "models' dimensions for GPUs) three ways from the same initialization and batches: standard "
            "(torch.optim.AdamW, global-norm clipping), sonar (SonarAdamW: expert tensors updated in the "
            "backward, dense clipping) and standard-dense-clip (its control). "
            "Writes report.json and report.png under --out and prints held-out loss, peak memory and step time."
        ),
    )
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="tiny-olmoe", help="default: %(default)s"
    )
    parser.add_argument("--layers", type=int, help="number of decoder layers (default: the preset's)")
    parser.add_argument(
        "--data", help="UTF-8 text file, or .jsonl with a 'text' field (default: pydoc_data.topics)"
    )
    parser.add_argument("--steps", type=int, help="training steps per arm (default: the preset's)")
    parser.add_argument("--batch-size", type=int, help="sequences per step (default: the preset's)")
    parser.add_argument("--seq-len", type=int, help="bytes per sequence (default: the preset's)")
    parser.add_argument(
        "--lr", type=float, default=3e-3, help="peak AdamW learning rate (default: %(default)s)"
    )
    parser.add_argument("--warmup-steps", type=int, help="linear LR warm-up (default: a tenth of the steps)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="clipping threshold of every arm (default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--heldout-batches", type=int, help="held-out batches to evaluate (default: the whole split)"
    )
    parser.add_argument("--seed", type=int, default=0,
                        help="initialization and batch order (default: %(default)s)")  # fmt: skip
    parser.add_argument("--arms", nargs="+", choices=ARMS + OTHER_ARMS, default=list(ARMS),
                        help="default: %(default)s")  # fmt: skip
    parser.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto",
                        help="moe_mlp backend of the sonar experts (auto: triton on CUDA, torch on CPU)")  # fmt: skip
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on CUDA, float32 on CPU"
    )
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="turn activation checkpointing off (on by default)")  # fmt: skip
    parser.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.optim.AdamW's flag, the same in every arm (default: torch's choice)")  # fmt: skip
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.optim.AdamW's flag, the same in every arm (default: on for CUDA, off on CPU)")  # fmt: skip
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory pass")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert parallelism over N ranks (under torchrun with N processes; default: 1, "
                        "data parallel on several processes)")  # fmt: skip
    parser.add_argument("--out", default="runs", help="output folder (default: runs)")
    parser.add_argument("--name", help="run name (default: the preset)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    for name in ("layers", "steps", "batch_size", "seq_len", "heldout_batches", "ep"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    if not (args.max_grad_norm > 0 and math.isfinite(args.max_grad_norm)):
        parser.error(f"--max-grad-norm must be a finite number > 0, got {args.max_grad_norm}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        args.device_obj = torch.device(device)
    except RuntimeError:
        parser.error(f"--device {device!r} is not a device (cpu, cuda, cuda:N)")
    if args.device_obj.type not in ("cpu", "cuda"):
        parser.error(f"--device {device!r}: only cpu and cuda are supported")
    if args.device_obj.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device!r}: no CUDA device here")
    if args.backend == "triton" and args.device_obj.type == "cpu":
        from sonar_kernels import ops

        if not ops.triton_interpreting():
            parser.error(
                "--backend triton on the CPU needs TRITON_INTERPRET=1 (the interpreter: tests, not training)"
            )
    out = Path(args.out)
    for path in (out, out / (args.name or args.preset)):
        if path.exists() and not path.is_dir():
            parser.error(f"--out: {path} exists and is not a folder")
    return args


# What sonar-train imports beyond the base package: the [train] extra (pyproject.toml).
TRAIN_EXTRA = ("transformers", "tqdm", "matplotlib")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = [name for name in TRAIN_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"sonar-train: error: {', '.join(missing)} not installed; sonar-train needs the [train] extra: "
            "pip install 'sonar-kernels[train]'",
            file=sys.stderr,
        )
        return 2
    try:
        distributed.setup(args)  # under torchrun: one rank of a data-parallel run
        return _run(args)
    except UsageError as e:
        print(f"sonar-train: error: {e}", file=sys.stderr)
        return 2
    finally:
        distributed.teardown()


def _run(args) -> int:
    import transformers

    import sonar_kernels
    from sonar_kernels.integrations import transformers as hf

    preset = PRESETS[args.preset]
    device = args.device_obj
    ranks, leader = distributed.world_size(), distributed.rank() == 0
    if ranks > 1 and "all-in-backward" in args.arms:
        raise UsageError(
            "--arms all-in-backward runs on one process only: its dense parameters are updated in the "
            "backward from their local, not yet averaged, gradient"
        )
    if args.ep > 1 and args.ep != ranks:
        raise UsageError(
            f"--ep {args.ep} needs {args.ep} ranks: torchrun --nproc-per-node {args.ep} -m sonar_kernels.train "
            f"(this run has {ranks})"
        )
    args.quiet = args.quiet or not leader
    if device.type == "cuda":
        # The sonar arm and its control are compared bit for bit: deterministic kernels where torch has them.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.fused is None and args.foreach is None and device.type == "cuda":
        # The Triton epilogue reproduces torch's fused CUDA AdamW: the flags every arm uses.
        args.fused = True
    steps = args.steps or preset.steps
    sequence_length = args.seq_len or preset.sequence_length
    batch_size = args.batch_size or preset.batch_size
    data = ByteData(load_text(args.data), sequence_length, batch_size, args.seed)
    heldout = [b.to(device) for b in data.heldout_batches(args.heldout_batches)]
    hf.register()
    initial = build_model(preset, args.layers, args.seed, dtype, torch.device("cpu"))  # copied per arm
    hf.set_backend(initial, args.backend)  # an attribute of each experts module, copied with it
    n_params = sum(p.numel() for p in initial.parameters())
    n_expert = sum(p.numel() for name, p in initial.named_parameters() if name.endswith(EXPERT_PARAMS))
    if not args.quiet:
        print(
            f"sonar-train: {args.preset}, {initial.config.num_hidden_layers} layers, {n_params / 1e6:.2f} M parameters "
            f"({100 * n_expert / n_params:.0f} % in experts), {dtype}, {device}, {steps} steps of "
            f"{batch_size} x {sequence_length} bytes, activation checkpointing {'on' if args.checkpointing else 'off'}",
            file=sys.stderr,
        )
    report = {
        "preset": args.preset,
        "layers": initial.config.num_hidden_layers,
        "parameters": n_params,
        "expert_parameters": n_expert,
        "steps": steps,
        "batch_size": batch_size,
        "sequence_length": sequence_length,
        "lr": args.lr,
        "max_grad_norm": args.max_grad_norm,
        "activation_checkpointing": args.checkpointing,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": resolve_backend(args.backend, device),
        "backend_requested": args.backend,
        "data": str(Path(args.data).resolve()) if args.data else "pydoc_data.topics",
        "commit": _commit(),
        "train_tokens": len(data.train),
        "heldout_tokens": len(data.heldout),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sonar_kernels": sonar_kernels.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "arms": {},
    }
    if ranks > 1:
        experts = initial.config.num_experts if preset.family == "olmoe" else initial.config.num_local_experts
        layout = (
            distributed.EP_LAYOUT.format(local=experts // args.ep, experts=experts)
            if args.ep > 1
            else distributed.LAYOUT
        )
        report["distributed"] = {"ranks": ranks, "layout": layout, "expert_parallel": args.ep > 1,
                                 "dense_checksums": {}, "expert_checksums": {}}  # fmt: skip
    final = {}  # the compared arms' parameters after training, on the CPU
    for name in args.arms:
        arm = build_arm(name, initial, args, steps)
        report["arms"][name] = run_arm(arm, data, steps, args, device, heldout)
        if ranks > 1:  # the ranks' weights after training, one checksum each
            named = list(arm.model.named_parameters())
            for kind, chosen in (
                ("dense", [p for n, p in named if not n.endswith(EXPERT_PARAMS)]),
                ("expert", [p for n, p in named if n.endswith(EXPERT_PARAMS)]),
            ):
                report["distributed"][f"{kind}_checksums"][name] = distributed.checksums(chosen)
        if name == "sonar":
            # The verdict means something only if SonarAdamW updated every expert tensor in the backward.
            report["sonar_expert_tensors_updated_in_backward"] = len(arm.optimizer.expert_tensors)
            report["expert_tensors"] = 2 * arm.model.config.num_hidden_layers
        if name in ("sonar", "standard-dense-clip"):
            final[name] = [p.detach().to("cpu", copy=True) for p in arm.model.parameters()]
        del arm
    if args.memory:
        for name in args.arms:
            report["arms"][name].update(measure_memory(name, initial, data, args, device))
    else:
        for name in args.arms:
            report["arms"][name].update({"peak_memory_bytes": 0, "peak_memory": dict.fromkeys(LABELS, 0),
                                         "peak_phase": "not measured"})  # fmt: skip
    if len(final) == 2:
        report["sonar_equals_control_bitwise"] = report["sonar_expert_tensors_updated_in_backward"] == report[
            "expert_tensors"
        ] and all(
            torch.equal(a, b) for a, b in zip(final["sonar"], final["standard-dense-clip"], strict=True)
        )
    if "sonar" in report["arms"] and "standard" in report["arms"]:
        report["heldout_loss_delta"] = (
            report["arms"]["sonar"]["heldout_loss"] - report["arms"]["standard"]["heldout_loss"]
        )
        if args.memory:
            report["peak_memory_reduction"] = 1 - (
                report["arms"]["sonar"]["peak_memory_bytes"] / report["arms"]["standard"]["peak_memory_bytes"]
            )
        report["speedup"] = report["arms"]["standard"]["step_time_s"] / report["arms"]["sonar"]["step_time_s"]
    if ranks > 1:
        # Replicated weights must be identical on every rank: the dense ones always, the experts when
        # they are replicated (data parallel).
        replicated = ("dense",) if args.ep > 1 else ("dense", "expert")
        report["distributed"]["ranks_agree"] = all(
            len(set(sums)) == 1
            for kind in replicated
            for sums in report["distributed"][f"{kind}_checksums"].values()
        )
    if not leader:
        return 0
    out = Path(args.out) / (args.name or args.preset)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(summary_table(report))
    plot(report, out / "report.png")
    print(f"\nwrote {out / 'report.json'} and {out / 'report.png'}")
    return 0


def _commit() -> str:
    """The git commit of the sonar_kernels source that runs, or "unknown" (an installed package)."""
    import sonar_kernels

    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(sonar_kernels.__file__).parent, capture_output=True,
            text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 else "unknown"
