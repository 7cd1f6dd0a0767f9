"""sonar-train's data and model presets: the training text, byte tokens, held-out batches."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sonar_kernels_cli.options import PRESET_STEPS


@dataclass(frozen=True)
class Preset:
    """A model family and its dimensions; ``sequence_length`` and ``batch_size`` are the defaults."""

    family: str  # "olmoe", "granitemoe" or "qwen3_moe"
    hidden_size: int
    intermediate_size: int  # per expert
    num_experts: int
    top_k: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    steps: int = 200  # the default training steps (the presets below: the command line's PRESET_STEPS)
    batch_size: int = 8
    sequence_length: int = 128
    extra: dict = field(default_factory=dict)


PRESETS = {
    # Sized for a 2-core CPU: experts are ~95 % of the parameters and activation checkpointing keeps the
    # activations small, so gradients and optimizer state set the peak (the regime of real LLM training).
    "tiny-olmoe": Preset("olmoe", 128, 256, 32, 2, 4, 4, 4, 256, PRESET_STEPS["tiny-olmoe"], batch_size=4),
    "tiny-granitemoe": Preset(
        "granitemoe", 128, 256, 32, 2, 4, 4, 4, 256, PRESET_STEPS["tiny-granitemoe"], batch_size=4
    ),
    # The real dimensions (random initialisation; no hub access).
    "olmoe-1b-7b": Preset(
        "olmoe",
        2048,
        1024,
        64,
        8,
        16,
        16,
        16,
        50304,
        steps=PRESET_STEPS["olmoe-1b-7b"],
        batch_size=4,
        sequence_length=1024,
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
        steps=PRESET_STEPS["granite-3.1-3b-a800m"],
        batch_size=4,
        sequence_length=1024,
        extra={
            "embedding_multiplier": 12.0,
            "logits_scaling": 6.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.015625,
        },
    ),
    # Qwen3-30B-A3B's published configuration (its config.json): 48 layers, all sparse; head_dim 128.
    "qwen3-30b-a3b": Preset(
        "qwen3_moe",
        2048,
        768,
        128,
        8,
        48,
        32,
        4,
        151936,
        steps=PRESET_STEPS["qwen3-30b-a3b"],
        batch_size=4,
        sequence_length=1024,
        extra={
            "head_dim": 128,
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    ),
}


class UsageError(Exception):
    """A problem with the command line or the data, reported as ``sonar-train: error: ...`` (exit 2)."""


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
    if file.is_dir():
        raise UsageError(f"--data {path}: a folder; give a text or .jsonl file")
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
