"""sonar-train: train an OLMoE or Granite MoE model on real text with standard and sonar training side by side.

Three arms start from the same initial weights and see the same batches; all run the experts with the
sonar kernels (transformers' experts_implementation "sonar"), so only the optimizer differs:

- ``standard``: torch.optim.AdamW on all parameters, ``clip_grad_norm_`` over all parameters;
- ``sonar``: :class:`sonar_kernels.SonarAdamW`, expert tensors updated in the backward (no expert
  gradient kept), dense parameters clipped by their own global norm;
- ``standard-dense-clip``: torch.optim.AdamW, ``clip_grad_norm_`` over the dense parameters only: the
  same math as ``sonar`` with standard machinery, so the two must agree bit for bit.

``--arms all-in-backward`` adds the paper's other comparison (not run by default): every parameter
updated in the backward and no clipping anywhere (:class:`AllInBackward`).

Data: by default the Python reference documentation that ships with every CPython (the module
``pydoc_data.topics``, about 465 KB of English), tokenized as bytes (vocabulary 256); ``--data`` takes a
UTF-8 text file or JSONL with a "text" field. The last tenth is the held-out split.

Output, under ``runs/<name>/``: ``report.json`` (per arm: ``heldout_loss``, ``peak_memory_bytes``,
``peak_memory``, ``step_time_s``, ``train_losses``, ``clip_fraction``; top level:
``sonar_equals_control_bitwise``), ``report.png`` (loss curves and memory bars) and the printed summary.
Peak memory is measured in a separate short pass per arm (after two warm-up steps, so that the optimizer
state exists), with torch's MemTracker, which splits it into parameters, gradients, optimizer state and
activations and tells whether the peak falls in the forward, the backward or the optimizer step; on CUDA
the allocator's peak is reported as well.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

ARMS = ("standard", "sonar", "standard-dense-clip")
OTHER_ARMS = ("all-in-backward",)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
LR_FLOOR = 0.1  # the cosine schedule ends at this fraction of --lr


@dataclass(frozen=True)
class Preset:
    """A model family and its dimensions; ``sequence_length`` and ``batch_size`` are the defaults."""

    family: str  # "olmoe" or "granitemoe"
    hidden_size: int
    intermediate_size: int  # per expert
    num_experts: int
    top_k: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    steps: int = 300
    batch_size: int = 8
    sequence_length: int = 128
    extra: dict = field(default_factory=dict)


PRESETS = {
    # Sized for a 2-core CPU: experts are ~95 % of the parameters and activation checkpointing keeps the
    # activations small, so gradients and optimizer state set the peak (the regime of real LLM training).
    "tiny-olmoe": Preset("olmoe", 128, 256, 32, 2, 4, 4, 4, 256, batch_size=4),
    "tiny-granitemoe": Preset("granitemoe", 128, 256, 32, 2, 4, 4, 4, 256, batch_size=4),
    # The real dimensions (random initialisation; no hub access).
    "olmoe-1b-7b": Preset(
        "olmoe", 2048, 1024, 64, 8, 16, 16, 16, 50304, steps=20, batch_size=4, sequence_length=1024
    ),
    "granite-3.1-3b-a800m": Preset(
        "granitemoe",
        1536,
        512,
        40,
        8,
        32,
        24,
        8,
        49155,
        steps=20,
        batch_size=4,
        sequence_length=1024,
        extra={
            "embedding_multiplier": 12.0,
            "logits_scaling": 6.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.015625,
        },
    ),
}


class UsageError(Exception):
    """A problem with the command line or the data, reported as ``sonar-train: error: ...`` (exit 2)."""


# ----------------------------------------------------------------------------------------------- data


def default_text() -> str:
    """The reference documentation in ``pydoc_data.topics``, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def load_text(path: str | None) -> str:
    """The training text: ``path`` (UTF-8 text, or JSONL whose lines have a "text" field), or the default.

    Raises:
        UsageError: a missing, unreadable, empty or non-UTF-8 file, or JSONL without "text" fields.
    """
    if path is None:
        return default_text()
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--data {path}: no such file")
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"--data {path}: not UTF-8 text (byte {e.start}: {raw[e.start : e.start + 1]!r})"
        ) from None
    if file.suffix == ".jsonl":
        pieces = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"--data {path}: line {number} is not JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise UsageError(f'--data {path}: line {number} has no "text" string')
            pieces.append(record["text"])
        text = "\n\n".join(pieces)
    if not text.strip():
        raise UsageError(f"--data {path}: the file holds no text")
    return text


