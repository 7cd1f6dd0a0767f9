"""Shared types and constants of every layer: the routing metadata, the in-backward update spec and
the ownership attributes, the names of backends, activations and dtypes. Imports torch only, so that
any layer may import it.

Ownership (who updates an expert tensor in the backward) is explicit state, never a global table:

- a module that holds expert tensors marks them (:func:`mark_expert_tensors`, an attribute of the
  tensor), again whenever it gets new ones (``load_state_dict(assign=True)``, copies) and at each eager
  forward (``sonar_kernels.optim.ownership.claim_expert_tensors``);
- SonarAdamW tags every tensor it holds with itself (:func:`set_holder`), so that an experts module that
  finds at its forward a tensor held as dense by a SonarAdamW hands it over (the optimizer adopts it or
  refuses it) before any update;
- the optimizer that takes a marked tensor attaches an :class:`ExpertUpdate` to it (:func:`attach_update`),
  replacing the update of any earlier optimizer (which then lets the tensor go), and detaches it when it
  is garbage-collected;
- the autograd op reads the update of the weight it receives (:func:`update_of`). A weight that carries
  none (a dtype cast, FSDP2's unsharded parameter, ``DTensor.to_local()``) gets an ordinary gradient,
  which autograd carries back to the parameter, where the owner's post-accumulate-grad hook applies the
  update: either way the owner's update is reached, fused where the kernels hold the parameter itself.
"""

from __future__ import annotations

import math
import numbers
import re
import weakref
from typing import NamedTuple

import torch

from sonar_kernels.update_state import UpdateState

BACKENDS = ("auto", "triton", "torch")
# "silu": SwiGLU; "gelu": GeGLU with the exact erf GELU; "gelu_tanh": GeGLU with the tanh approximation
# of the GELU (torch's ``F.gelu(approximate="tanh")``, transformers' "gelu_pytorch_tanh"); "clamped_swiglu":
# gpt-oss's SwiGLU with a clamp and a sigmoid slope, parameters in the name (:func:`clamped_swiglu`).
# "relu2": squared ReLU (transformers' "relu2", Nemotron-H's experts, which have no gate).
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu2", "clamped_swiglu")
# gpt-oss's defaults (its config's swiglu_alpha, swiglu_limit).
CLAMPED_SWIGLU_DEFAULTS = (1.702, 7.0)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The expert weights' layouts (docs/design.md, "Weight layouts"). "concatenated": transformers' default,
# gate_up_proj [E, 2I, H] with the gate rows first, then the up rows, down_proj [E, H, I];
# "interleaved": gate and up rows alternate (gate 0, up 0, gate 1, ...: torchtitan's fused w13, gpt-oss);
# "ungated": no gate, gate_up_proj is the up projection alone [E, I, H] (transformers' has_gate=False:
# Nemotron-H); "_transposed": both weights stored transposed (gate_up_proj [E, H, 2I], down_proj [E, I, H]:
# transformers' is_transposed, gpt-oss, Aria); "separate": the gate and the up projection are two tensors
# (gate_up_proj the gate [E, I, H], up_proj the up projection [E, I, H] with the same strides: torchtitan's
# w1 and w3, Megatron-Core's). Every layout is read and updated in place through its strides.
LAYOUTS = (
    "concatenated",
    "interleaved",
    "ungated",
    "separate",
    "concatenated_transposed",
    "interleaved_transposed",
    "ungated_transposed",
    "separate_transposed",
)
INDEX_DTYPES = (torch.int32, torch.int64)
# The routing metadata's expert axis is one register tile.
MAX_EXPERTS = 1024
# The expert tensors of a layer (the weights, a separate layout's up tensor, the biases), in the order the
# ops take them; the backward computes each one's gradient in a job of its own
# (``sonar_kernels.ops.library.expert_wgrad_``).
EXPERT_TENSORS = ("gate_up_proj", "down_proj", "up_proj", "gate_up_proj_bias", "down_proj_bias")
# The order of the AdamW hyperparameters in the float64 tensor the update kernels read.
HYPERPARAMETERS = ("lr", "beta1", "beta2", "eps", "weight_decay")
# The two entries that follow them with expert clipping (docs/design.md, "Expert clipping").
CLIPPING = ("spike_threshold", "grad_scale")


