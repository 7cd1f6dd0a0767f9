"""What a prediction takes and gives: the step to predict (:class:`Setup`: the model, the batch, the method,
the precision), the ranks (:class:`Layout`), the result (:class:`Prediction`), and the constants the terms share."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sonar_kernels.train.data import Preset


METHODS = ("standard", "paper", "sonar")
ADAMW = ("single", "foreach", "fused")  # torch.optim.AdamW's implementations (foreach=, fused=)
CATEGORIES = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "optimizer_step_temporaries",
    "activations_and_temporaries",
)
FP32 = 4
INT64 = 8
INT32 = 4
# DistributedDataParallel's gradient buckets: the first holds about 1 MiB, the others 25 MiB
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, DDP's bucket_cap_mb).
DDP_FIRST_BUCKET = 1024 * 1024
DDP_BUCKET = 25 * 1024 * 1024
# The Triton dHpre kernel's column tile (sonar_kernels.kernels.expert_mlp_bwd.DHPRE_CONFIG["BLOCK_N"]):
# its routing-weight partial sums have cdiv(I, 64) rows of S fp32.
DHPRE_BLOCK_N = 64


def with_layers(preset: Preset, layers: int | None = None) -> Preset:
    """A ``sonar_kernels.train.data.Preset`` with ``layers`` decoder layers (all of them when None): the
    dimensions memory depends on are the preset's own fields."""
    return dataclasses.replace(preset, num_layers=layers or preset.num_layers)


def head_dim(d: Preset) -> int:
    """The attention heads' width: the config's ``head_dim`` where the preset sets it (Qwen3-30B-A3B's 128,
    ``sonar_kernels/train/data.py``), else hidden_size / num_heads, as the transformers attention modules read
    it (``getattr(config, "head_dim", hidden_size // num_attention_heads)``)."""
    return d.extra.get("head_dim") or d.hidden_size // d.num_heads


@dataclass(frozen=True)
class Layout:
    """How the ranks split the model: ``dp`` data-parallel replicas, ``ep`` expert-parallel ranks (the
    experts split E / ep over them; ``ep`` x ``dp`` ranks in all), or ``fsdp`` FSDP2 ranks (every
    parameter sharded on its first dimension), or ``ep`` = ``fsdp``: expert parallelism with the dense
    layers on FSDP2 over the same ranks (docs/distributed.md, "Expert parallel with the dense layers on
    FSDP2": the experts E / ep per rank and held whole, every other parameter sharded)."""

    dp: int = 1
    ep: int = 1
    fsdp: int = 1

    def __post_init__(self):
        if min(self.dp, self.ep, self.fsdp) < 1:
            raise ValueError(f"a layout needs sizes >= 1, got {self}")
        if self.fsdp > 1 and (self.dp > 1 or self.ep not in (1, self.fsdp)):
            raise ValueError("FSDP2 is modelled alone or with ep equal to it (no dp besides it)")

    @property
    def ranks(self) -> int:
        return self.fsdp if self.fsdp > 1 else self.dp * self.ep

    @property
    def name(self) -> str:
        if self.fsdp > 1 and self.ep > 1:
            return f"EP {self.ep} x FSDP2-dense {self.fsdp}"
        if self.fsdp > 1:
            return f"FSDP2 {self.fsdp}"
        if self.ep > 1 and self.dp > 1:
            return f"EP {self.ep} x DP {self.dp}"
        if self.ep > 1:
            return f"EP {self.ep}"
        if self.dp > 1:
            return f"DP {self.dp}"
        return "1 rank"