class ByteData:
    """Bytes of the text as token ids; the last tenth is held out. Batches are windows of
    ``sequence_length`` tokens at positions drawn from a generator seeded by (seed, step), so every arm
    sees the same batches."""

    def __init__(self, text: str, sequence_length: int, batch_size: int, seed: int):
        tokens = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        split = len(tokens) - len(tokens) // 10
        self.train, self.heldout = tokens[:split], tokens[split:]
        for name, part in (("training", self.train), ("held-out", self.heldout)):
            if len(part) < sequence_length + 1:
                raise UsageError(
                    f"the {name} split has {len(part)} tokens (bytes), fewer than --seq-len {sequence_length} + 1; "
                    "give more text or a shorter --seq-len"
                )
        self.sequence_length, self.batch_size, self.seed = sequence_length, batch_size, seed

    def batch(self, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(
            0, len(self.train) - self.sequence_length, (self.batch_size,), generator=generator
        )
        return torch.stack([self.train[s : s + self.sequence_length] for s in starts.tolist()])

    def heldout_batches(self, count: int | None = None) -> list[torch.Tensor]:
        """Up to ``count`` (None: all) batches of consecutive, non-overlapping held-out windows."""
        n = self.sequence_length
        windows = [self.heldout[i : i + n] for i in range(0, len(self.heldout) - n + 1, n)]
        batches = [windows[i : i + self.batch_size] for i in range(0, len(windows), self.batch_size)]
        return [torch.stack(b) for b in batches[:count]]  # count None: all


# ---------------------------------------------------------------------------------------------- model


def build_model(preset: Preset, layers: int | None, seed: int, dtype: torch.dtype, device: torch.device):
    """The preset's transformers model with experts_implementation "sonar", randomly initialised."""
    import transformers

    common = {
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": layers or preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "num_experts_per_tok": preset.top_k,
        "max_position_embeddings": 4096,
        "output_router_logits": True,  # the load-balancing loss is part of the training loss
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "tie_word_embeddings": False,
        **preset.extra,
    }
    if preset.family == "olmoe":
        config = transformers.OlmoeConfig(num_experts=preset.num_experts, **common)
        cls = transformers.OlmoeForCausalLM
    else:
        config = transformers.GraniteMoeConfig(num_local_experts=preset.num_experts, **common)
        cls = transformers.GraniteMoeForCausalLM
    config._experts_implementation = "sonar"
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    # Initialised where it trains, in its dtype (a 7B model on a GPU, without an fp32 copy first).
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        torch.set_default_dtype(dtype)
        try:
            model = cls(config)
        finally:
            torch.set_default_dtype(default_dtype)
    return model.to(dtype=dtype)


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of every decoder layer (transformers' own)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def dense_parameters(model) -> list[torch.Tensor]:
    return [p for name, p in model.named_parameters() if not name.endswith(EXPERT_PARAMS)]


class AllInBackward:
    """Every parameter updated in the backward, no clipping anywhere (the paper's other comparison): the
    expert tensors by :class:`sonar_kernels.ExpertAdamW` (the fused wgrad epilogue on the triton backend),
    each other trainable parameter by its own torch.optim.AdamW from a post-accumulate-grad hook, its
    gradient released right after (torch's optimizer-in-backward recipe). ``step()`` ends the step."""

    def __init__(self, model, hyper: dict, flags: dict):
        import sonar_kernels

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.experts = sonar_kernels.ExpertAdamW([p for n, p in named if n.endswith(EXPERT_PARAMS)], **hyper)
        self.dense = {
            p: torch.optim.AdamW([p], **hyper, **flags) for n, p in named if not n.endswith(EXPERT_PARAMS)
        }
        # The hooks hold the optimizers weakly: a hook that refers back to its parameter (through
        # self.dense) would keep the model and the optimizer state alive for good.
        ref = weakref.ref(self)
        for p in self.dense:
            p.register_post_accumulate_grad_hook(functools.partial(_all_in_backward_update, ref))

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.experts, *self.dense.values()]

    def step(self) -> None:
        self.experts.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.experts.zero_grad(set_to_none)


def _all_in_backward_update(ref, p: torch.Tensor) -> None:
    owner = ref()
    if owner is not None:
        owner.dense[p].step()
        p.grad = None


@dataclass
class Arm:
    name: str
    model: object
    optimizer: object  # a torch.optim.Optimizer, or AllInBackward
    schedulers: list
    clip_params: list[torch.Tensor] | None  # None: SonarAdamW clips in step(), or nothing is clipped

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return getattr(self.optimizer, "optimizers", [self.optimizer])


def build_arm(name: str, initial, args, steps: int) -> Arm:
    import sonar_kernels

    model = copy.deepcopy(initial).to(args.device_obj)
    if args.checkpointing:
        enable_checkpointing(model)
    model.train()
    hyper = {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    flags = {"foreach": args.foreach, "fused": args.fused}
    clip = None
    if name == "sonar":
        optimizer = sonar_kernels.SonarAdamW(model, **hyper, **flags, max_grad_norm=args.max_grad_norm)
    elif name == "all-in-backward":
        optimizer = AllInBackward(model, hyper, flags)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **hyper, **flags)
        clip = list(model.parameters()) if name == "standard" else dense_parameters(model)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, steps // 10)

    def schedule(step):  # linear warm-up, then cosine decay to LR_FLOOR
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))

    arm = Arm(name, model, optimizer, [], clip)
    arm.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in arm.optimizers]
    return arm


