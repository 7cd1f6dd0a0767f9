"""sonar-train's command line: arguments, the run of every arm, report.json and report.png."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from sonar_kernels.ops import has_torch_fused_adamw
from sonar_kernels.ops.validation import resolve_backend
from sonar_kernels.optim import UnownedExpertsWarning
from sonar_kernels.train import checkpoint, distributed
from sonar_kernels.train.arms import (
    ARMS,
    EXPERT_PARAMS,
    OTHER_ARMS,
    build_arm,
    build_model,
    run_arm,
    time_interleaved,
)
from sonar_kernels.train.data import PRESETS, ByteData, UsageError, load_text
from sonar_kernels.train.memory import (
    LABELS,
    GiB,
    available_memory,
    check_fits,
    estimate_training_memory,
    local_processes,
    measure_memory,
)
from sonar_kernels.train.report import (
    TIMING_WARMUP,
    heldout_statistics,
    plot,
    speedup,
    step_time_summary,
    summary_table,
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where one is set and the help text does not describe it already."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="sonar-train",
        description=(
            "Train an MoE model (a transformers OLMoE or Granite MoE preset: tiny ones for a CPU, the real "
            "models' dimensions for GPUs) three ways from the same initialization and batches: standard "
            "(torch.optim.AdamW, global-norm clipping), sonar (SonarAdamW: expert tensors updated in the "
            "backward, dense clipping) and standard-dense-clip (its control, which must equal sonar bit for "
            "bit), over several seeds. Writes report.json and report.png under --out/--name and prints the "
            "held-out loss per seed with a statistical verdict, peak memory and step time. --model PATH starts "
            "every arm from a local transformers checkpoint instead, --save DIR writes the sonar arm's trained "
            "model. Before any model is built, its training memory is estimated and a run that cannot fit is "
            "refused (exit code 2)."
        ),
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny-olmoe",
                        help="model family and dimensions: tiny-* for a CPU, the others the real models' for GPUs")  # fmt: skip
    parser.add_argument("--model", metavar="PATH",
                        help="a local transformers checkpoint (a folder saved by save_pretrained) of an MoE family the "
                        "sonar experts run (OLMoE, Qwen3-MoE, Granite MoE, Mixtral, ...), loaded with from_pretrained "
                        "(local files only, in --dtype): every arm starts from its weights instead of the preset's "
                        "random ones, and the seeds differ only in batch order. The token ids stay the text's UTF-8 "
                        "bytes (0-255), not the checkpoint's tokenizer: its vocabulary must hold at least 256 ids "
                        "(ids 256 and up are never seen), and its first losses are high (its embeddings of ids 0-255 "
                        "mean other tokens). --preset then only sets the defaults of --steps, --batch-size and "
                        "--seq-len")  # fmt: skip
    parser.add_argument("--save", metavar="DIR",
                        help="save the sonar arm's trained model (first seed) to DIR with save_pretrained, in the "
                        "training dtype: a transformers checkpoint that loads without sonar_kernels (its config "
                        "does not select the sonar experts; transformers' default experts run it). DIR must be a "
                        "new or empty folder")  # fmt: skip
    parser.add_argument(
        "--layers",
        type=int,
        metavar="N",
        help="number of decoder layers (default: the preset's, 4 for tiny-*)",
    )
    parser.add_argument("--data", metavar="PATH", help="UTF-8 text file, or .jsonl with a 'text' field; the last tenth is "
                        "held out (default: the Python docs in pydoc_data.topics)")  # fmt: skip
    parser.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="training steps per arm and seed (default: the preset's, 200 for tiny-*, 20 for the real ones)",
    )
    parser.add_argument("--seeds", type=int, default=3,
                        metavar="N", help="runs per arm, with seeds S, S+1, ... (S the first seed): each another initialization and batch "
                        "order; the held-out difference is judged over them (standard-dense-clip runs the "
                        "first seed only)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="the first seed")
    parser.add_argument(
        "--batch-size", type=int, metavar="N", help="sequences per step (default: the preset's, 4)"
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        metavar="N",
        help="bytes per sequence (default: the preset's, 128 for tiny-*, 1024 for the real ones)",
    )
    parser.add_argument("--lr", type=float, default=3e-3, metavar="LR", help="peak AdamW learning rate")
    parser.add_argument("--warmup-steps", type=int, metavar="N", help="linear LR warm-up, then cosine decay to a tenth of "
                        "--lr (default: a tenth of the steps)")  # fmt: skip
    parser.add_argument(
        "--max-grad-norm", type=float, default=1.0, metavar="NORM", help="clipping threshold of every arm"
    )
    parser.add_argument("--heldout-batches", type=int, default=HELDOUT_BATCHES,
                        metavar="N", help="held-out batches to evaluate, the same for every arm and seed (0: the whole split)")  # fmt: skip
    parser.add_argument("--arms", nargs="+", choices=ARMS + OTHER_ARMS, default=list(ARMS),
                        help="the arms to train, each at most once (default: standard sonar standard-dense-clip); "
                        "all-in-backward, an extra arm: every parameter updated in the backward and nothing "
                        "clipped, the paper's other comparison")  # fmt: skip
    parser.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto",
                        help="moe_mlp backend of the experts (auto: triton on CUDA, torch on CPU)")  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="default: bfloat16 on CUDA, float32 on CPU")  # fmt: skip
    parser.add_argument("--device", metavar="DEVICE", help="default: cuda when available, else cpu")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="turn activation checkpointing off (on by default)")  # fmt: skip
    parser.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.optim.AdamW's flag, the same in every arm (default: torch's choice)")  # fmt: skip
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.optim.AdamW's flag, the same in every arm (default, when neither --fused nor --foreach "
                        "is given: on wherever torch has a fused AdamW for the device and dtype, the CPU and CUDA among "
                        "them)")  # fmt: skip
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="skip the memory pass (per arm, first seed: two warm-up steps, then one step tracked by MemTracker)")  # fmt: skip
    parser.add_argument("--timing-rounds", type=int, default=40, metavar="N",
                        help="after training, time the arms side by side on the first seed's model: "
                        f"{TIMING_WARMUP} + N rounds of one step of every arm (order rotated per round), the "
                        "reported step times and their ratio then come from these N rounds (a machine that "
                        "slows down for a while weighs on every arm alike); 0: the step times of the training "
                        "runs. Single-process runs whose arms fit in memory together")  # fmt: skip
    parser.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                        help="start even when the estimate of the training memory (parameters, gradients, AdamW "
                        "state, activations, from the model's shapes before it is built) exceeds the memory "
                        "available; by default such a run is refused with exit code 2")  # fmt: skip
    parser.add_argument("--ep", type=int, default=1,
                        metavar="N", help="expert parallelism over N ranks (under torchrun with N processes; 1: data "
                        "parallel on several processes)")  # fmt: skip
    parser.add_argument("--out", default="runs", metavar="DIR", help="output folder")
    parser.add_argument("--name", metavar="NAME", help="run name: the run creates --out/NAME, or NAME-2, NAME-3, ... when that "
                        "exists (default: the preset, or the --model folder's name)")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    for name in ("layers", "steps", "seeds", "batch_size", "seq_len", "ep"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.timing_rounds < 0:
        parser.error(f"--timing-rounds must be >= 0, got {args.timing_rounds}")
    steps = args.steps or PRESETS[args.preset].steps
    if args.warmup_steps is not None and args.warmup_steps > steps:
        parser.error(f"--warmup-steps {args.warmup_steps} is more than the {steps} training steps")
    repeated = sorted({arm for arm in args.arms if args.arms.count(arm) > 1})
    if repeated:
        parser.error(f"--arms: {', '.join(repeated)} given more than once")
    if args.model is not None and args.layers is not None:
        parser.error("--layers does not apply to --model: a checkpoint has its own layers")
    if args.save is not None:
        if "sonar" not in args.arms:
            parser.error("--save saves the sonar arm's model: add sonar to --arms")
        save = Path(args.save)
        if save.exists() and (not save.is_dir() or any(save.iterdir())):
            parser.error(f"--save {args.save}: exists and is not an empty folder")
    if args.name is not None and (
        not args.name or Path(args.name).name != args.name or args.name in (".", "..")
    ):
        parser.error(f"--name {args.name!r} must be a folder name, without a path")
    for name in ("warmup_steps", "heldout_batches"):
        value = getattr(args, name)
        if value is not None and value < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {value}")
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
    args.run_name = args.name or (Path(args.model).resolve().name if args.model else args.preset)
    for path in (out, out / args.run_name):
        if path.exists() and not path.is_dir():
            parser.error(f"--out: {path} exists and is not a folder")
    return args


# Held-out batches evaluated by default: enough that the evaluation costs a few training steps per arm.
HELDOUT_BATCHES = 32


# What sonar-train imports beyond the base package: the [train] extra (pyproject.toml).
TRAIN_EXTRA = ("transformers", "tqdm", "matplotlib")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = [name for name in TRAIN_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"sonar-train: error: {', '.join(missing)} not installed; sonar-train needs the [train] extra "
            "(sonar-kernels is not on PyPI): pip install -e '.[train]' in the sonar-kernels checkout, or "
            f"pip install {' '.join(missing)}",
            file=sys.stderr,
        )
        return 2
    args.run_dir = None
    # The standard arms train the "sonar" experts with torch.optim.AdamW on purpose (the baseline).
    warnings.filterwarnings("ignore", category=UnownedExpertsWarning)
    try:
        distributed.setup(args)  # under torchrun: one rank of a data-parallel run
        return _run(args)
    except UsageError as e:
        print(f"sonar-train: error: {e}", file=sys.stderr)
        return 2
    finally:
        distributed.teardown()
        # A run that ended before writing its report gives its folder back (when nothing is in it).
        if args.run_dir is not None and args.run_dir.is_dir() and not any(args.run_dir.iterdir()):
            args.run_dir.rmdir()


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
    if args.save is not None and args.ep > 1:
        raise UsageError(
            "--save with --ep > 1: each rank holds only its own experts; save from a run without --ep"
        )
    args.quiet = args.quiet or not leader
    if device.type == "cuda":
        # The sonar arm and its control are compared bit for bit: deterministic kernels where torch has them.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.fused is None and args.foreach is None and has_torch_fused_adamw(device, dtype):
        # torch's fused AdamW in every arm, on the CPU as on CUDA (where the Triton epilogue reproduces it):
        # one pass per tensor and no temporaries (on the CPU several times faster than torch's default
        # for-loop). The same flags in every arm keep the comparison fair and the bitwise verdict valid.
        args.fused = True
    steps = args.steps or preset.steps
    sequence_length = args.seq_len or preset.sequence_length
    batch_size = args.batch_size or preset.batch_size
    hf.register()
    # The model's shapes on the meta device (nothing allocated): the memory estimate, checked before the
    # model is built or loaded.
    if args.model is not None:
        config = checkpoint.load_config(args.model)
        shapes = checkpoint.meta_model(config, args.model)
        settings = checkpoint.saved_settings(config)
        what, remedies = f"--model {args.model}", "A smaller --batch-size or --seq-len, --dtype bfloat16"
    else:
        shapes = build_model(preset, args.layers, args.seed, dtype, torch.device("meta"))
        settings = {"output_router_logits": False, "use_cache": True}  # the configs' defaults
        what, remedies = (
            f"--preset {args.preset}",
            "Fewer --layers, a smaller --batch-size or --seq-len, --dtype bfloat16",
        )
    estimate = estimate_training_memory(
        shapes, dtype=dtype, batch_size=batch_size, sequence_length=sequence_length, arms=args.arms,
        checkpointing=args.checkpointing, device=device, foreach=args.foreach, fused=args.fused,
        local_processes=local_processes(),
    )  # fmt: skip
    available = available_memory(device)
    estimate["available_host_bytes"], estimate["available_device_bytes"] = (
        available["host"],
        available["device"],
    )
    del shapes
    if args.memory_check:
        check_fits(estimate, available, what, remedies)
    text = load_text(args.data)
    data = ByteData(text, sequence_length, batch_size, args.seed)
    heldout = [b.to(device) for b in data.heldout_batches(args.heldout_batches or None)]
    if args.model is not None:  # the same loaded weights for every arm and seed
        initial = checkpoint.load_model(args.model, dtype, args.quiet)
    else:
        initial = build_model(preset, args.layers, args.seed, dtype, torch.device("cpu"))  # copied per arm
    hf.set_backend(initial, args.backend)  # an attribute of each experts module, copied with it
    if leader:  # the run's folder, reserved once the data and the model are known to be good
        args.run_dir = reserve_run_directory(Path(args.out), args.run_name)
    n_params = sum(p.numel() for p in initial.parameters())
    n_expert = sum(p.numel() for name, p in initial.named_parameters() if name.endswith(EXPERT_PARAMS))
    source = f"model {args.model} ({initial.config.model_type})" if args.model else args.preset
    if not args.quiet:
        memory = f"{_gib(estimate['host_bytes'])} of host memory ({_gib(available['host'])} available)"
        if device.type == "cuda":
            memory += (
                f", {_gib(estimate['device_bytes'])} of GPU memory ({_gib(available['device'])} available)"
            )
        print(f"sonar-train: estimated training memory {memory}", file=sys.stderr)
        print(
            f"sonar-train: {source}, {initial.config.num_hidden_layers} layer"
            f"{'s' if initial.config.num_hidden_layers > 1 else ''}, {n_params / 1e6:.2f} M parameters "
            f"({100 * n_expert / n_params:.0f} % in experts), {str(dtype).removeprefix('torch.')}, {device}, backend "
            f"{resolve_backend(args.backend, device)}; {args.seeds} seed{'s' if args.seeds > 1 else ''} x {steps} "
            f"step{'s' if steps > 1 else ''} of {batch_size} x "
            f"{sequence_length} bytes, activation checkpointing {'on' if args.checkpointing else 'off'}; "
            f"writing {args.run_dir}",
            file=sys.stderr,
        )
    report = {
        "preset": None if args.model else args.preset,
        "source": source,
        "model": str(Path(args.model).resolve()) if args.model else None,
        "model_type": initial.config.model_type,
        "vocab_size": initial.config.vocab_size,
        "tokens": checkpoint.TOKENS_NOTE.format(vocab=initial.config.vocab_size),
        "memory_estimate": estimate,
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
        "heldout_batches": len(heldout),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sonar_kernels": sonar_kernels.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "arms": {},
    }
    if ranks > 1:
        experts = getattr(initial.config, "num_experts", None) or initial.config.num_local_experts
        layout = (
            distributed.EP_LAYOUT.format(local=experts // args.ep, experts=experts)
            if args.ep > 1
            else distributed.LAYOUT
        )
        report["distributed"] = {"ranks": ranks, "layout": layout, "expert_parallel": args.ep > 1,
                                 "dense_checksums": {}, "expert_checksums": {}}  # fmt: skip
    seeds = [args.seed + i for i in range(args.seeds)]
    report["seeds"] = seeds
    report["seeds_run"] = len(seeds)
    results = {name: [] for name in args.arms}  # per arm, one run_arm result per seed it ran
    # sonar and its control, when both run: the parameters of the first to train (first seed), on the CPU,
    # until the other has trained.
    compared = [name for name in args.arms if name in ("sonar", "standard-dense-clip")]
    compared = compared if len(compared) == 2 else []
    final = {}
    equal = None  # sonar's parameters equal its control's, bit for bit (first seed)
    updates = {"backward": 0, "step": 0, "expected": 0}
    for i, seed in enumerate(seeds):
        if i > 0:  # another batch order, and without --model another initialization
            data = ByteData(text, sequence_length, batch_size, seed)
            if args.model is None:
                initial = None  # one initial model at a time (the real presets are large)
                initial = build_model(preset, args.layers, seed, dtype, torch.device("cpu"))
                hf.set_backend(initial, args.backend)
        for name in args.arms:
            if i > 0 and name == "standard-dense-clip":
                continue  # the exactness control: compared bit for bit on the first seed
            arm = build_arm(name, initial, args, steps, count_updates=True)
            label = f"seed {seed} {name}" if len(seeds) > 1 else name
            result = run_arm(arm, data, steps, args, device, heldout, label)
            results[name].append({"seed": seed, **result})
            if ranks > 1 and i == 0:  # the ranks' weights after training, one checksum each
                named = list(arm.model.named_parameters())
                for kind, chosen in (
                    ("dense", [p for n, p in named if not n.endswith(EXPERT_PARAMS)]),
                    ("expert", [p for n, p in named if n.endswith(EXPERT_PARAMS)]),
                ):
                    report["distributed"][f"{kind}_checksums"][name] = distributed.checksums(chosen)
            if name == "sonar":
                # The verdict means something only if every expert tensor was updated in every backward:
                # counted from the tensors' AdamW step counts, not assumed.
                updates["backward"] += int(arm.updates["backward"])
                updates["step"] += int(arm.updates["step"])
                updates["expected"] += steps * len(arm.optimizer.expert_tensors)
                report["expert_tensors"] = len(arm.optimizer.expert_tensors)
            if i == 0 and name == "sonar" and args.save is not None and leader:
                checkpoint.save_model(arm.model, args.save, settings, args.quiet)
                report["saved"] = {"path": str(Path(args.save).resolve()), "arm": "sonar", "seed": seed}
            if i == 0 and name in compared:
                if not final:  # the first of the two: kept until the other has trained
                    final[name] = [p.detach().to("cpu", copy=True) for p in arm.model.parameters()]
                else:
                    (kept,) = final.values()
                    equal = all(
                        torch.equal(a, b.detach().cpu())
                        for a, b in zip(kept, arm.model.parameters(), strict=True)
                    )
                    final.clear()  # compared: no copy held through the other arms and the memory pass
            del arm
        if i == 0:
            memory = _memory_pass(args, initial, data, device)
            timing, report["timing"] = _timing_pass(args, initial, data, device, ranks, estimate, available)
    for name in args.arms:
        report["arms"][name] = _aggregate(results[name])
        report["arms"][name].update(memory[name])
        if timing is not None:  # the side-by-side rounds replace the training runs' times
            arm = report["arms"][name]
            arm["training_step_time"] = arm["step_time"]
            arm["step_time"] = step_time_summary([timing[name]])
            arm["step_time_s"] = arm["step_time"]["median_s"]
    if "sonar" in args.arms:
        report["sonar_expert_updates_in_backward"] = updates["backward"]
        report["sonar_expert_updates_in_step"] = updates["step"]
        report["sonar_expert_updates_expected"] = updates["expected"]
    if equal is not None:
        report["sonar_equals_control_bitwise"] = (
            updates["backward"] == updates["expected"] and updates["step"] == 0 and equal
        )
    if "sonar" in report["arms"] and "standard" in report["arms"]:
        sonar_arm, standard_arm = report["arms"]["sonar"], report["arms"]["standard"]
        report["heldout"] = heldout_statistics(standard_arm["heldout_losses"], sonar_arm["heldout_losses"])
        report["heldout_loss_delta"] = report["heldout"]["mean_delta"]
        report["peak_memory_reduction"] = (
            1 - sonar_arm["peak_memory_bytes"] / standard_arm["peak_memory_bytes"] if args.memory else None
        )
        report["speedup"], report["speedup_note"] = speedup(standard_arm["step_time"], sonar_arm["step_time"])
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
    out = args.run_dir
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(summary_table(report))
    plot(report, out / "report.png")
    print(f"\nwrote {out / 'report.json'} and {out / 'report.png'}")
    if "saved" in report:
        print(f"saved the sonar arm's model (seed {report['saved']['seed']}) to {report['saved']['path']}")
    return 0


def _memory_pass(args, initial, data, device) -> dict:
    """Per arm, the peak of one training step by category (MemTracker), or zeros under --no-memory."""
    from tqdm import tqdm

    if not args.memory:
        return {name: {"peak_memory_bytes": 0, "peak_memory": dict.fromkeys(LABELS, 0),
                       "peak_phase": "not measured"} for name in args.arms}  # fmt: skip
    names = tqdm(args.arms, desc="memory pass (3 steps per arm)", unit="arm", file=sys.stderr,
                 disable=args.quiet, leave=False)  # fmt: skip
    return {name: measure_memory(name, initial, data, args, device) for name in names}


def _timing_pass(args, initial, data, device, ranks, estimate, available) -> tuple[dict | None, str]:
    """The arms' step times side by side (``arms.time_interleaved``) on the first seed's model, with a
    note saying how the step times were measured; (None, the note) when the pass does not run: asked off,
    several processes, or the arms' models and state not fitting in memory together."""
    from tqdm import tqdm

    training = "the training runs' steps (each arm's runs one after another)"
    if args.timing_rounds <= 0:
        return None, training
    if ranks > 1:
        return None, f"{training}: the side-by-side rounds run in single-process runs only"
    need = len(args.arms) * estimate["host_bytes"], len(args.arms) * estimate["device_bytes"]
    if need[0] > available["host"] or (device.type == "cuda" and need[1] > available["device"]):
        return None, f"{training}: the {len(args.arms)} arms do not fit in memory together"
    arms = [build_arm(name, initial, args, TIMING_WARMUP + args.timing_rounds) for name in args.arms]
    progress = tqdm(total=1, desc=f"timing pass ({args.timing_rounds} rounds)", file=sys.stderr,
                    disable=args.quiet, leave=False)  # fmt: skip
    times = time_interleaved(arms, data, TIMING_WARMUP, args.timing_rounds, args, device)
    progress.update()
    progress.close()
    note = (
        f"{args.timing_rounds} rounds side by side after training (first seed's model; each round one step of "
        f"every arm, the order rotated; {TIMING_WARMUP} warm-up rounds first)"
    )
    return times, note


