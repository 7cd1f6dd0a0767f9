"""sonar-train's command line: arguments, the run of every arm, report.json and report.png."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from sonar_kernels.ops import has_torch_fused_adamw
from sonar_kernels.ops.validation import resolve_backend
from sonar_kernels.optim import UnownedExpertsWarning
from sonar_kernels.train import checkpoint, distributed, resume
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
from sonar_kernels.train.options import check_device, parse
from sonar_kernels.train.report import TIMING_WARMUP, plot, summary_table
from sonar_kernels.train.results import assemble
from sonar_kernels.train.verdicts import check_baseline

# What sonar-train imports beyond the base package: the [train] extra (pyproject.toml).
TRAIN_EXTRA = ("transformers", "tqdm", "matplotlib")


def main(argv: list[str] | None = None) -> int:
    """``python -m sonar_kernels.train`` (``sonar-train`` parses first, without torch: ``sonar_kernels_cli``)."""
    return run(*parse(argv))


def run(parser, args) -> int:
    """Runs sonar-train on parsed options: the checks that need torch (``parser.error``, exit code 2), then
    every arm and seed, the report; exit code 2 on a usage error found on the way, 130 on Ctrl-C (a partial
    report and one line saying how to resume: :mod:`resume`)."""
    check_device(parser, args)
    missing = [name for name in TRAIN_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"sonar-train: error: {', '.join(missing)} not installed; sonar-train needs the [train] extra "
            "(sonar-kernels is not on PyPI): pip install -e '.[train]' in the sonar-kernels checkout, or "
            f"pip install {' '.join(missing)}",
            file=sys.stderr,
        )
        return 2
    args.run_dir, args.state = None, None
    # The standard arms train the "sonar" experts with torch.optim.AdamW on purpose (the baseline).
    warnings.filterwarnings("ignore", category=UnownedExpertsWarning)
    finished = True  # whether a folder this run created may be given back when nothing was kept in it
    try:
        distributed.setup(args)  # under torchrun: one rank of a data-parallel run
        return _run(args)
    except UsageError as e:
        print(f"sonar-train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        finished = False
        return resume.interrupted(args.state)
    finally:
        distributed.teardown()
        # A new run that ended before finishing any (seed, arm) gives its folder back.
        folder = args.run_dir
        if finished and args.resume is None and folder is not None and not (folder / "report.json").exists():
            kept = folder / resume.RESUME_FOLDER
            if not kept.is_dir() or [p.name for p in kept.iterdir()] == ["options.json"]:
                shutil.rmtree(kept, ignore_errors=True)
                if not any(folder.iterdir()):
                    folder.rmdir()


def _run(args) -> int:
    import transformers

    import sonar_kernels
    from sonar_kernels.integrations import transformers as hf

    preset = PRESETS[args.preset]
    device = args.device_obj
    ranks, leader = distributed.world_size(), distributed.rank() == 0
    in_backward = [
        name for name in args.arms if name in ("all-in-backward", "paper-inbwd", "per-expert-inbwd")
    ]
    if ranks > 1 and in_backward:
        raise UsageError(
            f"--arms {' '.join(in_backward)} runs on one process only: torch's AdamW updates its parameters in "
            "the backward from their local, not yet averaged, gradient"
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
    seeds = [args.seed + i for i in range(args.seeds)]
    # Every (seed, arm) the run trains, in order; the exactness controls on the first seed only.
    order = [
        (seed, name)
        for seed in seeds
        for name in args.arms
        if seed == seeds[0] or name not in CONTROLS.values()
    ]
    state = resume.RunState(None, order, resume.pairs_of(args.arms))
    if args.resume is not None:  # before anything is built: the interrupted run's options, what it finished
        if ranks > 1:
            raise UsageError("--resume runs on one process only")
        args.run_dir = state.folder = Path(args.resume)
        state.load(resume.options_of(args), _commit())
    args.state = state
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
        local_processes=local_processes(), loss_chunk_tokens=getattr(args, "loss_chunk_tokens", None),
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
    if leader and args.resume is None:  # the run's folder, reserved once the data and the model are good
        args.run_dir = state.folder = reserve_run_directory(Path(args.out), args.run_name)
        state.start(args.argv, resume.options_of(args), _commit())
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
    report["seeds"] = seeds
    report["seeds_run"] = len(seeds)
    report["resumed"] = None if args.resume is None else state.describe()
    if (
        args.baseline_report is not None
    ):  # before any training: the two runs must be the same but for the spike
        check_baseline(args.baseline_report, report, args.spike_baseline)
    state.report = report
    _train(args, state, seeds, initial, data, text, heldout, preset, dtype, device, steps, settings, estimate,
           available)  # fmt: skip
    report = assemble(report, args, state.records, order, state.memory, state.timing)
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


def _train(args, state, seeds, initial, data, text, heldout, preset, dtype, device, steps, settings, estimate,
           available) -> None:  # fmt: skip
    """Trains every (seed, arm) of ``state.order`` that has not finished, keeping each record as it finishes
    (``state.record``), and runs the memory and timing passes after the first seed's arms unless they ran."""
    from sonar_kernels.integrations import transformers as hf

    ranks, leader = distributed.world_size(), distributed.rank() == 0
    total = len(state.order)
    if state.resumed and not args.quiet:
        _say(f"sonar-train: resuming {state.folder}: {state.describe()} finished; running the rest")
    # A sonar arm and its control (arms.CONTROLS), when both run: the parameters of the first to train (first
    # seed; with fp32 masters, the masters), on the CPU, until the other has trained.
    pair_of = {name: arm for arm, control in resume.pairs_of(args.arms).items() for name in (arm, control)}
    final = {}
    for i, seed in enumerate(seeds):
        todo = [name for s, name in state.order if s == seed and (s, name) not in state.records]
        if not todo and (i > 0 or (state.memory is not None and state.timing is not None)):
            continue  # finished before the interruption
        if i > 0:  # another batch order, and without --model another initialization
            data = ByteData(text, data.sequence_length, data.batch_size, seed)
            if args.model is None:
                initial = None  # one initial model at a time (the real presets are large)
                initial = build_model(preset, args.layers, seed, dtype, torch.device("cpu"))
                hf.set_backend(initial, args.backend)
        for name in todo:
            position = state.order.index((seed, name)) + 1
            what = f"seed {seed} {name}" if len(seeds) > 1 else name
            started = time.perf_counter()
            arm = build_arm(name, initial, args, steps, count_updates=True)
            result = run_arm(arm, data, steps, args, device, heldout, f"run {position}/{total}: {what}")
            record = {"seed": seed, "arm": name, **result, "updates": None, "expert_tensors": None,
                      "checksums": None, "saved": None, "equal": None}  # fmt: skip
            if ranks > 1 and i == 0:  # the ranks' weights after training, one checksum each
                named = list(arm.model.named_parameters())
                record["checksums"] = {
                    "dense": distributed.checksums([p for n, p in named if not n.endswith(EXPERT_PARAMS)]),
                    "expert": distributed.checksums([p for n, p in named if n.endswith(EXPERT_PARAMS)]),
                }
            if name in CONTROLS:
                # The verdict means something only if every expert tensor was updated in every backward:
                # counted from the tensors' AdamW step counts, not assumed.
                record["updates"] = {"backward": int(arm.updates["backward"]), "step": int(arm.updates["step"]),
                                     "expected": steps * len(arm.optimizer.expert_tensors)}  # fmt: skip
                record["expert_tensors"] = len(arm.optimizer.expert_tensors)
            if i == 0 and name == "sonar" and args.save is not None and leader:
                checkpoint.save_model(arm.model, args.save, settings, args.quiet)
                record["saved"] = {"path": str(Path(args.save).resolve()), "arm": "sonar", "seed": seed}
            if i == 0 and name in pair_of:
                key = pair_of[name]
                if key not in final:  # the first of the two: kept until the other has trained
                    final[key] = master_values(arm)
                else:
                    kept = final.pop(key)  # compared: no copy held through the other arms and the memory pass
                    equal = all(
                        a.dtype == b.dtype and torch.equal(a, b)
                        for a, b in zip(kept, master_values(arm), strict=True)
                    )
                    record["equal"] = {"arm": key, "value": equal}
            del arm
            state.record(seed, name, record)
            if not args.quiet:
                _say(
                    f"sonar-train: run {position} of {total} finished: {what}, {time.perf_counter() - started:.1f} s "
                    f"(held-out loss {result['heldout_loss']:.4f})"
                )
        if i == 0:
            for kind in ("memory", "timing"):
                if getattr(state, kind) is not None:
                    continue  # finished before the interruption: kept
                started = time.perf_counter()
                if kind == "memory":
                    value = _memory_pass(args, initial, data, device)
                else:
                    value = list(_timing_pass(args, initial, data, device, ranks, estimate, available))
                state.record_pass(kind, value)
                if not args.quiet:
                    _say(f"sonar-train: {kind} pass finished, {time.perf_counter() - started:.1f} s")


def _say(line: str) -> None:
    """A line on stderr above the progress bars."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


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