@dataclass(frozen=True)
class Setup:
    """One training step to predict, per rank.

    Args:
        dims: the model.
        batch_size, sequence_length: this rank's batch (tokens T = batch_size * sequence_length).
        method: "standard", "paper" or "sonar" (the package docstring, memory_model/__init__.py).
        layout: the ranks.
        param_bytes: bytes per parameter, gradient and AdamW moment (torch keeps the moments in the
            parameter's dtype): 4 (fp32), 2 (bf16).
        compute_bytes: bytes per activation element; None: ``param_bytes`` (the model run in its own
            dtype, as sonar-train runs it: what the op-by-op account and the validation cover). 2 with
            ``param_bytes`` 4: fp32 master weights with bf16 activations. Under FSDP2 that is
            ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` over fp32 sharded parameters,
            modelled op by op (``_predict_fsdp``); in the other layouts it is composed from the two (the
            parameter-shaped terms in fp32, the activation terms of the bf16 model; autocast's bf16
            weight copies and fp32 residual stream are not modelled).
        checkpointing: non-reentrant activation checkpointing of every decoder layer (sonar-train's
            default).
        adamw: torch.optim.AdamW's implementation: "single" (the CPU default), "foreach" (the CUDA default),
            "fused" (sonar-train's choice on CUDA). The paper's in-backward update uses the same.
        backend: the expert MLP's backend: "torch" (the CPU path) or "triton".
        tracker: model what torch's MemTracker reports instead of the allocated bytes: DDP's gradient
            buckets, allocated before the step, appear when the backward first writes them; inside a
            ``sonar_kernels::`` custom op (the standard arm's backward jobs ``moe_mlp_bwd`` and
            ``expert_wgrad``) only its outputs are seen.
        expert_rows: per layer, the rows this rank's experts receive under expert parallelism (None:
            balanced routing, T * top_k each, the average).
        collectives: "nccl" or "gloo" (whose reduce-scatter, which FSDP2 uses, works on a copy of its input).
        moments: "exact" (AdamW's moments in the parameter dtype) or "8bit" (the expert tensors' moments
            as 8-bit codes and fp32 scales per 32 elements, ``sonar_kernels/rules/moments_8bit.py``: 2.25
            bytes per expert parameter; the torch backend's update chunked whatever ``adamw``; validated
            against MemTracker on one rank, tests/test_memory_model.py).
        fp32_masters: standard mixed precision as sonar-train's ``mixed-precision`` arm runs it
            (``sonar_kernels/train/arms.py``, ``Fp32Masters(experts_only=False)``): the model and its
            gradients in bf16 (``param_bytes`` 2), an fp32 master copy of every parameter (a ParameterList:
            MemTracker counts it among the parameters) with fp32 AdamW moments; in the step each bf16
            gradient is replaced by its master's fp32 gradient, one at a time, then clipping over the
            masters, AdamW's step and the copy back. The standard method, not under FSDP2 (whose mixed
            precision is ``param_bytes`` 4 with ``compute_bytes`` 2).
        causal_mask: the causal mask materialized, as in a step traced under FakeTensorMode before
            bench/dry_run.py told transformers there is no packing: ``find_packed_sequence_indices``
            (masking_utils.py) cannot rule out packed sequences in fake position ids (``is_tracing`` is
            true of a FakeTensor), so ``create_causal_mask`` builds a bool [B, 1, S, S] mask instead of
            returning None. Each layer's SDPA then converts it to an additive mask in the activations'
            dtype and saves it, and grouped query attention repeats k and v to every query head
            (``repeat_kv``: ``use_gqa_in_sdpa`` wants no mask); the checkpoints hold the bool mask.
            False: a real step (no mask: SDPA's ``is_causal``, GQA inside SDPA).
        master: None, or the expert tensors' bf16 master weights (``param_bytes`` 2, an in-backward
            method; docs/design.md, "bf16 master weights"): "remainder" (fp32 moments, or 8-bit ones, and
            an int16 remainder per element: 2 bytes) or "stochastic" (the moments as with "remainder" and a
            0-dim int64 seed per tensor).
        fused_epilogue: sonar's ``SonarAdamW(fused_epilogue=...)`` on the Triton backend: True, the update
            in the wgrad epilogue (no gradient tensor); False, the split path: each expert tensor's
            gradient written by chunks of experts into a buffer of at most 1/8 of its bytes or 64 MiB
            (``sonar_kernels.ops.triton_backend.wgrad_update.split_chunk``), updated from it, released after the
            tensor's update; None (SonarAdamW's default: the tuner picks either per layer shape on CUDA),
            bounded by the split path's peak, modelled as False. The paper's method is the split path with
            the whole gradient (``split_scratch(fraction=1)``, sonar-train's ``paper`` arm); it ignores this.
        loss_chunk_tokens: None (transformers' loss over all T tokens' logits at once) or the chunked loss
            of sonar-train's ``--loss-chunk-tokens`` (``sonar_kernels/train/loss.py``): the cross entropy
            over chunks of that many tokens, one chunk's logits alive at a time in the forward and in the
            backward, which recomputes them (``activations.loss_terms``).

    Raises:
        ValueError: an unknown method, AdamW implementation or backend; sonar's fused update on the torch
            backend; parameter bytes other than 2 or 4, activations wider than the parameters; experts that
            ``layout.ep`` does not divide; a layout with FSDP2 and dp or ep, or a size below 1; master
            weights with the standard method or fp32 parameters; fp32 masters with another method, fp32
            parameters or FSDP2; ``fused_epilogue`` other than True with another method than sonar;
            ``loss_chunk_tokens`` below 1.
    """

    dims: Preset
    batch_size: int
    sequence_length: int
    method: str
    layout: Layout = field(default_factory=Layout)
    param_bytes: int = 2
    compute_bytes: int | None = None
    checkpointing: bool = True
    adamw: str = "fused"
    backend: str = "triton"
    tracker: bool = False
    expert_rows: tuple[int, ...] | None = None
    collectives: str = "nccl"
    moments: str = "exact"
    master: str | None = None
    fp32_masters: bool = False
    causal_mask: bool = False
    fused_epilogue: bool | None = True
    loss_chunk_tokens: int | None = None

    def __post_init__(self):
        if self.fp32_masters and (self.method != "standard" or self.param_bytes != 2 or self.layout.fsdp > 1):
            raise ValueError(
                "fp32 masters (sonar-train's mixed-precision arm) train a bf16 model with the standard method, "
                "not under FSDP2 (param_bytes 4, compute_bytes 2 there)"
            )
        if self.master not in (None, "remainder", "stochastic"):
            raise ValueError(f"master must be None, 'remainder' or 'stochastic', got {self.master!r}")
        if self.master is not None and (self.method == "standard" or self.param_bytes != 2):
            raise ValueError(
                "bf16 master weights are an in-backward update's (method paper or sonar), of bf16 weights"
            )
        if self.moments not in ("exact", "8bit"):
            raise ValueError(f"moments must be 'exact' or '8bit', got {self.moments!r}")
        if self.moments == "8bit" and self.method == "standard":
            raise ValueError("8-bit moments are an in-backward update's (method paper or sonar)")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.fused_epilogue is not True and self.method != "sonar":
            raise ValueError("fused_epilogue is sonar's choice (the paper's method is the split path, whole)")
        if self.adamw not in ADAMW:
            raise ValueError(f"adamw must be one of {ADAMW}, got {self.adamw!r}")
        if self.backend not in ("torch", "triton"):
            raise ValueError(f"backend must be 'torch' or 'triton', got {self.backend!r}")
        if self.method == "sonar" and self.backend != "triton":
            raise ValueError(
                "sonar's fused update runs on the triton backend only (torch's is the paper's method)"
            )
        if self.param_bytes not in (2, 4):
            raise ValueError(f"param_bytes must be 2 or 4, got {self.param_bytes}")
        if self.compute_bytes not in (None, 2, 4) or (self.compute_bytes or 0) > self.param_bytes:
            raise ValueError(
                f"compute_bytes must be None or 2 or 4, at most param_bytes, got {self.compute_bytes}"
            )
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens must be None or >= 1, got {self.loss_chunk_tokens}")
        if self.dims.num_experts % self.layout.ep:
            raise ValueError(f"{self.dims.num_experts} experts cannot be split over ep {self.layout.ep}")

    @property
    def tokens(self) -> int:
        return self.batch_size * self.sequence_length


@dataclass
class Prediction:
    """The predicted peak: ``total`` bytes, ``breakdown`` by :data:`CATEGORIES`, the ``phase`` of the step
    it falls in, and ``terms``: the named byte counts that make it up."""

    total: int
    breakdown: dict
    phase: str
    terms: dict