def train_step(
    arm: Arm, tokens: torch.Tensor, max_grad_norm: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step; returns (loss, norm used for clipping, None when nothing is clipped) as device
    tensors (no host sync)."""
    loss = arm.model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    norm = None
    if arm.clip_params is not None:
        norm = torch.nn.utils.clip_grad_norm_(arm.clip_params, max_grad_norm)
    arm.optimizer.step()
    if arm.name == "sonar":
        norm = arm.optimizer.last_dense_grad_norm
    for scheduler in arm.schedulers:
        scheduler.step()
    arm.optimizer.zero_grad(set_to_none=True)
    return loss.detach(), None if norm is None else norm.detach()


@torch.no_grad()
def heldout_loss(model, batches: list[torch.Tensor]) -> float:
    """Mean next-byte cross-entropy (nats) over the held-out batches, without the load-balancing loss."""
    model.eval()
    total = 0.0
    for tokens in batches:
        total += float(model(input_ids=tokens, labels=tokens, output_router_logits=False).loss)
    model.train()
    return total / len(batches)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_arm(arm: Arm, data: ByteData, steps: int, args, device: torch.device, heldout) -> dict:
    from tqdm import tqdm

    losses, norms, times = [], [], []
    for step in tqdm(range(steps), desc=f"{arm.name:>19}", unit="step", file=sys.stderr, disable=args.quiet):
        tokens = data.batch(step).to(device)
        _sync(device)
        start = time.perf_counter()
        loss, norm = train_step(arm, tokens, args.max_grad_norm)
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss)
        norms.append(norm)
    losses = [float(x) for x in losses]
    norms = None if norms[0] is None else [float(x) for x in norms]
    timed = times[3:] if len(times) > 3 else times
    return {
        "train_losses": losses,
        "heldout_loss": heldout_loss(arm.model, heldout),
        # clip_grad_norm_ scales by max / (norm + 1e-6): the gradients change when that is below 1.
        "clip_fraction": 0.0
        if norms is None
        else sum(n + 1e-6 > args.max_grad_norm for n in norms) / len(norms),
        "grad_norms": norms,
        "step_time_s": statistics.median(timed),
    }


# --------------------------------------------------------------------------------------------- memory

CATEGORIES = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporary",
    "Other": "other",
}
# MemTracker counts every tensor allocated inside optimizer.step() as optimizer state; the part beyond the
# state itself (exp_avg, exp_avg_sq, step) is the step's temporaries, reported apart.
STEP_TEMPORARIES = "optimizer_step_temporaries"
LABELS = (*CATEGORIES.values(), STEP_TEMPORARIES)


def measure_memory(name: str, initial, data: ByteData, args, device: torch.device) -> dict:
    """Peak bytes of one training step of arm ``name`` (after two untracked warm-up steps), by category,
    and the phase of the step in which the peak falls."""
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    arm = build_arm(name, initial, args, steps=3)
    for step in range(2):
        train_step(arm, data.batch(step).to(device), args.max_grad_norm)
    tokens = data.batch(2).to(device)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    tracker = MemTracker()
    tracker.track_external(arm.model, *arm.optimizers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracker:
            train_step(arm, tokens, args.max_grad_norm)
    _sync(device)
    snapshot = tracker.get_tracker_snapshot("peak")
    tracked = next(
        d for d in snapshot if d.type == device.type and (device.index is None or d.index == device.index)
    )
    peak = snapshot[tracked]
    breakdown = {label: int(peak.get(key, 0)) for key, label in CATEGORIES.items()}
    state_bytes = sum(
        t.numel() * t.element_size()
        for optimizer in arm.optimizers
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.device.type == device.type
    )
    breakdown[STEP_TEMPORARIES] = max(0, breakdown["optimizer_state"] - state_bytes)
    breakdown["optimizer_state"] -= breakdown[STEP_TEMPORARIES]
    total = int(peak["Total"])
    stats = tracker.memory_tracking[arm.model].snapshots
    phase = "optimizer step"
    for state, label in ((_ModState.PEAK_FW, "forward"), (_ModState.PEAK_BW, "backward")):
        if any(int(snap[tracked]["Total"]) == total for snap in stats.get(state, []) if tracked in snap):
            phase = label
    result = {"peak_memory_bytes": total, "peak_memory": breakdown, "peak_phase": phase}
    if device.type == "cuda":
        result["cuda_allocator_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
        result["cuda_allocated_before_step_bytes"] = int(base)
    del arm
    return result


# --------------------------------------------------------------------------------------------- report


def summary_table(report: dict) -> str:
    arms = report["arms"]
    std = arms.get("standard")
    lines = [
        f"{'arm':<20} {'held-out loss':>13} {'vs standard':>11} {'peak MiB':>9} {'vs standard':>11} "
        f"{'peak in':>14} {'step ms':>8} {'speedup':>7} {'clipped':>7}"
    ]
    for name, r in arms.items():
        d_loss = r["heldout_loss"] - std["heldout_loss"] if std else float("nan")
        d_mem = (
            100 * (r["peak_memory_bytes"] / std["peak_memory_bytes"] - 1)
            if std and std["peak_memory_bytes"]
            else float("nan")
        )
        speedup = std["step_time_s"] / r["step_time_s"] if std else float("nan")
        lines.append(
            f"{name:<20} {r['heldout_loss']:>13.4f} {d_loss:>+11.4f} {r['peak_memory_bytes'] / 2**20:>9.2f} "
            f"{d_mem:>+10.1f}% {r['peak_phase']:>14} {1000 * r['step_time_s']:>8.1f} {speedup:>6.2f}x "
            f"{100 * r['clip_fraction']:>6.0f}%"
        )
    lines.append("")
    lines.append("peak memory by category (MiB): " + ", ".join(LABELS))
    for name, r in arms.items():
        parts = " ".join(f"{r['peak_memory'][c] / 2**20:8.2f}" for c in LABELS)
        lines.append(f"  {name:<20} {parts}")
    verdict = report.get("sonar_equals_control_bitwise")
    if verdict is not None:
        lines.append("")
        lines.append(
            f"sonar and standard-dense-clip bitwise identical (all parameters after training): {verdict}"
        )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"standard": "-", "sonar": "--", "standard-dense-clip": ":", "all-in-backward": "-."}
    for name, r in arms.items():
        left.plot(
            r["train_losses"], styles.get(name, "-"), label=f"{name} (held-out {r['heldout_loss']:.3f})"
        )
    left.set_xlabel("step")
    left.set_ylabel("training loss (nats per byte, incl. load balancing)")
    left.set_title(f"{report['preset']}: training loss")
    left.legend()
    bottom = [0.0] * len(arms)
    names = list(arms)
    for category in LABELS:
        values = [arms[n]["peak_memory"][category] / 2**20 for n in names]
        if any(values):
            right.bar(names, values, bottom=bottom, label=category)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_ylabel("MiB at the step's peak")
    right.set_title(f"peak memory ({report['device']})")
    right.legend(loc="lower center", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="sonar-train",
        description="Train an MoE model with standard and sonar training side by side (see the module docstring).",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny-olmoe")
    parser.add_argument("--layers", type=int, help="number of decoder layers (default: the preset's)")
    parser.add_argument(
        "--data", help="UTF-8 text file, or .jsonl with a 'text' field (default: pydoc_data.topics)"
    )
    parser.add_argument("--steps", type=int, help="training steps per arm (default: the preset's)")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, help="linear LR warm-up (default: a tenth of the steps)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument(
        "--heldout-batches", type=int, help="held-out batches to evaluate (default: the whole split)"
    )
    parser.add_argument("--seed", type=int, default=0)
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
    parser.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.optim.AdamW's flag, the same in every arm (default: on for CUDA, off on CPU)")  # fmt: skip
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory pass")
    parser.add_argument("--out", default="runs", help="output folder (default: runs)")
    parser.add_argument("--name", help="run name (default: the preset)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    for name in ("layers", "steps", "batch_size", "seq_len", "heldout_batches"):
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except UsageError as e:
        print(f"sonar-train: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    import transformers

    import sonar_kernels
    from sonar_kernels.integrations import transformers as hf

    preset = PRESETS[args.preset]
    device = args.device_obj
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
    hf.register(args.backend)
    initial = build_model(preset, args.layers, args.seed, dtype, torch.device("cpu"))  # copied per arm
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
        "backend": args.backend,
        "data": args.data or "pydoc_data.topics",
        "train_tokens": len(data.train),
        "heldout_tokens": len(data.heldout),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sonar_kernels": sonar_kernels.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "arms": {},
    }
    final = {}  # the compared arms' parameters after training, on the CPU
    for name in args.arms:
        arm = build_arm(name, initial, args, steps)
        report["arms"][name] = run_arm(arm, data, steps, args, device, heldout)
        if name == "sonar":
            # The verdict means something only if SonarAdamW updated every expert tensor in the backward.
            managed = [p for p in arm.model.parameters() if p in arm.optimizer._managed]
            report["sonar_expert_tensors_updated_in_backward"] = len(managed)
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
    out = Path(args.out) / (args.name or args.preset)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "report.png")
    print(summary_table(report))
    print(f"\nwrote {out / 'report.json'} and {out / 'report.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