def _aggregate(runs: list[dict]) -> dict:
    """One arm's results over the seeds it ran: per-seed lists and their summaries."""
    heldout = [r["heldout_loss"] for r in runs]
    clip = [r["clip_fraction"] for r in runs]
    return {
        "seeds": [r["seed"] for r in runs],
        "heldout_losses": heldout,
        "heldout_loss": statistics.fmean(heldout),
        "train_losses": [r["train_losses"] for r in runs],
        "grad_norms": [r["grad_norms"] for r in runs],
        "clip_fractions": clip,
        "clip_fraction": statistics.fmean(clip),
        "step_times_s": [r["step_times_s"] for r in runs],
        "step_time": (timing := step_time_summary([r["step_times_s"] for r in runs])),
        "step_time_s": timing["median_s"],
    }


def reserve_run_directory(out: Path, name: str) -> Path:
    """Create and return ``out/name``, or ``out/name-2``, ``-3``, ... when that exists: each run reserves
    its own folder when it starts (an exclusive mkdir), so a run never writes into another's, even when
    they run at the same time.

    Raises:
        UsageError: the folder cannot be created (a file in the way, no permission).
    """
    number = 1
    while True:
        candidate = out / (name if number == 1 else f"{name}-{number}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            if not candidate.is_dir():
                raise UsageError(f"--out: {candidate} exists and is not a folder") from None
            number += 1
        except OSError as e:
            raise UsageError(f"--out: cannot create {candidate} ({e.strerror})") from None


def _gib(nbytes: int | None) -> str:
    if nbytes is None:
        return "unknown"
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 10 else f"{nbytes / 2**20:.1f} MiB"


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
