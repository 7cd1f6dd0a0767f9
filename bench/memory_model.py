"""A memory model of one training step: the per-rank peak, predicted from the model's dimensions.

What it predicts: the peak bytes per rank of one step (forward, backward, optimizer step) of sonar-train's
transformers models (``sonar_kernels.train.data.PRESETS``: OLMoE, Granite MoE), split as torch's
MemTracker splits it (parameters, buffers, gradients, optimizer state, the optimizer step's temporaries,
activations and temporaries), for three methods:

- ``standard``: torch.optim.AdamW over every parameter, global-norm clipping (sonar-train's ``standard``
  arm): every gradient is kept until the step.
- ``paper``: the Sonar-MoE paper's method: each expert tensor's gradient is computed as a tensor and
  applied by AdamW in the backward, then released (one expert gradient alive at a time; sonar-train's
  ``sonar`` arm on the torch backend, ``SonarAdamW(fused_epilogue=False)`` on the Triton one).
- ``sonar``: the AdamW update fused into the Triton wgrad epilogue: no expert gradient tensor (the
  ``sonar`` arm on the Triton backend).

and these layouts (:class:`Layout`): one rank, data parallel (DDP for the dense parameters; the experts
replicated, their gradients averaged by SonarAdamW's data-parallel group), expert parallel (each rank
E / ep experts, tokens by all-to-all), expert parallel x data parallel, FSDP2 (``fully_shard`` of every
experts module, every decoder layer and the model: docs/distributed.md's recipe).

How: an analytic account of what is alive at each candidate moment of the step (the end of the forward,
the loss's backward, the expert backward of every layer, FSDP2's reduce-scatters, the optimizer step),
derived from the code that runs (transformers' modeling files, ``sonar_kernels/ops/torch_backend.py``,
``sonar_kernels/ops/backward.py``, ``sonar_kernels/ops/wgrad.py``, ``sonar_kernels/autograd/formula.py``, ``sonar_kernels/optim/
distributed.py``, torch's AdamW, DDP and FSDP2, and autograd's rules: which tensors each op saves for its
backward); the peak is the largest moment. No coefficient is fitted to measurements; one term was found
by measuring and is marked so (FSDP2: down_proj's gradient output alive during the experts'
reduce-scatter). ``--validate`` measures the tiny presets with MemTracker on gloo ranks and compares.

Command line::

    python bench/memory_model.py                  # the predicted table for the real presets (a model)
    python bench/memory_model.py --validate       # measure the tiny presets, write bench/results/...json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
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
    return d.hidden_size // d.num_heads


@dataclass(frozen=True)
class Layout:
    """How the ranks split the model: ``dp`` data-parallel replicas, ``ep`` expert-parallel ranks (the
    experts split E / ep over them; ``ep`` x ``dp`` ranks in all), or ``fsdp`` FSDP2 ranks (every
    parameter sharded on its first dimension)."""

    dp: int = 1
    ep: int = 1
    fsdp: int = 1

    def __post_init__(self):
        if min(self.dp, self.ep, self.fsdp) < 1:
            raise ValueError(f"a layout needs sizes >= 1, got {self}")
        if self.fsdp > 1 and (self.dp > 1 or self.ep > 1):
            raise ValueError("FSDP2 is modelled alone (no dp or ep besides it)")

    @property
    def ranks(self) -> int:
        return self.fsdp if self.fsdp > 1 else self.dp * self.ep

    @property
    def name(self) -> str:
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
        method: "standard", "paper" or "sonar" (module docstring).
        layout: the ranks.
        param_bytes: bytes per parameter, gradient and AdamW moment (torch keeps the moments in the
            parameter's dtype): 4 (fp32), 2 (bf16).
        compute_bytes: bytes per activation element; None: ``param_bytes`` (the model run in its own
            dtype, as sonar-train runs it: what the op-by-op account and the validation cover). 2 with
            ``param_bytes`` 4: fp32 master weights with bf16 activations, composed from the two (the
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

    Raises:
        ValueError: an unknown method, AdamW implementation or backend; sonar's fused update on the torch
            backend; parameter bytes other than 2 or 4, activations wider than the parameters; experts that
            ``layout.ep`` does not divide; a layout with FSDP2 and dp or ep, or a size below 1.
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

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
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


# --- parameters -----------------------------------------------------------------------------------


def parameter_tensors(dims: Preset) -> list[tuple[str, tuple[int, ...], bool]]:
    """Every parameter of the transformers model as (name, shape, is_expert), in registration order
    (the order of ``model.parameters()``, which is torch.optim.AdamW's: the embedding, per layer the
    attention, the router, the experts and the norms as each family's modules declare them, the final
    norm and the untied lm_head; sonar-train builds the models with tie_word_embeddings=False)."""
    H, I, E, V = dims.hidden_size, dims.intermediate_size, dims.num_experts, dims.vocab_size
    Hq, Hkv = dims.num_heads * head_dim(dims), dims.num_kv_heads * head_dim(dims)
    tensors = [("embed_tokens", (V, H), False)]
    for layer in range(dims.num_layers):
        p = f"layers.{layer}."
        attention = [(p + "q_proj", (Hq, H), False), (p + "k_proj", (Hkv, H), False),
                     (p + "v_proj", (Hkv, H), False), (p + "o_proj", (H, Hq), False)]  # fmt: skip
        norms = [(p + "input_layernorm", (H,), False), (p + "post_attention_layernorm", (H,), False)]
        moe = [(p + "router", (E, H), False), (p + "gate_up_proj", (E, 2 * I, H), True),
               (p + "down_proj", (E, H, I), True)]  # fmt: skip
        if dims.family == "olmoe":  # OLMoE's q_norm and k_norm over the whole projections; norms last
            tensors += [*attention, (p + "q_norm", (Hq,), False), (p + "k_norm", (Hkv,), False), *moe, *norms]
        else:
            tensors += attention + norms + moe
    tensors += [("norm", (H,), False), ("lm_head", (V, H), False)]
    return tensors


def numel(shape) -> int:
    return math.prod(shape)


def local_shape(shape: tuple[int, ...], is_expert: bool, layout: Layout) -> tuple[int, ...]:
    """The shape one rank holds: experts split E / ep; under FSDP2 every tensor's first dimension padded
    to a multiple of the ranks and split (FSDP2 keeps the padded shard)."""
    if is_expert and layout.ep > 1:
        shape = (shape[0] // layout.ep, *shape[1:])
    if layout.fsdp > 1:
        shape = (-(-shape[0] // layout.fsdp), *shape[1:])
    return shape


def layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("layers.") else None


# --- activations --------------------------------------------------------------------------------------


def rms_norm_saved(T: int, width: int, a: int) -> int:
    """Bytes an RMSNorm (OLMoE's and Granite's: x.to(fp32), pow(2).mean, rsqrt, x * rsqrt, weight * .to(x's
    dtype)) saves for its backward, besides its input: the rsqrt [T, 1] fp32 and the normalized [T, W] in
    x's dtype (mul saves it for the weight's gradient); in a 16-bit dtype also x's fp32 copy (saved by pow
    and mul; in fp32 .to is x itself, which the norm then keeps alive)."""
    return T * FP32 + T * width * a + (T * width * FP32 if a != FP32 else 0)


def layer_saved(d: Preset, T: int, a: int, layout: Layout, rows: int) -> tuple[dict, dict, dict]:
    """What one decoder layer's forward saves for its backward, besides its input, as byte counts by name:
    (kept, moe, combine). ``moe``: the tensors the expert MLP's backward node alone holds (released when
    it has run, before the deferred in-backward updates); ``combine``: expert parallelism's combine, whose
    backward runs before the experts'. T tokens of this rank, ``a`` bytes per element, ``rows`` rows of
    this rank's experts (T * top_k on one rank; under expert parallelism the rows it receives).

    Derived from transformers 5's modeling_olmoe.py / modeling_granitemoe.py, sonar_kernels/nn/
    expert_parallel.py and autograd's rules (``a * b`` saves b for a's gradient only when b requires
    grad: rotary's ``q * cos`` keeps cos, not q)."""
    H, I, E, k = d.hidden_size, d.intermediate_size, d.num_experts, d.top_k
    Hq, Hkv, nh = d.num_heads * head_dim(d), d.num_kv_heads * head_dim(d), d.num_heads
    S = T * k
    fp32 = a == FP32
    kept = {
        "input_layernorm": rms_norm_saved(T, H, a) + T * H * a,  # + its output, saved by q/k/v_proj
        # v saved by attention; q and k kept by OLMoE's q_norm/k_norm in fp32 (their input), not in bf16.
        "v": T * Hkv * a,
        "q_k_rotated": T * (Hq + Hkv) * a,  # saved by attention
        "attention_out_lse": T * Hq * a + T * nh * FP32,  # its output (also o_proj's input) and logsumexp
        # the residual after attention: post_attention_layernorm's input, kept in fp32 only
        "attention_residual": T * H * a if fp32 else 0,
        "post_attention_layernorm": rms_norm_saved(T, H, a) + T * H * a,  # + its output: router's, experts' X
        "router_top_k_index": T * k * INT64,
        # expert_offsets, tile_offsets [E + 1], row_of_slot, token_of_row, slot_of_row [rows] int32; the
        # deferred updates hold them past the node
        "routing_metadata": 3 * rows * INT32 + 2 * (E // layout.ep + 1) * INT32,
    }
    if d.family == "olmoe":
        kept["q_norm_k_norm"] = rms_norm_saved(T, Hq, a) + rms_norm_saved(T, Hkv, a)
        kept["q_k"] = T * (Hq + Hkv) * a if fp32 else 0
        kept["router_softmax"] = T * E * FP32  # softmax(logits, dtype=float) saves its output
        moe_weights = T * k * (FP32 if fp32 else a)  # top-k of the fp32 softmax, cast to a: experts only
    else:  # Granite: topk of the fp32 logits, then softmax over the k (saved), cast to a
        kept["router_softmax"] = T * k * FP32
        moe_weights = 0 if fp32 else T * k * a
    moe = {"expert_weights": moe_weights, "hpre": rows * 2 * I * a}
    combine = {}
    if layout.ep > 1:  # the all-to-all dispatch and the fp32 combine
        kept["ep_send_index"] = S * INT64  # the send rows' token ids, saved by index's backward
        moe["expert_weights"] = rows * a  # ones: the rows arrive unweighted (the combine weights them)
        moe["expert_input"] = rows * H * a  # the received rows, the local experts' X
        combine = {
            "slots": S * INT64,  # saved by the combine's index
            "returned_rows_fp32": S * H * FP32,  # y.float(), saved by the weighted sum
            "row_weights_fp32": S * FP32,  # the routing weight per row, saved by the same product
            "weighted_rows": S * H * FP32,  # the product, index_copy's source (its backward saves it)
        }
    return kept, moe, combine


def shared_saved(d: Preset, batch_size: int, seq: int, a: int) -> int:
    """Tensors every layer shares: rotary cos and sin [1, seq, head_dim] and the position ids."""
    return 2 * seq * head_dim(d) * a + seq * INT64


def logits_dtype_bytes(d: Preset, a: int) -> int:
    """The router logits' dtype: OLMoE's in a, Granite's cast to fp32 (.float())."""
    return a if d.family == "olmoe" else FP32


# --- the backward of one layer's experts ----------------------------------------------------------------


def adamw_temporaries(adamw: str, sizes: list[int]) -> int:
    """Bytes torch's AdamW allocates while it updates tensors of ``sizes`` bytes (in the optimizer's
    order) in one call. The single-tensor implementation computes ``denom = (exp_avg_sq.sqrt() /
    bias_correction2_sqrt).add_(eps)`` per tensor: two tensors of the one it updates while the previous
    tensor's ``denom`` is still referenced; foreach: ``_foreach_sqrt`` of all of them; fused: none."""
    if not sizes:
        return 0
    if adamw == "single":
        return max(2 * size + (sizes[i - 1] if i else 0) for i, size in enumerate(sizes))
    if adamw == "foreach":
        return sum(sizes)
    return 0


class Tape:
    """Allocations and frees in program order, by name, in bytes; :attr:`peak` is the largest sum of the
    live tensors (with a :meth:`moment`'s transient ones) and :attr:`at_peak` those tensors then."""

    def __init__(self, live: dict | None = None):
        self.live = dict(live or {})
        self.peak, self.at_peak = -1, {}
        self._note()

    def _note(self, transient: dict | None = None) -> None:
        now = dict(self.live)
        for name, nbytes in (transient or {}).items():
            now[name] = now.get(name, 0) + nbytes
        total = sum(now.values())
        if total > self.peak:
            self.peak, self.at_peak = total, now

    def alloc(self, name: str, nbytes: int) -> None:
        self.live[name] = self.live.get(name, 0) + nbytes
        self._note()

    def free(self, *names: str) -> None:
        for name in names:
            self.live.pop(name, None)

    def moment(self, **transient: int) -> None:
        """A moment at which ``transient`` tensors are alive besides the live ones (freed right after)."""
        self._note(transient)


def torch_expert_backward(tape: Tape, n: dict, mode: str, adamw: str) -> None:
    """The torch backend's expert backward, SwiGLU (ops/torch_backend.py ``moe_mlp_bwd_core``, then each
    weight's job, ``expert_gradient``), then the deferred updates of an in-backward ``mode`` ("grad": the
    jobs return both weight gradients; "deferred": W1's then W2's wgrad and torch AdamW run in the weights'
    AccumulateGrad pre-hooks, autograd/formula.py, by chunks of experts with torch's fused AdamW,
    ops/adamw.py ``torch_adamw_chunked_``). ``n``: sizes in bytes: S rows, T tokens, H, I, ``a``
    (activation bytes), w1 and w2 (the local weight tensors), E (the local experts), ``routing_grad``
    (whether the routing weights get a gradient: not under expert parallelism, where they are ones)."""
    from sonar_kernels.ops.torch_backend import ROW_BLOCK_BYTES, WGRAD_CHUNK_BYTES

    S, T, k, H, I, a, w1, w2, E = (n[key] for key in ("S", "T", "k", "H", "I", "a", "w1", "w2", "E"))
    wide = a != FP32  # 16-bit activations: .float() copies
    routing_grad = n.get("routing_grad", True)

    def block_rows(width: int) -> int:
        """The rows of the largest block of whole experts of at most ROW_BLOCK_BYTES per fp32 row of
        ``width`` (balanced routing: at least one expert's share)."""
        return min(S, max(ROW_BLOCK_BYTES // (FP32 * width), -(-S // E)))

    sub = min(S, max(1, ROW_BLOCK_BYTES // (FP32 * I)))  # the elementwise blocks of rows
    # The core: the rows' tokens and routing weights (locals of the core).
    tape.alloc("token_ids", S * INT64)
    tape.moment(valid=S, slot_ids=S * INT64, weights_gathered=S * a + (S * FP32 if wide else 0))
    tape.alloc("weight_per_row", S * FP32)
    tape.alloc("per_row", S * FP32 if routing_grad else 0)
    # dHpre: written over the saved Hpre when the graph is freed after this backward (eager, deferred: the
    # node's Hpre becomes dHpre, which W1's job holds past the node), else a tensor of its own.
    if mode != "grad":
        tape.live["node"] -= S * 2 * I * a
    tape.alloc("dHpre", S * 2 * I * a)
    tape.alloc("A", S * I * a)
    # G by blocks of experts (dO's rows gathered, the GEMM's output), then SwiGLU's backward by blocks of
    # rows: gate, up (fp32 copies when 16-bit), silu, the product for <G, A>, sigmoid, its derivative, d gate.
    rows = block_rows(max(H, I))
    tape.alloc("g_blocks", rows * (H + I) * a + (rows * I * FP32 if wide else 0))
    tape.moment(swiglu_blocks=sub * I * FP32 * (5 + (4 if wide else 0)))
    tape.free("g_blocks")
    if routing_grad:  # d top_k_weights: per slot (the row of each slot, as int64), [T, k]
        tape.moment(slot_rows=S * INT64, per_slot=2 * S * FP32)
        tape.alloc("d_routing_weights", T * k * a)
    tape.free("per_row")
    # dX: a block of experts' rows dHpre @ W1[e] at a time, added to its tokens in fp32; then in a.
    tape.alloc("dX_fp32", T * H * FP32)
    rows = block_rows(H)
    tape.moment(token_ids_dx=S * INT64, dX_block=rows * H * a + (rows * H * FP32 if wide else 0))
    if wide:
        tape.alloc("dX", T * H * a)
        tape.free("dX_fp32")
    else:
        tape.live["dX"] = tape.live.pop("dX_fp32")
    tape.free("token_ids", "weight_per_row")
    # The jobs: each weight's gradient from the core's operands, with the rows' tokens (and W2's routing
    # weights) it gathers by; held by the deferred updates until they run.
    tape.alloc("w2_job", S * INT64 + S * FP32)
    tape.alloc("w1_job", S * INT64)
    if mode == "grad":  # each gradient whole: the gathered rows of dO (scaled) and of X
        tape.moment(**{"grad:down_proj": w2, "dO_rows": S * H * a + (S * H * FP32 if wide else 0)})
        tape.alloc("grad:down_proj", w2)
        tape.free("A", "w2_job")
        tape.moment(**{"grad:gate_up_proj": w1, "x_rows": S * H * a})
        tape.alloc("grad:gate_up_proj", w1)
        tape.free("w1_job")
        return
    # The deferred updates, after the node: W1's (with W2's job pending), then W2's. Torch's fused AdamW:
    # a chunk of experts' gradient at a time into one buffer, their rows gathered into another; else the
    # whole gradient and all its rows, then torch's AdamW (its temporaries).
    tape.free("node")
    if not routing_grad:  # expert parallel: dO is the node's dY (its rows), which W2's job gathers from
        tape.alloc("w2_job", S * H * a)
    for name, weight, extra in (
        ("gate_up_proj", w1, ("dHpre", "w1_job")),
        ("down_proj", w2, ("A", "w2_job")),
    ):
        if adamw == "fused":
            chunk = min(weight, max(WGRAD_CHUNK_BYTES, weight // E))
            rows = min(S, -(-S * chunk // weight))
            tape.moment(**{f"in_backward:{name}": chunk, "chunk_rows": rows * H * a})
        else:
            rows = S * H * a + (S * H * FP32 if wide and name == "down_proj" else 0)
            tape.moment(**{f"in_backward:{name}": weight, "rows": rows,
                           "step:adamw": adamw_temporaries(adamw, [weight])})  # fmt: skip
        tape.free(*extra)


def triton_expert_backward(tape: Tape, n: dict, mode: str) -> None:
    """The Triton backend's expert backward (ops/backward.py ``moe_mlp_bwd_core``, then each weight's job,
    ops/wgrad.py ``expert_wgrad``): dHpre [S, 2I], A [S, I] and the routing-weight partial sums
    [cdiv(I, 64), S] fp32 from the dHpre kernel; d top_k_weights; dX's rows [S, H] and dX [T, H]; then dW2
    (mode "grad"; A released after it) and dW1 (mode "grad"). ``mode`` "fused": the updates deferred and
    fused into the wgrad launches (no gradient tensor); "split": deferred, each gradient written, then
    updated by the flat AdamW kernel (no temporaries)."""
    S, T, k, H, I, a, w1, w2 = (n[key] for key in ("S", "T", "k", "H", "I", "a", "w1", "w2"))
    tape.alloc("dHpre", S * 2 * I * a)
    tape.alloc("A", S * I * a)
    tape.alloc("dw_partial", -(-I // DHPRE_BLOCK_N) * S * FP32)
    tape.alloc("d_routing_weights", T * k * a)
    tape.free("dw_partial")
    tape.alloc("dX", T * H * a)
    tape.moment(dX_rows=S * H * a)
    if mode == "grad":
        tape.alloc("grad:down_proj", w2)
        tape.free("A")
        tape.alloc("grad:gate_up_proj", w1)
        return
    tape.free("node")
    if mode == "split":  # W1's deferred update: its gradient, then the flat AdamW kernel; then W2's
        tape.moment(**{"in_backward:gate_up_proj": w1})
        tape.free("dHpre")
        tape.moment(**{"in_backward:down_proj": w2})


# --- the step -------------------------------------------------------------------------------------------


def gradient_order(names: list[str]) -> list[str]:
    """``names`` in the order the backward produces their gradients: the lm_head and the final norm, then
    each layer from the last (its experts, the router, post_attention_layernorm, o_proj, OLMoE's q_norm
    and k_norm, q/k/v_proj, input_layernorm), the embedding last."""
    rank = {"gate_up_proj": 0, "down_proj": 1, "router": 2, "post_attention_layernorm": 3, "o_proj": 4,
            "q_norm": 5, "k_norm": 6, "q_proj": 7, "k_proj": 8, "v_proj": 9, "input_layernorm": 10}  # fmt: skip

    def key(name):
        layer = layer_of(name)
        if layer is None:
            return (0 if name in ("lm_head", "norm") else 2, 0, 0 if name == "lm_head" else 1)
        return (1, -layer, rank[name.split(".")[-1]])

    return sorted(names, key=key)


def _ddp_buckets(names: list[str], nbytes: dict) -> list[tuple[int, set]]:
    """DDP's gradient buckets over ``names``, as DDP packs them after its first iteration (in the order
    the gradients became ready): a bucket closed once it holds at least its cap (about 1 MiB for the
    first, 25 MiB after): (bytes, names) per bucket."""
    buckets, current, size = [], set(), 0
    for name in gradient_order(names):
        current.add(name)
        size += nbytes[name]
        if size >= (DDP_FIRST_BUCKET if not buckets else DDP_BUCKET):
            buckets.append((size, current))
            current, size = set(), 0
    if current:
        buckets.append((size, current))
    return buckets


def predict(s: Setup) -> Prediction:
    """The predicted per-rank peak of one training step of ``s``, in bytes (see the module docstring): the
    largest of the step's candidate moments, with ``terms`` naming every byte count alive then and
    ``breakdown`` grouping them in MemTracker's categories (:data:`CATEGORIES`). Under expert
    parallelism, the rank whose experts receive ``s.expert_rows``; under FSDP2, rank 0."""
    d, p, T, L, lay = s.dims, s.param_bytes, s.tokens, s.dims.num_layers, s.layout
    a = s.compute_bytes or p
    H, E, V = d.hidden_size, d.num_experts, d.vocab_size
    tensors = parameter_tensors(d)
    if lay.fsdp > 1:
        return _predict_fsdp(s, tensors)
    nbytes = {name: numel(local_shape(shape, expert, lay)) * p for name, shape, expert in tensors}
    is_expert = {name: expert for name, _, expert in tensors}
    names = [name for name, _, _ in tensors]
    static = {
        "parameters": sum(nbytes.values()),
        "buffers": 2 * (head_dim(d) // 2) * p,  # rotary inv_freq and original_inv_freq, cast with the model
        "optimizer_state": 2 * sum(nbytes.values()) + FP32 * len(names),  # exp_avg, exp_avg_sq, fp32 step
    }
    in_backward = s.method != "standard"  # expert gradients never reach .grad outside the backward
    reduce_first = in_backward and lay.dp > 1  # averaged over the data-parallel group before the update

    def kept_grad(name):  # the gradients that stay in .grad until the optimizer step
        return not (in_backward and is_expert[name])

    # DDP (sonar-train wraps the model on several ranks) holds the dense parameters, and the experts
    # too in the standard arm of a data-parallel layout; gradient_as_bucket_view=False: a second copy.
    ddp_names = []
    if lay.ranks > 1:
        ddp_names = [n for n in names if not is_expert[n] or (s.method == "standard" and lay.ep == 1)]
    buckets = _ddp_buckets(ddp_names, nbytes)

    def ddp_bytes(ready: set) -> int:
        if not s.tracker:
            return sum(size for size, _ in buckets)
        return sum(size for size, members in buckets if members & ready)

    w1 = nbytes["layers.0.gate_up_proj"]
    w2 = nbytes["layers.0.down_proj"]
    # The rows of this rank's experts per layer: T * top_k on one rank or data parallel; under expert
    # parallelism the rows it receives (balanced routing: T * top_k on average, unless given).
    rows = list(s.expert_rows or [T * d.top_k] * L)
    saved = [layer_saved(d, T, a, lay, rows[layer]) for layer in range(L)]
    x = T * H * a  # one layer's input (the residual stream)
    shared = shared_saved(d, s.batch_size, s.sequence_length, a)
    ld = logits_dtype_bytes(d, a)
    # Layer inputs stay alive: as checkpoints, or (fp32, no checkpointing) as input_layernorm's input.
    inputs_kept = s.checkpointing or a == FP32
    final_norm = rms_norm_saved(T, H, a) + x + (x if a == FP32 else 0)  # + its output; fp32: its input

    def activations(upto: int) -> int:
        """Saved activations of layers [0, upto) and the layer inputs up to layer ``upto``."""
        if s.checkpointing:
            return upto * x
        total = sum(sum(part.values()) for layer in range(upto) for part in saved[layer])
        return total + (upto * x if inputs_kept else 0)

    moments = []  # (phase, terms)

    def add(phase, terms):
        moments.append((phase, {k: v for k, v in terms.items() if v}))

    # The forward's end: the cross-entropy (logits [T, V] in a, their fp32 copy in 16 bits, log_softmax's
    # saved output [T, V] fp32) and the load-balancing loss (each layer's router logits, captured; its
    # per-layer softmax saved).
    act_all = activations(L) + final_norm + shared + L * T * E * ld
    logits = T * V * a
    add("forward", {"activations": act_all, "logits": logits, "logits_fp32": T * V * FP32 if a != FP32 else 0,
                    "log_softmax": T * V * FP32})  # fmt: skip
    add("forward", {"activations": act_all, "logits": logits, "log_softmax": T * V * FP32,
                    "aux_loss_softmax": L * T * E * ld})  # fmt: skip
    # The loss's backward: log_softmax's output, the gradient in and out of it (fp32 [T, V] each); the
    # load-balancing loss ran first and left every layer's router-logit gradient.
    add("backward", {"activations": act_all - L * T * E * ld, "router_logit_gradients": L * T * E * ld,
                     "log_softmax_and_gradients": 3 * T * V * FP32})  # fmt: skip
    if s.method == "standard" or reduce_first:
        mode = "grad"
    else:
        mode = "deferred" if s.backend == "torch" else ("fused" if s.method == "sonar" else "split")
    ready = {"lm_head", "norm"}
    grads = nbytes["lm_head"] + nbytes["norm"]
    for layer in reversed(range(L)):  # each layer's expert backward, the last layer first
        kept, moe, _ = saved[layer]
        n = {"S": rows[layer], "T": rows[layer] if lay.ep > 1 else T, "k": 1 if lay.ep > 1 else d.top_k, "H": H,
             "I": d.intermediate_size, "a": a, "w1": w1, "w2": w2, "E": d.num_experts // lay.ep,
             "routing_grad": lay.ep == 1}  # fmt: skip
        # The node's saved tensors (autograd gives its unused outputs, Hpre and the metadata, no zero
        # gradients: autograd/formula.py turns their materialization off).
        node = sum(moe.values())
        if d.family == "granitemoe":
            node += x  # the experts' dY: dO times the residual multiplier
        if lay.ep > 1:
            # the experts' dY, after the reverse all-to-all and the 1 / ep scaling; the gradient of the
            # combine's routing weights [T, k]
            node += rows[layer] * H * a + T * d.top_k * a
        # optim/distributed.py's MAX_IN_FLIGHT = 2 tensors: the layer after's, their all-reduce in flight
        in_flight = w1 + w2 if reduce_first and layer < L - 1 else 0
        tape = Tape({
            "activations": activations(layer) + (x if inputs_kept else 0) + sum(kept.values()) + shared,
            "router_logit_gradients": (layer + 1) * T * E * ld,
            "incoming_gradient": x,
            "gradients": grads,
            "ddp_buckets": ddp_bytes(ready),  # this layer's own gradients come after its experts
            "in_flight_expert_gradients": in_flight,
            "node": node,
        })  # fmt: skip
        if mode == "grad" and s.tracker:
            # The node runs the sonar_kernels:: ops of the backward's jobs: a TorchDispatchMode (MemTracker)
            # sees their outputs, not the buffers inside them. The core op's (dX, the routing weights'
            # gradient, dHpre, A; expert parallel: the rows' weights are ones, which need no gradient), then
            # each weight's gradient op: W2's (its operand A released after it), W1's (dHpre after it).
            S, I = n["S"], n["I"]
            tape.alloc("dX", n["T"] * H * a)
            tape.alloc("d_routing_weights", 0 if lay.ep > 1 else T * d.top_k * a)
            tape.alloc("dHpre", S * 2 * I * a)
            tape.alloc("A", S * I * a)
            tape.alloc("grad:down_proj", w2)
            tape.free("A")
            tape.alloc("grad:gate_up_proj", w1)
            tape.free("dHpre")
        elif s.backend == "torch":
            torch_expert_backward(tape, n, mode, s.adamw)
        else:
            triton_expert_backward(tape, n, mode)
        add("backward", tape.at_peak)
        if reduce_first and layer < L - 1:
            # This layer's W1 reached .grad: its all-reduce starts, and the oldest in flight (the layer
            # after's W1) is waited for and updated (torch's AdamW), while this layer's W2 waits.
            add("backward", {**{k: v for k, v in tape.live.items() if k in ("activations", "router_logit_gradients",
                             "incoming_gradient", "gradients", "ddp_buckets")},
                             "in_flight_expert_gradients": w1 + w2, "grad:gate_up_proj": w1,
                             "grad:down_proj": w2, "dX": tape.live.get("dX", 0),
                             "d_routing_weights": tape.live.get("d_routing_weights", 0),
                             "step:adamw": adamw_temporaries(s.adamw, [w1])})  # fmt: skip
        layer_names = [n for n in names if layer_of(n) == layer]
        ready |= set(layer_names)
        grads += sum(nbytes[n] for n in layer_names if kept_grad(n))
    ready.add("embed_tokens")
    grads += nbytes["embed_tokens"]
    # The optimizer step: torch.optim.AdamW over the parameters that have a gradient (all in standard,
    # the dense ones otherwise), after clipping; the loss and the norm are 0-dim fp32 tensors.
    stepped = [nbytes[n] for n in names if kept_grad(n)]
    add("optimizer step", {"gradients": grads, "ddp_buckets": ddp_bytes(ready), "loss_and_norm": 2 * FP32,
                           "step:adamw": adamw_temporaries(s.adamw, stepped)})  # fmt: skip
    if reduce_first:
        # The end of the backward: the last layer's expert gradients, applied in an engine callback.
        add("backward", {"gradients": grads, "ddp_buckets": ddp_bytes(ready), "grad:gate_up_proj": w1,
                         "grad:down_proj": w2, "step:adamw": adamw_temporaries(s.adamw, [w1])})  # fmt: skip
    phase, terms = max(moments, key=lambda m: sum(m[1].values()))
    terms = {**static, **terms}
    return Prediction(sum(terms.values()), _categories(terms, phase), phase, terms)


def _categories(terms: dict, phase: str) -> dict:
    """``terms`` in MemTracker's categories: a gradient that reached .grad is a gradient; AdamW's
    temporaries inside ``optimizer.step()`` are the step's temporaries, in the backward (the paper's
    in-backward update, the data-parallel updates) temporaries; activations and backward temporaries
    together (MemTracker files recomputed activations under either)."""
    out = dict.fromkeys(CATEGORIES, 0)
    for name, value in terms.items():
        if name in ("parameters", "buffers", "optimizer_state"):
            out[name] += value
        elif name in ("root_unsharded_parameters", "unsharded_parameters", "unsharded_expert_parameters"):
            out["parameters"] += value
        elif name in ("gradients", "in_flight_expert_gradients", "reduce_scatter_output") or name.startswith(
            "grad:"
        ):
            out["gradients"] += value
        elif name == "step:adamw" and phase == "optimizer step":
            out["optimizer_step_temporaries"] += value
        else:
            out["activations_and_temporaries"] += value
    return out


def _predict_fsdp(s: Setup, tensors) -> Prediction:
    """FSDP2 as docs/distributed.md's recipe applies it (``fully_shard`` of every experts module, then of every decoder
    layer, then of the model), from torch's ``_fully_shard/_fsdp_param_group.py`` and
    ``_fsdp_collectives.py``, on rank 0 (whose shards are the padded ones).

    The root's parameters (embedding, final norm, lm_head) stay unsharded from the forward to the end of
    the backward (``reshard_after_forward`` is False for the root). Each group (a layer's dense
    parameters, its experts) is all-gathered for its forward and again for its backward: a flat buffer of
    every rank's padded shard, copied out into the unsharded parameters, then freed; the backward
    prefetches the next group's all-gather (the previous layer's dense group during this layer's expert
    backward). A group's post-backward copies its unsharded gradients into a reduce-scatter input
    (padded; kept until the next group's post-backward starts), frees them, and reduces into one flat
    shard of which every parameter's sharded gradient is a view; gloo's reduce-scatter works on a copy
    of the input. The experts' forward runs on the unsharded tensors, which carry no update: their
    backward returns both gradients in every method; SonarAdamW then updates each expert shard from its
    reduced gradient and releases it (the experts group's flat shard is freed)."""
    d, p, T, L, lay = s.dims, s.param_bytes, s.tokens, s.dims.num_layers, s.layout
    a = s.compute_bytes or p
    H, E, V, N = d.hidden_size, d.num_experts, d.vocab_size, lay.fsdp
    full = {name: numel(shape) * p for name, shape, _ in tensors}
    shard = {name: numel(local_shape(shape, expert, lay)) * p for name, shape, expert in tensors}
    expert_names = {name for name, _, expert in tensors if expert}
    names = [name for name, _, _ in tensors]
    root = ("embed_tokens", "norm", "lm_head")

    def group(layer, experts):
        return [n for n in names if layer_of(n) == layer and (n in expert_names) == experts]

    def total(table, layer, experts):
        return sum(table[n] for n in group(layer, experts)) if 0 <= layer < L else 0

    def padded(layer, experts):  # a flat buffer of every rank's padded shard
        return N * total(shard, layer, experts)

    static = {
        "parameters": sum(shard.values()),
        "buffers": 2 * (head_dim(d) // 2) * p,
        "optimizer_state": 2 * sum(shard.values()) + FP32 * len(names),
    }
    gloo = s.collectives == "gloo"
    in_backward = s.method != "standard"
    root_unsharded = sum(full[n] for n in root)
    rows = [T * d.top_k] * L
    saved = [layer_saved(d, T, a, lay, rows[layer]) for layer in range(L)]
    x = T * H * a
    shared = shared_saved(d, s.batch_size, s.sequence_length, a)
    ld = logits_dtype_bytes(d, a)
    inputs_kept = s.checkpointing or a == FP32
    final_norm = rms_norm_saved(T, H, a) + x + (x if a == FP32 else 0)

    def activations(upto: int) -> int:
        if s.checkpointing:
            return upto * x
        return sum(sum(part.values()) for layer in range(upto) for part in saved[layer]) + (
            upto * x if inputs_kept else 0
        )

    moments = []

    def add(phase, terms):
        moments.append((phase, {k: v for k, v in terms.items() if v}))

    def reduce_scatter(terms, rs_input, out):
        """The post-backward from its copy-in: the unsharded gradients in ``terms`` are copied into the
        input, freed, and reduced into ``out`` bytes of shard (gloo: on a copy of the input)."""
        add("backward", {**terms, "reduce_scatter_input": rs_input})
        terms = {k: v for k, v in terms.items() if k != "unsharded_gradients"}
        add("backward", {**terms, "reduce_scatter_input": rs_input, "gloo_reduce_scatter_copy": rs_input if gloo else 0,
                         "reduce_scatter_output": out})  # fmt: skip

    act_all = activations(L) + final_norm + shared + L * T * E * ld
    add("forward", {"root_unsharded_parameters": root_unsharded, "activations": act_all, "logits": T * V * a,
                    "logits_fp32": T * V * FP32 if a != FP32 else 0, "log_softmax": T * V * FP32})  # fmt: skip
    add("backward", {"root_unsharded_parameters": root_unsharded, "activations": act_all - L * T * E * ld,
                     "router_logit_gradients": L * T * E * ld, "log_softmax_and_gradients": 3 * T * V * FP32})  # fmt: skip
    sharded_grads = 0
    root_grads = full["lm_head"] + full["norm"]  # unsharded until the root's reduce-scatter at the end
    w1, w2 = full["layers.0.gate_up_proj"], full["layers.0.down_proj"]
    w1_shard = shard["layers.0.gate_up_proj"]
    previous_rs = 0  # the last reduce-scatter input, kept until the next post-backward
    for layer in reversed(range(L)):
        kept, moe, _ = saved[layer]
        act = activations(layer) + (x if inputs_kept else 0) + sum(kept.values()) + shared
        node = sum(moe.values()) + rows[layer] * 2 * d.intermediate_size * a + kept["routing_metadata"]
        if d.family == "granitemoe":
            node += x
        base = {
            "root_unsharded_parameters": root_unsharded,
            "unsharded_parameters": total(full, layer, False),
            "prefetched_all_gather": padded(layer - 1, False),
            "gradients": sharded_grads + root_grads,
            "router_logit_gradients": (layer + 1) * T * E * ld,
            "incoming_gradient": x,
        }
        outputs = {"dX": T * H * a, "d_routing_weights": T * d.top_k * a}
        add("backward", {**base, "unsharded_expert_parameters": total(full, layer, True), "activations": act,
                         "previous_reduce_scatter_input": previous_rs, "node": node, **outputs,
                         "grad:gate_up_proj": w1, "grad:down_proj": w2})  # fmt: skip
        # The experts' post-backward (their parameters resharded, the previous input released). It runs
        # from the engine before the node's down_proj output is released (measured: one more W2 alive).
        reduce_scatter({**base, "activations": act - kept["routing_metadata"], **outputs,
                        "down_proj_node_output": w2, "unsharded_gradients": w1 + w2},
                       padded(layer, True), total(shard, layer, True))  # fmt: skip
        if in_backward:  # each expert shard updated (torch AdamW) from its reduced gradient, then released
            add("backward", {**base, "activations": act, **outputs, "reduce_scatter_input": padded(layer, True),
                             "reduce_scatter_output": total(shard, layer, True),
                             "step:adamw": adamw_temporaries(s.adamw, [w1_shard])})  # fmt: skip
        else:
            sharded_grads += total(shard, layer, True)
        # The layer's post-backward: its dense gradients.
        base["gradients"] = sharded_grads + root_grads
        base["router_logit_gradients"] = layer * T * E * ld
        reduce_scatter({**base, "activations": act - sum(kept.values()), "unsharded_gradients": total(full, layer, False)},
                       padded(layer, False), total(shard, layer, False))  # fmt: skip
        sharded_grads += total(shard, layer, False)
        previous_rs = padded(layer, False)
    grads = sharded_grads + sum(shard[n] for n in root)
    stepped = [shard[n] for n in names if not (in_backward and n in expert_names)]
    add("optimizer step", {"gradients": grads, "loss_and_norm": 2 * FP32,
                           "step:adamw": adamw_temporaries(s.adamw, stepped)})  # fmt: skip
    phase, terms = max(moments, key=lambda m: sum(m[1].values()))
    terms = {**static, **terms}
    return Prediction(sum(terms.values()), _categories(terms, phase), phase, terms)


# --- validation: MemTracker on gloo ranks -----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One measured configuration: a preset (``layers``, ``batch_size``, ``sequence_length`` as run), a
    method, a layout, a dtype, activation checkpointing and torch.optim.AdamW's implementation."""

    preset: str
    method: str
    layout: Layout
    dtype: str = "float32"
    checkpointing: bool = True
    adamw: str = "single"
    layers: int | None = None
    batch_size: int | None = None
    sequence_length: int | None = None

    @property
    def backend(self) -> str:
        return "triton" if self.method == "sonar" else "torch"

    def setup(self, presets) -> Setup:
        preset = presets[self.preset]
        return Setup(
            with_layers(preset, self.layers), self.batch_size or preset.batch_size,
            self.sequence_length or preset.sequence_length, self.method, self.layout,
            param_bytes=2 if self.dtype == "bfloat16" else 4, checkpointing=self.checkpointing, adamw=self.adamw,
            backend=self.backend, tracker=True, collectives="gloo",
        )  # fmt: skip

    def label(self) -> str:
        return (
            f"{self.preset} {self.layout.name} {self.method} {self.dtype} "
            f"{'ckpt' if self.checkpointing else 'no-ckpt'} adamw-{self.adamw}"
        )


# Presets the validation adds to sonar-train's: sonar's fused update runs under the Triton interpreter on
# this CPU, too slow for the tiny presets (a 2-layer model of tiny-olmoe's shape takes minutes per step).
EXTRA_PRESETS = {}


def _presets():
    from sonar_kernels.train.data import PRESETS, Preset

    return {
        **PRESETS,
        "micro-olmoe": Preset("olmoe", 64, 64, 8, 2, 2, 4, 4, 256, batch_size=2, sequence_length=32),
        # tiny-olmoe with a 16384-token vocabulary (the byte tokens use 256 of it): the cross-entropy's
        # [T, V] tensors set the peak, as at the real presets' vocabularies
        "tiny-olmoe-v16k": Preset("olmoe", 128, 256, 32, 2, 4, 4, 4, 16384, batch_size=4),
    }


def _args(case: Case):
    from sonar_kernels.train import parse_args

    argv = ["--backend", case.backend, "--quiet", "--dtype", case.dtype]
    if not case.checkpointing:
        argv.append("--no-checkpointing")
    argv += {"single": ["--no-foreach", "--no-fused"], "foreach": ["--foreach", "--no-fused"],
             "fused": ["--no-foreach", "--fused"]}[case.adamw]  # fmt: skip
    if case.layout.ep > 1 and case.layout.dp == 1:
        argv += ["--ep", str(case.layout.ep)]
    return parse_args(argv)


def measure(case: Case) -> dict:
    """MemTracker's peak of one step of ``case`` on this rank, in bytes: ``total``, ``breakdown`` (the
    categories of :data:`CATEGORIES`), ``phase``, and under expert parallelism ``expert_rows`` (the rows
    this rank's experts received per layer in the measured step). Every rank of the job calls it, in the
    same order, with torch.distributed initialized when the layout has several ranks: sonar-train's
    memory pass (``sonar_kernels.train.memory.measure_memory``: two warm-up steps, one tracked) for the
    layouts sonar-train runs (one rank, data parallel, expert parallel), the same procedure on this
    module's arms for EP x DP and FSDP2."""
    import torch

    from sonar_kernels.integrations import transformers as hf
    from sonar_kernels.train import ByteData, build_model, default_text
    from sonar_kernels.train.memory import measure_memory

    hf.register()
    preset = _presets()[case.preset]
    args = _args(case)
    dtype = getattr(torch, case.dtype)
    initial = build_model(preset, case.layers, 0, dtype, torch.device("cpu"))
    hf.set_backend(initial, case.backend)
    data = ByteData(default_text(), case.sequence_length or preset.sequence_length,
                    case.batch_size or preset.batch_size, seed=0)  # fmt: skip
    arm = "standard" if case.method == "standard" else "sonar"
    calls = _count_routed_rows(initial, case.layout.ep) if case.layout.ep > 1 else None
    if case.layout.fsdp > 1 or (case.layout.ep > 1 and case.layout.dp > 1):
        result = _measure_custom(arm, initial, data, args, case.layout)
    else:
        result = measure_memory(arm, initial, data, args, torch.device("cpu"))
    breakdown = result["peak_memory"]
    expert_rows = None
    if calls is not None:  # the tracked step's forward: the third of three steps
        layers = initial.config.num_hidden_layers
        per_step = layers * (2 if case.checkpointing else 1)  # checkpointing routes again in the backward
        expert_rows = _received_rows(calls[2 * per_step : 2 * per_step + layers], case.layout)
    return {
        "expert_rows": expert_rows,
        "total": result["peak_memory_bytes"],
        "phase": result["peak_phase"],
        "breakdown": {
            "parameters": breakdown["parameters"],
            "buffers": breakdown["buffers"],
            "gradients": breakdown["gradients"],
            "optimizer_state": breakdown["optimizer_state"],
            "optimizer_step_temporaries": breakdown["optimizer_step_temporaries"],
            "activations_and_temporaries": breakdown["activations"]
            + breakdown["temporary"]
            + breakdown["other"],
        },
    }


def _custom_arm(name: str, initial, args, layout: Layout):
    """sonar-train's arm (``sonar_kernels.train.arms.build_arm``) for the layouts sonar-train does not run.

    FSDP2: ``fully_shard`` of every experts module and decoder layer, then of the model (docs/distributed.md,
    "Distributed training"; after activation checkpointing is enabled); ``standard``: torch.optim.AdamW
    and ``clip_grad_norm_`` over every (sharded) parameter; ``sonar``: SonarAdamW, which updates each
    expert shard from FSDP2's reduce-scattered gradient. EP x DP: a (dp, ep) mesh; the experts sharded
    over ``ep`` (``shard_experts``) and replicated over ``dp``; DDP over every rank for the dense
    parameters; ``sonar``: SonarAdamW with ``data_parallel_group=mesh["dp"]``; ``standard``:
    torch.optim.AdamW, the expert gradients averaged over ``dp`` in place after the backward, the global
    norm's expert part summed over ``ep``."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import sonar_kernels
    from sonar_kernels.train.arms import EXPERT_PARAMS, Arm, enable_checkpointing

    model = copy.deepcopy(initial)
    hyper = {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    flags = {"foreach": args.foreach, "fused": args.fused}
    if args.checkpointing:
        enable_checkpointing(model)
    model.train()
    if layout.fsdp > 1:
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (layout.fsdp,))
        for (
            layer
        ) in model.model.layers:  # docs/distributed.md's recipe: the experts module, the layer, the model
            experts = next(m for m in layer.modules() if type(m).__name__.endswith("Experts"))
            fully_shard(experts, mesh=mesh)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if name == "sonar":
            optimizer = sonar_kernels.SonarAdamW(model, **hyper, **flags, max_grad_norm=args.max_grad_norm)
            return Arm(name, model, optimizer, [], None, model)
        optimizer = torch.optim.AdamW(model.parameters(), **hyper, **flags)
        return Arm(name, model, optimizer, [], list(model.parameters()), model)
    from sonar_kernels.integrations import transformers as hf
    from sonar_kernels.optim.distributed import exclude_from_ddp

    mesh = init_device_mesh("cpu", (layout.dp, layout.ep), mesh_dim_names=("dp", "ep"))
    hf.shard_experts(model, mesh["ep"])
    experts = [p for n, p in model.named_parameters() if n.endswith(EXPERT_PARAMS)]
    if name == "sonar":
        optimizer = sonar_kernels.SonarAdamW(model, **hyper, **flags, max_grad_norm=args.max_grad_norm,
                                             data_parallel_group=mesh["dp"])  # fmt: skip
        clip = None
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **hyper, **flags)
        exclude_from_ddp(model, experts)
        clip = list(model.parameters())
    arm = Arm(name, model, optimizer, [], clip, torch.nn.parallel.DistributedDataParallel(model), experts)
    arm.groups = (mesh["dp"].get_group(), mesh["ep"].get_group())
    return arm


def _custom_step(arm, tokens, max_grad_norm: float) -> None:
    """One step of a :func:`_custom_arm` (as ``sonar_kernels.train.arms.train_step``)."""
    import torch
    import torch.distributed as dist

    loss = arm.wrapped(input_ids=tokens, labels=tokens).loss
    loss.backward()
    if arm.clip_params is not None:
        if arm.ep_experts is None:  # FSDP2: DTensor gradients, the norm reduced over the mesh
            torch.nn.utils.clip_grad_norm_(arm.clip_params, max_grad_norm)
        else:
            dp_group, ep_group = arm.groups
            experts = [p.grad for p in arm.ep_experts]
            for grad in experts:  # averaged over the replicas, in place (DDP's arithmetic)
                grad.div_(dist.get_world_size(dp_group))
                dist.all_reduce(grad, group=dp_group)
            dense = [p.grad for p in arm.clip_params if not any(p is q for q in arm.ep_experts)]
            expert_sq = torch.nn.utils.get_total_norm(experts).square()
            dist.all_reduce(expert_sq, group=ep_group)
            norm = torch.sqrt(torch.nn.utils.get_total_norm(dense).square() + expert_sq)
            torch.nn.utils.clip_grads_with_norm_(arm.clip_params, max_grad_norm, norm)
    arm.optimizer.step()
    arm.optimizer.zero_grad(set_to_none=True)


def _measure_custom(name: str, initial, data, args, layout: Layout) -> dict:
    """``sonar_kernels.train.memory.measure_memory``'s procedure (two untracked steps, then one tracked
    by MemTracker, ``track_step``) on a :func:`_custom_arm`."""
    import functools

    import torch

    from sonar_kernels.train import distributed
    from sonar_kernels.train.memory import track_step

    arm = _custom_arm(name, initial, args, layout)
    for step in range(2):
        _custom_step(arm, data.batch(distributed.batch_index(step)), args.max_grad_norm)
    tokens = data.batch(distributed.batch_index(2))
    step = functools.partial(_custom_step, arm, tokens, args.max_grad_norm)
    return track_step(arm.model, arm.optimizers, step, torch.device("cpu"))


def _count_routed_rows(model, ep: int) -> list:
    """Record, for every forward of a router of ``model`` (and of its copies: the hooks are copied with
    it), how many of this rank's routed slots go to each of the ``ep`` expert-parallel ranks. Counted in
    Python from the top-k ids (no tensor is allocated, so the measurement is unchanged)."""
    calls = []
    experts = (
        model.config.num_experts if hasattr(model.config, "num_experts") else model.config.num_local_experts
    )
    local = experts // ep

    def hook(module, inputs, output):
        counts = [0] * ep
        for expert in output[2].reshape(-1).tolist():
            counts[expert // local] += 1
        calls.append(counts)

    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(hook)
    return calls


def _received_rows(calls: list, layout: Layout) -> list[int]:
    """Per layer, the rows this rank's experts receive: the slots every rank of its expert-parallel group
    routes to it (``calls``: this rank's per-layer counts to each rank of the group)."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, calls)
    rank = dist.get_rank()
    group = [r for r in range(dist.get_world_size()) if r // layout.ep == rank // layout.ep]
    return [sum(every[r][layer][rank % layout.ep] for r in group) for layer in range(len(calls))]


def _rank_main(rank: int, world: int, port: int, cases: list, out: str) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before sonar_kernels is imported (CPU: the interpreter)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        import gc

        results = []
        for case in cases:
            gc.collect()  # the previous case's models and optimizers (DDP's reference cycles) go first
            mine = measure(case)
            every = [mine]
            if world > 1:
                every = [None] * world
                dist.all_gather_object(every, mine)
            results.append(every)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        import gc

        gc.collect()
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort an interpreter's finalization (see tests/ranks.py)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cases(cases: list[Case], timeout: float = 1800) -> list[list[dict]]:
    """Measure ``cases`` (all of one world size) on that many spawned ranks (gloo on this CPU): per case,
    every rank's :func:`measure`. Raises RuntimeError when a rank fails, TimeoutError past ``timeout`` s
    (the ranks are killed either way)."""
    import tempfile

    import torch.multiprocessing as mp

    world = cases[0].layout.ranks
    if any(c.layout.ranks != world for c in cases):
        raise ValueError("run_cases takes cases of one world size")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        context = mp.start_processes(_rank_main, args=(world, _free_port(), cases, out), nprocs=world,
                                     join=False, start_method="spawn")  # fmt: skip
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(cases)} cases on {world} ranks ran past {timeout} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:  # a rank raised or died
            raise RuntimeError(f"a rank failed: {error}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        if not Path(out).exists():
            raise RuntimeError(
                f"the ranks exited without results ({[p.exitcode for p in context.processes]})"
            )
        return json.loads(Path(out).read_text())


def compare(case: Case, measured: list[dict]) -> dict:
    """The prediction of ``case`` against every rank's measurement (under expert parallelism each rank's
    prediction takes the rows its experts received in the measured step): totals, breakdowns, and the
    worst relative error of the total over the ranks."""
    ranks = []
    for m in measured:
        setup = dataclasses.replace(case.setup(_presets()), expert_rows=m.get("expert_rows"))
        predicted = predict(setup)
        ranks.append({
            "predicted": {"total": predicted.total, "phase": predicted.phase, "breakdown": predicted.breakdown},
            "measured": m,
            "relative_error": (predicted.total - m["total"]) / m["total"],
        })  # fmt: skip
    return {
        "case": dataclasses.asdict(case) | {"layout": case.layout.name, "ranks": case.layout.ranks},
        "label": case.label(),
        "ranks": ranks,
        "relative_error": max((r["relative_error"] for r in ranks), key=abs),
    }


VALIDATION_LAYOUTS = (
    Layout(), Layout(dp=2), Layout(dp=4), Layout(ep=2), Layout(ep=4), Layout(dp=2, ep=2), Layout(fsdp=2),
    Layout(fsdp=4),
)  # fmt: skip


def validation_cases() -> list[Case]:
    """The measured configurations: sonar-train's tiny presets (4 layers, batch 4 x 128) on every layout of
    :data:`VALIDATION_LAYOUTS`, fp32 and bf16, with and without activation checkpointing, standard and the
    paper's method (the torch backend, single-tensor AdamW: the CPU path); torch.optim.AdamW's foreach and
    fused implementations on one rank; sonar's fused update (the Triton interpreter) on a 2-layer model
    of H 64, I 64, E 8 (``micro-olmoe``, batch 2 x 32) on one rank, DP 2 and EP 2; and tiny-olmoe with a
    16384-token vocabulary (``tiny-olmoe-v16k``), where the cross-entropy's [T, V] tensors set the peak
    as they do at the real vocabularies, on one rank, DP 2, EP 2 and FSDP2 2."""
    cases = [
        Case(preset, method, layout, dtype, checkpointing)
        for layout in VALIDATION_LAYOUTS
        for preset in ("tiny-olmoe", "tiny-granitemoe")
        for dtype in ("float32", "bfloat16")
        for checkpointing in (True, False)
        for method in ("standard", "paper")
    ]
    cases += [Case("tiny-olmoe", method, Layout(), adamw=adamw) for adamw in ("foreach", "fused")
              for method in ("standard", "paper")]  # fmt: skip
    cases += [Case("micro-olmoe", "sonar", Layout(), dtype, checkpointing)
              for dtype in ("float32", "bfloat16") for checkpointing in (True, False)]  # fmt: skip
    cases += [Case("micro-olmoe", "sonar", Layout(dp=2)), Case("micro-olmoe", "sonar", Layout(ep=2))]
    cases += [Case("tiny-olmoe-v16k", method, Layout(), dtype, checkpointing) for dtype in ("float32", "bfloat16")
              for checkpointing in (True, False) for method in ("standard", "paper")]  # fmt: skip
    cases += [Case("tiny-olmoe-v16k", method, layout) for layout in (Layout(dp=2), Layout(ep=2), Layout(fsdp=2))
              for method in ("standard", "paper")]  # fmt: skip
    return cases


def _environment() -> dict:
    import platform

    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=Path(__file__).parent,
                                    capture_output=True, text=True, timeout=10, check=True).stdout.strip())  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "working_tree_modified": dirty,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "backend": "gloo ranks on this CPU; the Triton kernels under TRITON_INTERPRET=1",
    }


def validate(cases: list[Case] | None = None, progress=print) -> dict:
    """Measure ``cases`` (default :func:`validation_cases`) with MemTracker, one spawned job per layout,
    and compare each with :func:`predict`. Returns the report: the environment, every comparison, and
    the worst relative error of the total per layout and per (layout, method)."""
    cases = cases if cases is not None else validation_cases()
    groups: dict[Layout, list[Case]] = {}
    for case in cases:
        groups.setdefault(case.layout, []).append(case)
    comparisons, retried = [], []
    for layout, group in groups.items():
        start = time.monotonic()
        try:
            measured = run_cases(group)
        except RuntimeError as error:  # once more, on fresh ranks (see the report's "retried")
            progress(f"{layout.name}: a rank failed ({str(error).strip().splitlines()[-1][:200]}); again")
            retried.append({"layout": layout.name, "error": str(error).strip().splitlines()[-1]})
            measured = run_cases(group)
        for case, ranks in zip(group, measured, strict=True):
            comparisons.append(compare(case, ranks))
        progress(f"{layout.name}: {len(group)} cases in {time.monotonic() - start:.0f} s")
    worst: dict = {}
    for c in comparisons:
        for key in (c["case"]["layout"], f"{c['case']['layout']} {c['case']['method']}"):
            if abs(c["relative_error"]) >= abs(worst.get(key, 0.0)):
                worst[key] = c["relative_error"]
    return {**_environment(), "worst_relative_error": worst, "retried": retried, "comparisons": comparisons}


# --- the real presets ------------------------------------------------------------------------------------

REAL_PRESETS = ("olmoe-1b-7b", "granite-3.1-3b-a800m")
REAL_LAYOUTS = (Layout(dp=8), Layout(ep=8), Layout(dp=4, ep=8), Layout(fsdp=8))
# (parameter, gradient and AdamW moment bytes; activation bytes): sonar-train's --dtype bfloat16 and
# float32, and fp32 master weights with bf16 activations (composed; see Setup.compute_bytes).
PRECISIONS = {"bf16": (2, 2), "fp32 master, bf16 activations": (4, 2), "fp32": (4, 4)}


def real_setup(preset: str, method: str, layout: Layout, precision: str, checkpointing: bool = True) -> Setup:
    """The real preset's step as sonar-train runs it on GPUs: the preset's batch (4 x 1024 tokens per
    rank), the Triton backend, torch's fused AdamW (sonar-train's choice on CUDA), DDP's buckets and the
    buffers inside the custom ops counted (allocated bytes, not MemTracker's view)."""
    p = _presets()[preset]
    param_bytes, compute_bytes = PRECISIONS[precision]
    return Setup(with_layers(p), p.batch_size, p.sequence_length, method, layout, param_bytes=param_bytes,
                 compute_bytes=compute_bytes, checkpointing=checkpointing, adamw="fused", backend="triton",
                 tracker=False)  # fmt: skip


def real_table() -> str:
    """The predicted per-rank peaks of the real presets as a markdown table (GiB)."""
    lines = []
    for preset in REAL_PRESETS:
        lines += [
            f"**{preset}** (per-rank peak, GiB; activation checkpointing on / off)",
            "",
            "| layout | precision | standard | paper's method | sonar | sonar vs standard |",
            "|---|---|---|---|---|---|",
        ]
        for layout in REAL_LAYOUTS:
            for precision in PRECISIONS:
                cells, totals = [], {}
                for method in METHODS:
                    on, off = (
                        predict(real_setup(preset, method, layout, precision, ck)).total
                        for ck in (True, False)
                    )
                    totals[method] = on
                    cells.append(f"{on / 2**30:.2f} / {off / 2**30:.2f}")
                change = totals["sonar"] / totals["standard"] - 1
                lines.append(f"| {layout.name} | {precision} | {' | '.join(cells)} | {100 * change:+.1f} % |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _validation_summary(report: dict) -> str:
    rows = [
        "| layout | ranks | cases | worst error standard | worst error paper | worst error sonar |",
        "|---|---|---|---|---|---|",
    ]
    by_layout: dict = {}
    for c in report["comparisons"]:
        by_layout.setdefault((c["case"]["layout"], c["case"]["ranks"]), []).append(c)
    for (layout, ranks), group in by_layout.items():
        cells = []
        for method in METHODS:
            errors = [c["relative_error"] for c in group if c["case"]["method"] == method]
            cells.append(f"{100 * max(errors, key=abs):+.3f} %" if errors else "")
        rows.append(f"| {layout} | {ranks} | {len(group)} | {' | '.join(cells)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--validate", action="store_true", help="measure the tiny presets with MemTracker and compare"
    )
    parser.add_argument(
        "--out",
        metavar="PATH",
        help="--validate's JSON (default: bench/results/memory/<date>-cpu-memory-model.json)",
    )
    args = parser.parse_args(argv)
    if not args.validate:
        print("Predicted by bench/memory_model.py: a model, not a measurement.\n")
        print(real_table())
        return 0
    report = validate(progress=lambda line: print(line, file=sys.stderr, flush=True))
    out = Path(args.out) if args.out else (
        Path(__file__).parent / "results" / "memory" / f"{report['date'][:10]}-cpu-memory-model.json")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(_validation_summary(report))
    print(f"\nwrote {out}")
    worst = max((abs(c["relative_error"]) for c in report["comparisons"]), default=0.0)
    return 0 if worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