class RoutingMetadata(NamedTuple):
    """Routing metadata of one MoE layer (docs/design.md, "Forward", step 1).

    S = T * top_k slots; slot s = t * top_k + j. Slots whose expert id lies outside [0, E) are dropped.
    The kept slots are stably sorted by expert; row r of the sorted order belongs to expert e when
    ``expert_offsets[e] <= r < expert_offsets[e + 1]``.

    The Triton grouped GEMMs cut each expert's rows into blocks of ``block_m`` rows: tile m (an index over
    all experts) belongs to expert e when ``tile_offsets[e] <= m < tile_offsets[e + 1]``.

    Attributes:
        expert_offsets: [E + 1] int32, ``expert_offsets[0] == 0``, ``expert_offsets[E]`` = kept slots.
        tile_offsets: [E + 1] int32, exclusive prefix sum of ``ceil(rows of e / block_m)``.
        row_of_slot: [S] int32, the row of each slot, -1 for a dropped slot.
        token_of_row: [S] int32, the token of each row; rows >= ``expert_offsets[E]`` are unspecified.
        slot_of_row: [S] int32, the slot of each row; rows >= ``expert_offsets[E]`` are unspecified.
    """

    expert_offsets: torch.Tensor
    tile_offsets: torch.Tensor
    row_of_slot: torch.Tensor
    token_of_row: torch.Tensor
    slot_of_row: torch.Tensor


class Hyperparameters(NamedTuple):
    """One parameter group's AdamW hyperparameters (:data:`HYPERPARAMETERS`' order), each a Python float or
    a one-element tensor as the group holds them (torch's AdamW takes either)."""

    lr: float | torch.Tensor
    beta1: float | torch.Tensor
    beta2: float | torch.Tensor
    eps: float | torch.Tensor
    weight_decay: float | torch.Tensor


class BackwardCore(NamedTuple):
    """What a layer's backward computes once, before its expert tensors' gradients
    (``sonar_kernels::moe_mlp_bwd``, either backend), each None where it was not asked for.

    Attributes:
        grad_hidden_states: [T, H], the input's gradient (dX).
        grad_top_k_weights: [T, top_k], the routing weights' gradient.
        grad_hpre: [S, 2I] (gated; [S, I] otherwise), dHpre: the gate/up projection's wgrad operand.
        a: [S, I], the activations A recomputed from Hpre: the down projection's wgrad operand.
        magnitudes: [n] float32, the bounds of the updated tensors' gradients (the Triton backend only,
            ``ops/triton_backend/update_bound.py``).
    """

    grad_hidden_states: torch.Tensor | None
    grad_top_k_weights: torch.Tensor | None
    grad_hpre: torch.Tensor | None
    a: torch.Tensor | None
    magnitudes: torch.Tensor | None


# transformers' experts_implementation name of this library.
IMPLEMENTATION = "sonar"
# The attributes that carry ownership on an expert tensor (see "Ownership" in docs/usage.md).
EXPERT_MARK = "sonar_expert"
UPDATE_ATTRIBUTE = "sonar_update"
HOLDER_ATTRIBUTE = "sonar_holder"
EXPERT_PARALLEL_ATTRIBUTE = "sonar_expert_parallel_group"
EXPERT_MODULE_ATTRIBUTE = "sonar_expert_module"


