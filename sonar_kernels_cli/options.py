"""sonar-train's options: the command line, its defaults and the checks that need no torch (errors name
the option before anything is imported or runs). The checks that need torch (the device) follow in
``sonar_kernels.train.options``, once the parse has succeeded."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

# The names the parser offers, defined here so that --help and argument errors answer without importing
# torch (importing anything under sonar_kernels imports torch); the training package imports them from
# here: the arms (sonar_kernels.train.arms), the clipping arms and SPAM's default threshold theta (Huang et
# al., ICLR 2025, arXiv 2501.06842: an element is a spike when its squared gradient exceeds theta times its
# second moment; train/clipping.py), the presets' default steps (train/data.py's PRESETS) and the timing
# warm-up (train/stats.py).
ARMS = ("standard", "sonar", "standard-dense-clip")
MASTER_ARMS = ("mixed-precision", "sonar-remainder", "sonar-stochastic", "sonar-remainder-8bit",
               "sonar-stochastic-8bit", "remainder-control")  # fmt: skip
CLIPPING_ARMS = ("sonar-spike", "spike-control", "sonar-lagged", "lagged-control")
# paper-inbwd and per-expert-inbwd: the paper's method with torch's AdamW from each expert tensor's (or expert
# slice's) post-accumulate-grad hook (train/in_backward.py); bench/gpu_bench.py's model section runs them.
OTHER_ARMS = ("all-in-backward", "paper", "paper-inbwd", "per-expert-inbwd", "sonar-8bit", "torchao-8bit",
              *MASTER_ARMS, *CLIPPING_ARMS)  # fmt: skip
PRESET_STEPS = {"tiny-olmoe": 200, "tiny-granitemoe": 200, "olmoe-1b-7b": 20, "granite-3.1-3b-a800m": 20,
                "qwen3-30b-a3b": 20}  # fmt: skip
SPIKE_THRESHOLD = 5000.0
TIMING_WARMUP = 5

# Exit code of a run ended by Ctrl-C (SIGINT), the shells' 128 + 2 (the launcher's and train/resume.py's).
INTERRUPTED = 130
# Where a run folder keeps what --resume reads: the options and every finished (seed, arm) (train/resume.py).
RESUME_FOLDER = "resume"
# The options that do not change what a run computes: free to differ between a run and its resumption.
RESUME_FREE = ("quiet", "out", "name", "resume", "memory_check")

# Held-out batches evaluated by default: enough that the evaluation costs a few training steps per arm.
HELDOUT_BATCHES = 32


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where one is set and the help text does not describe it already."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """sonar-train's argument parser (no checks beyond argparse's own: :func:`parse`)."""
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
    parser.add_argument("--preset", choices=sorted(PRESET_STEPS), default="tiny-olmoe",
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
                        "clipped, the paper's other comparison; paper-inbwd and per-expert-inbwd: the paper's method with "
                        "torch's AdamW stepping each expert tensor (or each expert slice, the paper's ablation) from its "
                        "gradient hook, the dense parameters clipped by their own norm; sonar-8bit: sonar with 8-bit moments (--moments); torchao-8bit: "
                        "standard training with torchao's AdamW8bit for the experts (the anchor of --moments 8bit)")  # fmt: skip
    parser.add_argument("--moments", choices=("exact", "8bit"), default="exact",
                        help="8bit: also train the sonar-8bit arm, SonarAdamW(moments_dtype=\"8bit\"), whose expert "
                        "moments are 8-bit codes and block scales updated in the backward (docs/usage.md), and, when torchao is "
                        "installed, the torchao-8bit arm")  # fmt: skip
    parser.add_argument("--master-weights", nargs="+", choices=("remainder", "stochastic"), default=[],
                        help="with --dtype bfloat16: also train sonar-remainder and/or sonar-stochastic, "
                        "SonarAdamW(master_weights=...) whose bf16 experts keep an fp32 master as a 16-bit remainder or "
                        "are rounded stochastically (docs/usage.md; with --moments 8bit also their 8-bit-moments arms), "
                        "beside mixed-precision (standard AdamW on fp32 master copies of every parameter, their "
                        "reference) and, for remainder, remainder-control (its bitwise control, first seed)")  # fmt: skip
    parser.add_argument("--expert-clipping", nargs="+", choices=("spike", "lagged"), default=[],
                        help="also train sonar-spike and/or sonar-lagged, SonarAdamW(expert_clipping=...) whose "
                        "in-backward expert update clips: spike, SPAM's rule (an element with g^2 > THETA v, v its "
                        "exp_avg_sq before the update, replaced by sign(g) sqrt(THETA v); --spike-threshold), the "
                        "dense gradients clipped by their own norm as in sonar; lagged, the expert gradients "
                        "multiplied by the clipping coefficient of the previous step's global norm over all "
                        "parameters (--max-grad-norm; 1 at the first step), the dense ones clipped by this step's. "
                        "Each with its control on the first seed (spike-control, lagged-control: materialized "
                        "gradients, the rule applied by hand before torch.optim.AdamW), which must equal it bit "
                        "for bit")  # fmt: skip
    parser.add_argument("--spike-threshold", type=float, metavar="THETA",
                        help=f"SPAM's threshold theta of the sonar-spike arm and its control (default: {SPIKE_THRESHOLD:g}, "
                        "the SPAM paper's)")  # fmt: skip
    parser.add_argument("--inject-spike", type=_injected_spike, metavar="STEP:SCALE",
                        help="multiply the loss of training step STEP (1 to the run's steps, as the report counts "
                        "them) by SCALE (a finite number > 0) in every arm and seed before its backward, so that "
                        "every arm sees the same gradient spike; the training loss recorded at that step is the "
                        "multiplied one. The memory and timing passes inject nothing")  # fmt: skip
    parser.add_argument("--spike-baseline", metavar="REPORT",
                        help="with --inject-spike: the report.json of the same run without it (same model, data, "
                        "steps, seeds and settings): the report adds, per arm, the held-out loss with the spike "
                        "minus without it, paired over the seeds, with its verdict (whether the spike hurt)")  # fmt: skip
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
    parser.add_argument("--loss-chunk-tokens", type=int, metavar="N",
                        help="the causal-LM loss over chunks of N tokens (sonar_kernels.train.loss): one chunk's "
                        "logits [N, vocabulary] alive at a time instead of all tokens' (default: transformers' "
                        "loss)")  # fmt: skip
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
    parser.add_argument("--resume", metavar="DIR",
                        help="finish the interrupted run in DIR (an --out/NAME folder; Ctrl-C prints it): its finished "
                        "(seed, arm) runs, memory pass and timing pass are loaded, only the missing ones run, and the "
                        "full report is written as an uninterrupted run writes it. The run's options are read from "
                        "DIR; options given as well must equal them (refused, naming what differs, otherwise)")  # fmt: skip
    return parser


def parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the parsed options, checked as far as no torch is needed (the device and the backend's
    interpreter are checked by ``sonar_kernels.train.options.parse_args``). With ``--resume DIR`` the options
    are those of the interrupted run in DIR (read from DIR/resume/options.json) followed by ``argv``, so that
    an option given again overrides the stored one (and is then compared with it before anything runs).

    Exits with code 2 (argparse's ``parser.error``) on a bad option; ``--help`` exits with code 0.
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.resume is not None:
        stored = _interrupted_argv(parser, args.resume)
        args = parser.parse_args(stored + argv)
        # Before the checks below: an option changed here could fail a check of another option first.
        _refuse_changed(parser, args.resume, parser.parse_args(stored), args)
        args.argv = argv
    return parser, _check(parser, args)


def _refuse_changed(
    parser: argparse.ArgumentParser, folder: str, stored: argparse.Namespace, args: argparse.Namespace
) -> None:
    """``parser.error`` (exit code 2) naming each option of ``args`` (the interrupted run's, with those given
    again) that differs from the interrupted run's ``stored``, except :data:`RESUME_FREE`."""
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    differ = [
        f"{flags.get(key, '--' + key.replace('_', '-'))} {value!r} here, {getattr(stored, key, None)!r} there"
        for key, value in sorted(vars(args).items())
        if key not in RESUME_FREE and value != getattr(stored, key, None)
    ]
    if differ:
        parser.error(
            f"--resume {folder}: the options differ from the interrupted run's ({'; '.join(differ)}); resume "
            "with its options (sonar-train --resume DIR alone reads them)"
        )


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    for name in ("layers", "steps", "seeds", "batch_size", "seq_len", "ep", "loss_chunk_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.timing_rounds < 0:
        parser.error(f"--timing-rounds must be >= 0, got {args.timing_rounds}")
    steps = args.steps or PRESET_STEPS[args.preset]
    if args.warmup_steps is not None and args.warmup_steps > steps:
        parser.error(f"--warmup-steps {args.warmup_steps} is more than the {steps} training steps")
    torchao = importlib.util.find_spec("torchao") is not None
    if "torchao-8bit" in args.arms and not torchao:
        parser.error("--arms torchao-8bit needs torchao (pip install torchao)")
    if args.moments == "8bit":
        for arm in ("sonar-8bit", "torchao-8bit") if torchao else ("sonar-8bit",):
            if arm not in args.arms:
                args.arms.append(arm)
        if not torchao:
            print("sonar-train: torchao is not installed, so the torchao-8bit arm (the anchor of --moments 8bit) "
                  "does not run (pip install torchao)", file=sys.stderr)  # fmt: skip
    for mode in args.master_weights:
        wanted = ["mixed-precision", f"sonar-{mode}"] + (["remainder-control"] if mode == "remainder" else [])
        wanted += [f"sonar-{mode}-8bit"] if args.moments == "8bit" else []
        args.arms += [arm for arm in wanted if arm not in args.arms]
    for mode in args.expert_clipping:
        args.arms += [arm for arm in (f"sonar-{mode}", f"{mode}-control") if arm not in args.arms]
    spiking = [arm for arm in ("sonar-spike", "spike-control") if arm in args.arms]
    if args.spike_threshold is None:
        args.spike_threshold = SPIKE_THRESHOLD
    elif not spiking:
        parser.error("--spike-threshold applies to the sonar-spike arm: add --expert-clipping spike")
    elif not (args.spike_threshold > 0 and math.isfinite(args.spike_threshold)):
        parser.error(f"--spike-threshold must be a finite number > 0, got {args.spike_threshold}")
    if args.inject_spike is not None and not 1 <= args.inject_spike[0] <= steps:
        parser.error(
            f"--inject-spike {args.inject_spike[0]}:{args.inject_spike[1]:g}: step {args.inject_spike[0]} is not "
            f"one of the run's training steps (1 to {steps})"
        )
    args.baseline_report = None
    if args.spike_baseline is not None:
        if args.inject_spike is None:
            parser.error(
                "--spike-baseline compares a run with --inject-spike to one without: add --inject-spike"
            )
        args.baseline_report = _baseline_report(parser, args.spike_baseline)
    bf16_only = [arm for arm in args.arms if arm in MASTER_ARMS]
    if bf16_only and args.dtype != "bfloat16":
        parser.error(
            f"{', '.join(bf16_only)} train{'s' if len(bf16_only) == 1 else ''} bf16 weights with fp32 masters: "
            "add --dtype bfloat16"
        )
    repeated = sorted({arm for arm in args.arms if args.arms.count(arm) > 1})
    if repeated:
        parser.error(f"--arms: {', '.join(repeated)} given more than once")
    if args.model is not None and args.layers is not None:
        parser.error("--layers does not apply to --model: a checkpoint has its own layers")
    if args.save is not None:
        if "sonar" not in args.arms:
            parser.error("--save saves the sonar arm's model: add sonar to --arms")
        save = Path(args.save)
        # A resumed run's folder may hold the model its sonar arm saved before the interruption.
        if args.resume is None and save.exists() and (not save.is_dir() or any(save.iterdir())):
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
    if args.device is not None and re.fullmatch(r"(cpu|cuda)(:\d+)?", args.device) is None:
        parser.error(f"--device {args.device!r}: not a device sonar-train runs on (cpu, cuda, cuda:N)")
    out = Path(args.out)
    args.run_name = args.name or (Path(args.model).resolve().name if args.model else args.preset)
    for path in (out, out / args.run_name):
        if path.exists() and not path.is_dir():
            parser.error(f"--out: {path} exists and is not a folder")
    return args


def _injected_spike(text: str) -> tuple[int, float]:
    """``--inject-spike STEP:SCALE`` as (STEP, SCALE): STEP an integer (checked against the run's steps
    after parsing), SCALE a finite number > 0.

    Raises:
        argparse.ArgumentTypeError: another form, with what was expected.
    """
    step, colon, scale = text.partition(":")
    if not colon:
        raise argparse.ArgumentTypeError(f"expected STEP:SCALE (e.g. 60:1000), got {text!r}")
    try:
        step = int(step)
    except ValueError:
        raise argparse.ArgumentTypeError(f"STEP must be an integer, got {step!r} in {text!r}") from None
    try:
        scale = float(scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"SCALE must be a number, got {scale!r} in {text!r}") from None
    if not (scale > 0 and math.isfinite(scale)):
        raise argparse.ArgumentTypeError(f"SCALE must be a finite number > 0, got {scale:g} in {text!r}")
    return step, scale


def _baseline_report(parser: argparse.ArgumentParser, path: str) -> dict:
    """The ``--spike-baseline`` report: a sonar-train report.json of a run without ``--inject-spike`` (its
    settings are checked against this run's in ``cli``, once they are resolved)."""
    try:
        report = json.loads(Path(path).read_text())
    except FileNotFoundError:
        parser.error(f"--spike-baseline {path}: no such file")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        parser.error(f"--spike-baseline {path}: not a readable report.json ({e})")
    if not isinstance(report, dict) or not isinstance(report.get("arms"), dict) or "steps" not in report:
        parser.error(f"--spike-baseline {path}: not a sonar-train report.json")
    if report.get("inject_spike") is not None:
        spike = report["inject_spike"]
        parser.error(
            f"--spike-baseline {path}: that run injected a spike too (step {spike['step']}, x{spike['scale']:g}); "
            "give the report of the same run without --inject-spike"
        )
    return report


def _interrupted_argv(parser: argparse.ArgumentParser, folder: str) -> list[str]:
    """The command line of the interrupted run in ``folder`` (its resume/options.json), less ``--quiet``."""
    path = Path(folder) / RESUME_FOLDER / "options.json"
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        parser.error(
            f"--resume {folder}: no {RESUME_FOLDER}/options.json there; not the folder of a sonar-train run"
        )
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        parser.error(f"--resume {folder}: {path} is not readable ({e})")
    report = Path(folder) / "report.json"
    if report.exists() and "partial" not in json.loads(report.read_text()):
        parser.error(f"--resume {folder}: that run finished (its report.json is complete); nothing to resume")
    # Whether the bars show is the resumed run's own choice.
    return [arg for arg in stored["argv"] if arg != "--quiet"]
