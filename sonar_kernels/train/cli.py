"""sonar-train's command line: arguments, the run of every arm, report.json and report.png."""

from __future__ import annotations

import datetime
import importlib.util
import json
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
    CONTROLS,
    EXPERT_PARAMS,
    build_arm,
    build_model,
    master_values,
    run_arm,
    time_interleaved,
)
from sonar_kernels.train.clipping import CLIPPING_MODE
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
from sonar_kernels.train.options import parse_args
from sonar_kernels.train.report import (
    TIMING_WARMUP,
    heldout_statistics,
    plot,
    speedup,
    step_time_summary,
    summary_table,
)
from sonar_kernels.train.verdicts import check_baseline, clipping_entry, spike_effect

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
    clipping = [name for name in args.arms if name in CLIPPING_MODE]
    if ranks > 1 and clipping:
        raise UsageError(
            f"--expert-clipping ({', '.join(clipping)}) runs on one process only: its controls clip the "
            "gradients of one process (their norms and second moments are not reduced over ranks)"
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
        # --inject-spike: {"step": STEP (counted from 1), "scale": SCALE}, the loss multiplied in every arm.
        "inject_spike": (
            None
            if args.inject_spike is None
            else dict(zip(("step", "scale"), args.inject_spike, strict=True))
        ),
        "spike_threshold": args.spike_threshold
        if "sonar-spike" in args.arms or "spike-control" in args.arms
        else None,
        "warmup_steps": args.warmup_steps if args.warmup_steps is not None else max(1, steps // 10),
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
    if (
        args.baseline_report is not None
    ):  # before any training: the two runs must be the same but for the spike
        check_baseline(args.baseline_report, report, args.spike_baseline)
    results = {name: [] for name in args.arms}  # per arm, one run_arm result per seed it ran
    # A sonar arm and its control (arms.CONTROLS), when both run: the parameters of the first to train (first
    # seed; with fp32 masters, the masters), on the CPU, until the other has trained.
    pairs = {arm: control for arm, control in CONTROLS.items() if arm in args.arms and control in args.arms}
    pair_of = {name: arm for arm, control in pairs.items() for name in (arm, control)}
    final = {}
    equal = {}  # sonar arm -> its parameters equal its control's, bit for bit (first seed)
    # Per sonar arm with a control: its expert updates counted in the backward and in step(), and expected.
    updates = {arm: {"backward": 0, "step": 0, "expected": 0} for arm in CONTROLS if arm in args.arms}
    for i, seed in enumerate(seeds):
        if i > 0:  # another batch order, and without --model another initialization
            data = ByteData(text, sequence_length, batch_size, seed)
            if args.model is None:
                initial = None  # one initial model at a time (the real presets are large)
                initial = build_model(preset, args.layers, seed, dtype, torch.device("cpu"))
                hf.set_backend(initial, args.backend)
        for name in args.arms:
            if i > 0 and name in CONTROLS.values():
                continue  # the exactness controls: compared bit for bit on the first seed
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
            if name in updates:
                # The verdict means something only if every expert tensor was updated in every backward:
                # counted from the tensors' AdamW step counts, not assumed.
                updates[name]["backward"] += int(arm.updates["backward"])
                updates[name]["step"] += int(arm.updates["step"])
                updates[name]["expected"] += steps * len(arm.optimizer.expert_tensors)
                report["expert_tensors"] = len(arm.optimizer.expert_tensors)
            if i == 0 and name == "sonar" and args.save is not None and leader:
                checkpoint.save_model(arm.model, args.save, settings, args.quiet)
                report["saved"] = {"path": str(Path(args.save).resolve()), "arm": "sonar", "seed": seed}
            if i == 0 and name in pair_of:
                key = pair_of[name]
                if key not in final:  # the first of the two: kept until the other has trained
                    final[key] = master_values(arm)
                else:
                    kept = final.pop(key)  # compared: no copy held through the other arms and the memory pass
                    equal[key] = all(
                        a.dtype == b.dtype and torch.equal(a, b)
                        for a, b in zip(kept, master_values(arm), strict=True)
                    )
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
        report["sonar_expert_updates_in_backward"] = updates["sonar"]["backward"]
        report["sonar_expert_updates_in_step"] = updates["sonar"]["step"]
        report["sonar_expert_updates_expected"] = updates["sonar"]["expected"]
    if "sonar" in equal:
        counted = updates["sonar"]
        report["sonar_equals_control_bitwise"] = (
            counted["backward"] == counted["expected"] and counted["step"] == 0 and equal["sonar"]
        )
    if "sonar-remainder" in equal:  # its experts' fp32 masters (weight and remainder) and dense weights
        report["remainder_equals_control_bitwise"] = equal["sonar-remainder"]
    if "sonar" in report["arms"] and "standard" in report["arms"]:
        sonar_arm, standard_arm = report["arms"]["sonar"], report["arms"]["standard"]
        report["heldout"] = heldout_statistics(standard_arm["heldout_losses"], sonar_arm["heldout_losses"])
        report["heldout_loss_delta"] = report["heldout"]["mean_delta"]
        report["peak_memory_reduction"] = (
            1 - sonar_arm["peak_memory_bytes"] / standard_arm["peak_memory_bytes"] if args.memory else None
        )
        report["speedup"], report["speedup_note"] = speedup(standard_arm["step_time"], sonar_arm["step_time"])
    clipped = [name for name in ("sonar-spike", "sonar-lagged") if name in report["arms"]]
    if clipped:
        report["expert_clipping"] = {
            name: clipping_entry(name, report, updates.get(name), equal.get(name), args.memory)
            for name in clipped
        }
    if args.baseline_report is not None:
        report["spike_effect"] = spike_effect(args.baseline_report, report, args.spike_baseline)
    if "mixed-precision" in report["arms"]:  # bf16 arms against standard mixed-precision AdamW
        reference = report["arms"]["mixed-precision"]
        report["versus_mixed_precision"] = {
            name: {
                "heldout": heldout_statistics(
                    reference["heldout_losses"], arm["heldout_losses"], name=name, reference="mixed-precision"
                ),
                "peak_memory_ratio": (
                    arm["peak_memory_bytes"] / reference["peak_memory_bytes"] if args.memory else None
                ),
            }
            for name, arm in report["arms"].items()
            if name != "mixed-precision" and name not in CONTROLS.values()
        }
    for arm, suffix in (("sonar-8bit", "8bit"), ("torchao-8bit", "torchao_8bit")):
        if arm in report["arms"] and "standard" in report["arms"]:
            eight_bit, standard_arm = report["arms"][arm], report["arms"]["standard"]
            report[f"heldout_{suffix}"] = heldout_statistics(
                standard_arm["heldout_losses"], eight_bit["heldout_losses"], name=arm
            )
            report[f"peak_memory_ratio_{suffix}"] = (
                eight_bit["peak_memory_bytes"] / standard_arm["peak_memory_bytes"] if args.memory else None
            )
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
    """One arm's results over the seeds it ran: per-seed lists and their summaries (``clipping``: the
    expert-clipping arms' per-step telemetry per seed, else None)."""
    heldout = [r["heldout_loss"] for r in runs]
    clip = [r["clip_fraction"] for r in runs]
    return {
        "clipping": None if runs[0]["clipping"] is None else [r["clipping"] for r in runs],
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