class ExpertUpdate:
    """The in-backward AdamW update of one expert tensor, as the backward needs it: the tensors it reads
    and writes and the options, attached to the tensor by the optimizer that owns it (the autograd layer
    never sees the optimizer itself).

    Attributes:
        exp_avg, exp_avg_sq: the moments, the tensor's shape and strides; float32/bfloat16/float16, or,
            with 8-bit moments, their int8 and uint8 codes (docs/design.md, "8-bit moments").
        exp_avg_scales, exp_avg_sq_scales: None, or the 8-bit moments' fp32 block scales.
        remainder: None, or the int16 remainder of a bf16 weight whose fp32 master it completes
            (docs/design.md, "bf16 master weights").
        seed: None, or the 0-dim int64 seed of a bf16 weight's stochastic rounding stream (the same).
        step: [] float32 on the tensor's device, advanced on the device by each applied update.
        hyper: [5] float64 on the tensor's device: lr, beta1, beta2, eps, weight_decay
            (``HYPERPARAMETERS``), [7] with expert clipping (then ``CLIPPING``: spike_threshold, inf when
            off, and grad_scale, the lagged clipping coefficient, 1 when off), read by the kernels when they run and rewritten by the owner from the
            parameter group just before each update, so that a scheduler's change reaches compiled steps.
            Shared by the tensors of a parameter group.
        grad_norm_sq: [] float32, receives the squared L2 norm of each update's gradient (inf when the
            update was skipped for a non-finite gradient).
        skipped: [] int64, counts the updates skipped for a non-finite or too large gradient.
        clipped: [] int64, receives the number of gradient entries the spike rule replaced in each update
            (expert clipping, when ``hyper`` has its [7] form; docs/design.md, "Expert clipping").
        grad_dtype: the fp32 wgrad is rounded to this dtype before the AdamW math.
        fused: Triton backend: AdamW in the wgrad epilogue (True), the split path (False, same bits), or
            the faster of the two, tuned on CUDA (None; ``ops/triton_backend/wgrad_update.py``).
        foreach, torch_fused: torch.optim.AdamW's flags for the updates that torch's AdamW applies (the
            torch backend, and gradients that reach ``.grad``).
        accumulation_steps: micro-batches per optimizer step.
        reduce_first: the gradient must be averaged over a data-parallel group before the update: the
            backward gives the tensor an ordinary gradient, and the owner reduces it and applies the
            update when the reduction is done (never in the wgrad epilogue).

    The methods are the owner's bookkeeping, which the autograd layer calls in eager mode only (under
    torch.compile the backward reads the tensors above and nothing else). Copying or pickling an update
    gives None: a copied tensor is not owned.
    """

    def __init__(
        self,
        *,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step: torch.Tensor,
        hyper: torch.Tensor,
        grad_norm_sq: torch.Tensor,
        skipped: torch.Tensor,
        grad_dtype: torch.dtype,
        clipped: torch.Tensor | None = None,
        fused: bool | None = True,
        foreach: bool | None = None,
        torch_fused: bool | None = None,
        accumulation_steps: int = 1,
        reduce_first: bool = False,
        exp_avg_scales: torch.Tensor | None = None,
        exp_avg_sq_scales: torch.Tensor | None = None,
        remainder: torch.Tensor | None = None,
        seed: torch.Tensor | None = None,
    ):
        self.exp_avg = exp_avg
        self.exp_avg_sq = exp_avg_sq
        self.step = step
        self.hyper = hyper
        self.grad_norm_sq = grad_norm_sq
        self.skipped = skipped
        self.clipped = clipped if clipped is not None else torch.zeros_like(skipped)
        self.grad_dtype = grad_dtype
        self.fused = fused
        self.foreach = foreach
        self.torch_fused = torch_fused
        self.accumulation_steps = accumulation_steps
        self.reduce_first = reduce_first
        self.exp_avg_scales = exp_avg_scales
        self.exp_avg_sq_scales = exp_avg_sq_scales
        if remainder is not None and seed is not None:
            raise ValueError("an update keeps a remainder or a stochastic rounding's seed, not both")
        self.remainder = remainder
        self.seed = seed

    def state(self) -> list[torch.Tensor]:
        """The tensors the update writes, in the order the ``sonar_kernels::`` ops take them (``hyper`` is
        passed apart: it is only read): ``update_state.UpdateState.tensors``."""
        return UpdateState(
            self.exp_avg, self.exp_avg_sq, self.step, self.grad_norm_sq, self.skipped, self.clipped,
            self.exp_avg_scales, self.exp_avg_sq_scales, self.remainder, self.seed,
        ).tensors()  # fmt: skip

    def accumulating(self) -> bool:
        """Whether the next backward's gradient is kept for later (micro-batches 1 .. k-1 of k)."""
        return False

    def track(self, graph) -> None:
        """A forward recorded ``graph`` (its autograd node) over the tensor."""

    def untrack(self, graph) -> None:
        """The backward of ``graph`` ran without computing the tensor's gradient: it no longer counts as
        a live graph over the tensor."""

    def begin_backward(self, graph) -> None:
        """The backward of ``graph`` is about to update the tensor or add to its gradient: raise now,
        before anything is written, when that would be wrong."""

    def grad_in(self) -> torch.Tensor | None:
        """The gradient of earlier micro-batches (in ``grad_dtype``, the tensor's strides), or None."""
        return None

    def hyperparameters(self) -> Hyperparameters | None:
        """(lr, beta1, beta2, eps, weight_decay) as the owner's parameter group holds them (floats or
        one-element tensors), which torch's AdamW takes on the torch backend so that tensor values get its
        arithmetic for tensors; None: the values of ``hyper``."""
        return None

    def accumulation_buffer(self) -> tuple[torch.Tensor, bool] | None:
        """Where the Triton backward adds a micro-batch's gradient when it is kept outside ``.grad``:
        (buffer, whether it holds earlier micro-batches), or None (``.grad``)."""
        return None

    def finish(self, applied: bool) -> None:
        """Right after the launch that updated the tensor (``applied``) or added to its buffer."""

    def compiled_update(self) -> None:
        """A compiled backward is about to update the tensor (its check op, at run time): raise when that
        would be wrong (it was updated since the last ``step()``), else record the update."""

    def forward_without_graph(self) -> None:
        """A forward used the tensor without recording a graph (grad mode off while it requires grad):
        reentrant activation checkpointing runs a region so, and records it again inside the backward."""

    def forward_in_backward(self, accumulates: bool) -> bool:
        """A forward recorded a graph over the tensor inside the running backward (reentrant activation
        checkpointing's recomputation), whose own backward runs nested in it; ``accumulates``: the
        running backward also delivers a part of the tensor's gradient (a penalty on the weights).
        Returns whether that part already reached ``.grad`` (the update then reads it there)."""
        return False

    def __reduce__(self):
        return (type(None), ())

    def __deepcopy__(self, memo):
        return None


def is_real_number(value) -> bool:
    """Whether ``value`` is a real number as torch's optimizers take one: a Python int or float, or any type
    registered as :class:`numbers.Real` (numpy's float32, float64, int64 ...); never a bool (numpy's
    included), which is not a number there."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ != "bool_"


def is_integer(value) -> bool:
    """Whether ``value`` is an integer: a Python int or any :class:`numbers.Integral` (numpy's int64 ...),
    never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def mark_expert_tensors(*tensors: torch.Tensor) -> None:
    """Mark tensors as expert weights, which :class:`sonar_kernels.SonarAdamW` updates in the backward:
    an attribute of each tensor, not a global table (modules mark the tensors they get anew, e.g. after
    ``load_state_dict(assign=True)``)."""
    for t in tensors:
        setattr(t, EXPERT_MARK, True)


def mark_expert_parallel(group, *tensors: torch.Tensor) -> None:
    """Declare ``tensors`` expert-parallel over the torch.distributed process group ``group``: each rank
    holds its own experts, and every token routed to them reaches this rank (an all-to-all dispatch), so
    the rank's gradient of them is complete and their in-backward update needs no gradient collective."""
    for t in tensors:
        setattr(t, EXPERT_PARALLEL_ATTRIBUTE, group)


def expert_parallel_group(t: torch.Tensor):
    """The group given to :func:`mark_expert_parallel` for ``t``, or None."""
    return getattr(t, EXPERT_PARALLEL_ATTRIBUTE, None)


def is_expert_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` was marked by :func:`mark_expert_tensors`."""
    return bool(getattr(t, EXPERT_MARK, False))


class _Holder:
    """A weak reference to the optimizer that holds a tensor (or the module that holds it); copying or
    pickling it gives None (a copied tensor is not held)."""

    def __init__(self, optimizer):
        self.ref = weakref.ref(optimizer)

    def __reduce__(self):
        return (type(None), ())

    def __deepcopy__(self, memo):
        return None


def set_holder(t: torch.Tensor, optimizer) -> None:
    """Record on ``t`` (weakly) the in-backward optimizer that holds it among its parameters."""
    setattr(t, HOLDER_ATTRIBUTE, _Holder(optimizer))


def holder_of(t: torch.Tensor):
    """The live optimizer recorded on ``t`` by :func:`set_holder`, or None."""
    holder = getattr(t, HOLDER_ATTRIBUTE, None)
    return holder.ref() if isinstance(holder, _Holder) else None


def set_expert_module(t: torch.Tensor, module: torch.nn.Module) -> None:
    """Record on ``t`` (weakly) the experts module that holds it (copies of ``t`` do not keep it)."""
    setattr(t, EXPERT_MODULE_ATTRIBUTE, _Holder(module))


def expert_module_of(t: torch.Tensor) -> torch.nn.Module | None:
    """The live module recorded on ``t`` by :func:`set_expert_module`, or None."""
    holder = getattr(t, EXPERT_MODULE_ATTRIBUTE, None)
    return holder.ref() if isinstance(holder, _Holder) else None


def update_of(t: torch.Tensor) -> ExpertUpdate | None:
    """The in-backward update attached to ``t`` by the optimizer that owns it, or None."""
    update = getattr(t, UPDATE_ATTRIBUTE, None)
    return update if isinstance(update, ExpertUpdate) else None


def attach_update(t: torch.Tensor, update: ExpertUpdate | None) -> None:
    """Attach ``update`` to ``t``; None detaches."""
    if update is None:
        if hasattr(t, UPDATE_ATTRIBUTE):
            delattr(t, UPDATE_ATTRIBUTE)
    else:
        setattr(t, UPDATE_ATTRIBUTE, update)


def expert_weight_names(module: torch.nn.Module) -> tuple[str, ...]:
    """The names of a transformers experts module's expert tensors: ``gate_up_proj`` (``up_proj`` when
    ``has_gate`` is False), ``down_proj`` and, with ``has_bias``, their biases (``<name>_bias``)."""
    first = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    names = (first, "down_proj")
    if getattr(module, "has_bias", False):
        names += (f"{first}_bias", "down_proj_bias")
    return names


def is_experts_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` looks like a transformers experts module (any experts implementation)."""
    return hasattr(module, "has_gate") and isinstance(
        getattr(module, expert_weight_names(module)[0], None), torch.nn.Parameter
    )


def expert_tensors_of(module: torch.nn.Module) -> tuple[torch.Tensor, ...] | None:
    """The expert tensors a module holds: those its ``expert_tensors()`` method names
    (:class:`sonar_kernels.SonarExperts`), or those of a transformers experts module whose config selects
    experts_implementation "sonar" (:func:`expert_weight_names`: the weights, and the biases with
    has_bias); None otherwise. Imports no integration."""
    method = getattr(module, "expert_tensors", None)
    if callable(method):
        return tuple(method())
    config = getattr(module, "config", None)
    if getattr(config, "_experts_implementation", None) != IMPLEMENTATION or not is_experts_module(module):
        return None
    tensors = tuple(getattr(module, name, None) for name in expert_weight_names(module))
    if not all(isinstance(t, torch.nn.Parameter) for t in tensors):
        return None
    return tensors


def layout_name(transposed: bool, interleaved: bool, gated: bool = True, separate: bool = False) -> str:
    """The name in :data:`LAYOUTS` of the weights' layout (``interleaved`` is ignored without a gate;
    ``separate``: the up projection is a tensor of its own)."""
    if separate:
        kind = "separate"
    else:
        kind = "ungated" if not gated else "interleaved" if interleaved else "concatenated"
    return kind + ("_transposed" if transposed else "")


def is_separate(layout: str) -> bool:
    """Whether ``layout`` holds the gate and the up projection in two tensors (gate_up_proj the gate)."""
    return layout.startswith("separate")


def is_gated(layout: str) -> bool:
    """Whether ``layout``'s gate_up_proj holds a gate and an up projection (else the up projection alone)."""
    return not layout.startswith("ungated")


def gate_up_view(gate_up_proj: torch.Tensor, layout: str) -> torch.Tensor:
    """``gate_up_proj`` (or a tensor of its shape and strides: a moment, a gradient) of ``layout`` seen
    as [E, 2, I, H]: [:, 0] the gate projection, [:, 1] the up projection, each [I, H]; an ungated
    layout as [E, 1, I, H], and so a separate layout's gate (or up) tensor alone. A view, never a copy
    (splitting a dimension and transposing are always views)."""
    w = gate_up_proj.transpose(1, 2) if layout.endswith("_transposed") else gate_up_proj  # [E, 2I, H]
    return _halves(w, layout)


def _halves(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Dimension 1 of ``t`` (W1's 2I rows, or its bias's 2I entries) split into [2, I] (gate, up) as
    ``layout`` orders them ([1, I] without a gate). A view."""
    if not is_gated(layout) or is_separate(layout):
        return t.unsqueeze(1)
    half = t.shape[1] // 2
    if layout.startswith("interleaved"):
        return t.unflatten(1, (half, 2)).transpose(1, 2)
    return t.unflatten(1, (2, half))


def gate_up_bias_view(gate_up_proj_bias: torch.Tensor, layout: str) -> torch.Tensor:
    """``gate_up_proj_bias`` [E, 2I] of ``layout`` seen as [E, 2, I] ([:, 0] the gate, [:, 1] the up
    projection's bias; interleaved as the weight's rows are; [E, 1, I] ungated). A view."""
    return _halves(gate_up_proj_bias, layout)


def down_view(down_proj: torch.Tensor, layout: str) -> torch.Tensor:
    """``down_proj`` of ``layout`` seen as [E, H, I] (a view); its own inverse."""
    return down_proj.transpose(1, 2) if layout.endswith("_transposed") else down_proj


def clamped_swiglu(
    alpha: float = CLAMPED_SWIGLU_DEFAULTS[0], limit: float = CLAMPED_SWIGLU_DEFAULTS[1]
) -> str:
    """The activation name of gpt-oss's clamped SwiGLU with slope ``alpha`` and clamp ``limit``:
    ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``, ``A = (u + 1) * g * sigmoid(alpha * g)``
    (transformers' ``GptOssExperts._apply_gate``); the gradient through each clamp is torch's (it passes
    where the input is within the bounds, bounds included). Pass it as ``activation=`` of
    :func:`sonar_kernels.moe_mlp`; ``"clamped_swiglu"`` alone takes gpt-oss's alpha 1.702 and limit 7.0."""
    return f"clamped_swiglu(alpha={float(alpha)!r}, limit={float(limit)!r})"


_CLAMPED = re.compile(r"clamped_swiglu\(alpha=(?P<alpha>[^,]+), limit=(?P<limit>[^)]+)\)")


def parse_activation(activation: str) -> tuple[str, float, float]:
    """(kind in :data:`ACTIVATIONS`, alpha, limit) of an activation name; alpha and limit are
    gpt-oss's defaults for every kind but a parametrized ``clamped_swiglu(...)``.

    Raises:
        ValueError: not an activation name, or a clamped SwiGLU with a non-finite alpha or a limit
            that is not a finite number > 0.
    """
    if activation in ACTIVATIONS:
        return (activation, *CLAMPED_SWIGLU_DEFAULTS)
    match = _CLAMPED.fullmatch(activation) if isinstance(activation, str) else None
    if match is None:
        raise ValueError(
            f"activation must be one of {ACTIVATIONS} or clamped_swiglu(alpha=..., limit=...) "
            f"(sonar_kernels.clamped_swiglu), got {activation!r}"
        )
    try:
        alpha, limit = float(match["alpha"]), float(match["limit"])
    except ValueError:
        raise ValueError(f"activation {activation!r}: alpha and limit must be numbers") from None
    if not (math.isfinite(alpha) and math.isfinite(limit) and limit > 0):
        raise ValueError(f"activation {activation!r}: alpha must be finite and limit a finite number > 0")
    return "clamped_swiglu", alpha, limit
