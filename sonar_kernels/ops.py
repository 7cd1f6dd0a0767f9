"""Host launchers: validate, allocate, build the grid, launch. No host sync on any path here."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sonar_kernels.kernels.adamw import ADAMW_CONFIG, _adamw_kernel
from sonar_kernels.kernels.expert_mlp_bwd import (
    DHPRE_CONFIG,
    DWEIGHTS_CONFIG,
    WGRAD_CONFIG,
    _expert_mlp_bwd_dhpre_kernel,
    _expert_mlp_bwd_dw_kernel,
    _expert_mlp_bwd_dweights_kernel,
)
from sonar_kernels.kernels.expert_mlp_fwd import (
    COMBINE_CONFIG,
    FWD_GEMM_CONFIG,
    TILE_M,
    _expert_mlp_combine_kernel,
    _expert_mlp_fwd_up_kernel,
    _expert_mlp_grouped_mm_kernel,
)
from sonar_kernels.kernels.routing import _routing_metadata_kernel
from sonar_kernels.reference import ACTIVATIONS, RoutingMetadata

BACKENDS = ("auto", "triton", "torch")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# The routing kernel holds a [BLOCK_S, BLOCK_E] one-hot tile of the experts in registers.
MAX_EXPERTS = 1024


def triton_interpreting() -> bool:
    """True when the Triton kernels run under the interpreter (TRITON_INTERPRET=1 before import)."""
    from triton.runtime.interpreter import InterpretedFunction

    from sonar_kernels.kernels import routing

    return isinstance(routing._routing_metadata_kernel, InterpretedFunction)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer a launcher allocates comes from here (tests fill it with NaN to catch unwritten data)."""
    return torch.empty(shape, dtype=dtype, device=device)


def check_moe_mlp_args(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, backend
) -> str:
    """Validate the arguments of :func:`sonar_kernels.moe_mlp` and resolve ``backend``.

    Returns:
        "triton" or "torch".
    Raises:
        TypeError: an argument is not a tensor, or has a dtype outside what is supported.
        ValueError: shapes disagree, tensors are on different devices, unknown activation or backend,
            or backend "triton" for CPU tensors without the Triton interpreter.
    """
    tensors = {
        "hidden_states": hidden_states,
        "top_k_index": top_k_index,
        "top_k_weights": top_k_weights,
        "gate_up_proj": gate_up_proj,
        "down_proj": down_proj,
    }
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    # dtypes
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"hidden_states must be float32, bfloat16 or float16, got {hidden_states.dtype}")
    if top_k_index.dtype not in INDEX_DTYPES:
        raise TypeError(f"top_k_index must be int32 or int64 expert ids, got {top_k_index.dtype}")
    if top_k_weights.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"top_k_weights must be float32, bfloat16 or float16, got {top_k_weights.dtype}")
    for name in ("gate_up_proj", "down_proj"):
        w = tensors[name]
        if w.dtype not in (hidden_states.dtype, torch.float32):
            raise TypeError(
                f"{name} must have the dtype of hidden_states ({hidden_states.dtype}) or float32 "
                f"(master weights), got {w.dtype}"
            )

    # shapes
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [T, H], got shape {tuple(hidden_states.shape)}")
    T, H = hidden_states.shape
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T:
        raise ValueError(f"top_k_index must be [T, top_k] with T = {T}, got shape {tuple(top_k_index.shape)}")
    if top_k_index.numel() >= 2**31:
        raise ValueError(
            f"top_k_index must hold fewer than 2**31 slots (T * top_k), got {top_k_index.numel()}"
        )
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_weights must have the shape of top_k_index {tuple(top_k_index.shape)}, "
            f"got {tuple(top_k_weights.shape)}"
        )
    if gate_up_proj.dim() != 3:
        raise ValueError(f"gate_up_proj must be [E, 2I, H], got shape {tuple(gate_up_proj.shape)}")
    if down_proj.dim() != 3:
        raise ValueError(f"down_proj must be [E, H, I], got shape {tuple(down_proj.shape)}")
    if H < 1:
        raise ValueError(
            f"hidden_states must have a hidden size H >= 1, got shape {tuple(hidden_states.shape)}"
        )
    E, two_I, H1 = gate_up_proj.shape
    if E < 1:
        raise ValueError(f"gate_up_proj must hold at least one expert, got shape {tuple(gate_up_proj.shape)}")
    if E > MAX_EXPERTS:
        raise ValueError(f"at most {MAX_EXPERTS} experts are supported, gate_up_proj has {E}")
    if H1 != H:
        raise ValueError(
            f"gate_up_proj.shape[2] must equal the hidden size H = {H} of hidden_states, got {H1}"
        )
    if down_proj.shape[0] != E:
        raise ValueError(
            f"down_proj.shape[0] must equal the number of experts E = {E} of gate_up_proj, got {down_proj.shape[0]}"
        )
    if down_proj.shape[1] != H:
        raise ValueError(
            f"down_proj.shape[1] must equal the hidden size H = {H} of hidden_states, got {down_proj.shape[1]}"
        )
    if two_I != 2 * down_proj.shape[2] or two_I == 0:
        raise ValueError(
            f"gate_up_proj.shape[1] must be 2 * down_proj.shape[2] = 2I (I >= 1), "
            f"got {two_I} and I = {down_proj.shape[2]}"
        )

    # devices
    device = hidden_states.device
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(
                f"{name} is on {t.device}, but hidden_states is on {device}: put all tensors on one device"
            )

    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not (device.type == "cpu" and triton_interpreting()):
        raise ValueError(
            f"backend='triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before "
            f"sonar_kernels is imported; got tensors on {device}. Use backend='torch' or 'auto'."
        )
    return backend


def _input_precision(dtype: torch.dtype) -> str:
    # Full fp32 products for fp32 GEMMs: the GPU would otherwise silently use tf32 (DESIGN.md).
    return "ieee" if dtype == torch.float32 else "tf32"


def routing_block_config(num_experts: int) -> dict:
    """BLOCK_E covers all experts; BLOCK_S keeps the [BLOCK_S, BLOCK_E] one-hot tile at 8192 elements."""
    block_e = max(16, triton.next_power_of_2(num_experts))
    return {"BLOCK_E": block_e, "BLOCK_S": max(8, 8192 // block_e), "num_warps": 4}


def routing_metadata(top_k_index: torch.Tensor, num_experts: int) -> RoutingMetadata:
    """Routing metadata on the device in one launch (see :class:`sonar_kernels.reference.RoutingMetadata`).

    Args:
        top_k_index: [T, top_k] int32/int64 expert ids, any strides; ids outside [0, E) are dropped.
        num_experts: E, 1 <= E <= 1024.
    Returns:
        RoutingMetadata with ``tile_offsets`` for row tiles of ``TILE_M`` rows. The tails of
        ``token_of_row`` and ``slot_of_row`` (rows >= expert_offsets[E]) are left unwritten.
    """
    T, top_k = top_k_index.shape
    S = T * top_k
    device = top_k_index.device
    meta = RoutingMetadata(
        expert_offsets=_empty((num_experts + 1,), torch.int32, device),
        tile_offsets=_empty((num_experts + 1,), torch.int32, device),
        row_of_slot=_empty((S,), torch.int32, device),
        token_of_row=_empty((S,), torch.int32, device),
        slot_of_row=_empty((S,), torch.int32, device),
    )
    cfg = routing_block_config(num_experts)
    with _on_device(device):
        _routing_metadata_kernel[(1,)](
            top_k_index, meta.expert_offsets, meta.tile_offsets, meta.row_of_slot, meta.token_of_row,
            meta.slot_of_row,
            S, num_experts, top_k,
            top_k_index.stride(0), top_k_index.stride(1),
            TILE_M=TILE_M, BLOCK_S=cfg["BLOCK_S"], BLOCK_E=cfg["BLOCK_E"], num_warps=cfg["num_warps"],
        )  # fmt: skip
    return meta


def _max_row_tiles(S: int, E: int, block_m: int) -> int:
    """Grid rows of a grouped GEMM without a host sync: sum_e ceil(rows_e / block_m) <= cdiv(S, block_m)
    + min(E, S); the programs past tile_offsets[E] exit at once."""
    return triton.cdiv(S, block_m) + min(E, S)


def _on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def moe_mlp_fwd(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, RoutingMetadata]:
    """Triton forward of the gated expert MLP; arguments as checked by :func:`check_moe_mlp_args`.

    Four launches: routing metadata, up-projection + GLU, down-projection, combine. Any strides.
    Returns:
        (out [T, H] in the dtype of hidden_states, Hpre [S, 2I] in that dtype (rows past
        expert_offsets[E] unwritten), the routing metadata).
    """
    with _on_device(hidden_states.device):
        return _moe_mlp_fwd(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)


def _moe_mlp_fwd(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation):
    T, H = hidden_states.shape
    top_k = top_k_index.shape[1]
    E, two_I, _ = gate_up_proj.shape
    I = two_I // 2
    S = T * top_k
    dtype = hidden_states.dtype
    device = hidden_states.device
    interpret = triton_interpreting()
    out = _empty((T, H), dtype, device)
    meta = routing_metadata(top_k_index, E)
    hpre = _empty((S, two_I), dtype, device)
    if S == 0:
        return out.zero_(), hpre, meta

    cfg = FWD_GEMM_CONFIG
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    max_row_tiles = _max_row_tiles(S, E, block_m)
    precision = _input_precision(dtype)

    a = _empty((S, I), dtype, device)
    _expert_mlp_fwd_up_kernel[(max_row_tiles * triton.cdiv(I, block_n),)](
        hidden_states, gate_up_proj, meta.token_of_row, meta.expert_offsets, meta.tile_offsets, hpre, a,
        E, H, I,
        hidden_states.stride(0), hidden_states.stride(1),
        gate_up_proj.stride(0), gate_up_proj.stride(1), gate_up_proj.stride(2),
        hpre.stride(0), hpre.stride(1), a.stride(0), a.stride(1),
        ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        INPUT_PRECISION=precision, INTERPRET=interpret, **launch,
    )  # fmt: skip

    y = _empty((S, H), dtype, device)
    _expert_mlp_grouped_mm_kernel[(max_row_tiles * triton.cdiv(H, block_n),)](
        a, down_proj, meta.expert_offsets, meta.tile_offsets, y,
        E, H, I,
        a.stride(0), a.stride(1),
        down_proj.stride(0), down_proj.stride(1), down_proj.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        INPUT_PRECISION=precision, INTERPRET=interpret, **launch,
    )  # fmt: skip
    del a

    cc = COMBINE_CONFIG
    _expert_mlp_combine_kernel[(triton.cdiv(T, cc["BLOCK_M"]), triton.cdiv(H, cc["BLOCK_N"]))](
        y, meta.row_of_slot, top_k_weights, out,
        T, H, top_k,
        y.stride(0), y.stride(1), top_k_weights.stride(0), top_k_weights.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=cc["BLOCK_M"], BLOCK_N=cc["BLOCK_N"], HAS_WEIGHTS=True, INTERPRET=interpret,
        num_warps=cc["num_warps"],
    )  # fmt: skip
    return out, hpre, meta


class AdamWUpdate(NamedTuple):
    """The AdamW update of one expert weight tensor, applied by its wgrad launch (DESIGN.md).

    Attributes:
        exp_avg, exp_avg_sq: the moments: the weight's shape and strides, float32/bfloat16/float16.
        step: [] float32 on the weight's device, the step count; advanced by 1 - skip (0 or 1, decided on
            the device) just before the update's launch.
        lr, beta1, beta2, eps, weight_decay: Python floats, as in torch.optim.AdamW (decoupled decay).
        grad_dtype: the fp32 wgrad accumulator is rounded to this dtype before the AdamW math.
        fused: True: AdamW in the wgrad epilogue, no gradient tensor. False: the split path, the same
            wgrad kernel writing a temporary gradient, then the standalone AdamW kernel (same bits).
        on_done: called right after this weight's update is launched, before any later launch of the
            backward (so a failure further on cannot leave an applied update unrecorded).
        grad_in: the gradient of earlier micro-batches (gradient accumulation), in ``grad_dtype`` with
            the weight's strides; the update uses round(grad_in + round(wgrad)), as autograd would sum
            them in ``.grad``. None: this backward's gradient alone.
        grad_norm_sq: a 0-dim float32 tensor on the weight's device that receives the squared L2 norm of
            the gradient the update used (per-program partial sums, added in a fixed order; no atomics),
            or inf when the update was skipped.
        skipped: a 0-dim int64 tensor on the weight's device, incremented when the update is skipped.

    Non-finite gradients: the update of the whole tensor is skipped (W, exp_avg, exp_avg_sq and step
    unchanged) when any entry of the gradient it would use, rounded to ``grad_dtype`` and summed with
    ``grad_in``, is NaN, infinite, or larger in magnitude than :func:`grad_limit` of exp_avg_sq's dtype
    (so that g * g, and exp_avg_sq, stay finite). The decision is made on the device before the update's
    launch, with no host sync (see :func:`_wgrad`).
    """

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_dtype: torch.dtype
    fused: bool = True
    on_done: Callable[[], None] | None = None
    grad_in: torch.Tensor | None = None
    grad_norm_sq: torch.Tensor | None = None
    skipped: torch.Tensor | None = None


class GradAccumulator(NamedTuple):
    """A gradient-accumulation buffer the wgrad launch adds this backward's gradient of a weight to
    (micro-batches before the last one, when the buffer's dtype is not the weight's, e.g. float32 for
    bfloat16 weights; ``.grad`` must have the weight's dtype).

    Attributes:
        buffer: the weight's shape and strides, float32/bfloat16/float16; receives
            round(buffer + round(wgrad)) when ``add``, round(wgrad) otherwise, round() to its dtype.
        add: whether the buffer holds earlier micro-batches' gradient.
        on_done: called right after the launch.
    """

    buffer: torch.Tensor
    add: bool
    on_done: Callable[[], None] | None = None


def grad_limit(moments_dtype: torch.dtype) -> float:
    """The largest gradient magnitude an in-backward AdamW update takes with exp_avg_sq in
    ``moments_dtype``: the largest power of two whose square that dtype holds (2**63 for float32 and
    bfloat16, 2**7 for float16). exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g then stays
    finite for every beta2."""
    return 2.0 ** (math.floor(math.log2(torch.finfo(moments_dtype).max)) // 2)


@functools.cache
def torch_fused_adamw_arithmetic() -> str:
    """How the installed torch's fused CUDA AdamW computes, read from the ATen header its wheel ships.

    Returns:
        "fp32" when its same-dtype kernel rounds the hyperparameters to fp32 and uses fma (torch 2.13),
        "fp64" otherwise (hyperparameters as C++ doubles, DESIGN.md's account; also when the header is
        missing, with a warning).
    """
    header = Path(torch.__file__).parent / "include" / "ATen" / "native" / "cuda" / "fused_adam_utils.cuh"
    try:
        source = "".join(header.read_text().split())
    except OSError:
        warnings.warn(
            f"{header} not found: the in-backward AdamW uses the fp64 arithmetic, which may differ from "
            "torch.optim.AdamW(fused=True) in the last bits",
            stacklevel=2,
        )
        return "fp64"
    markers = ("std::fma(-beta1,grad,grad)", "beta1_opmath=static_cast<opmath_t>(beta1)")
    return "fp32" if all(m in source for m in markers) else "fp64"


def adamw_arithmetic(device: torch.device) -> str:
    """The arithmetic of the in-backward AdamW on ``device`` (see sonar_kernels/kernels/adamw.py): on
    NVIDIA CUDA that of torch's fused AdamW there (the bit-exact target); elsewhere (CPU, ROCm) "fp64",
    within a few ulps of torch's AdamW."""
    if device.type == "cuda" and torch.version.hip is None:
        return torch_fused_adamw_arithmetic()
    return "fp64"


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly ``numel`` storage elements from its first (no gaps, no overlap)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _laid_out_like(t, weight: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor with the shape, strides and device of ``weight`` (a kernel walks both
    with the same offsets)."""
    return (
        isinstance(t, torch.Tensor)
        and t.shape == weight.shape
        and t.stride() == weight.stride()
        and t.device == weight.device
    )


def check_adamw_update(name: str, weight: torch.Tensor, update: AdamWUpdate) -> None:
    """Validate the in-place AdamW update of ``weight`` (called before any kernel of the backward runs).

    Raises:
        TypeError: a dtype outside float32/bfloat16/float16, or a step that is not a float32 tensor.
        ValueError: moments whose shape, strides or device differ from the weight's, a weight that is
            not dense, a step that is not 0-dim on the weight's device, or hyperparameters outside
            torch.optim.AdamW's ranges.
    """
    if weight.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16 to be updated, got {weight.dtype}")
    if not is_dense(weight):
        raise ValueError(f"{name} must be a dense tensor (no gaps or overlaps) to be updated in place")
    for key in ("exp_avg", "exp_avg_sq"):
        m = getattr(update, key)
        if not isinstance(m, torch.Tensor) or m.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{key} of {name} must be a float32/bfloat16/float16 tensor")
        if not _laid_out_like(m, weight):
            raise ValueError(
                f"{key} of {name} must have the shape, strides and device of the weight "
                f"({tuple(weight.shape)}, {weight.stride()}, {weight.device}); got "
                f"({tuple(m.shape)}, {m.stride()}, {m.device})"
            )
    step = update.step
    if not isinstance(step, torch.Tensor) or step.dtype != torch.float32:
        raise TypeError(f"step of {name} must be a float32 tensor")
    if step.dim() != 0 or step.device != weight.device:
        raise ValueError(f"step of {name} must be a 0-dim tensor on {weight.device}, got {step.device}")
    if update.grad_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"grad_dtype of {name} must be float32, bfloat16 or float16, got {update.grad_dtype}")
    n = update.grad_norm_sq
    if n is not None and (
        not isinstance(n, torch.Tensor)
        or n.dtype != torch.float32
        or n.dim() != 0
        or n.device != weight.device
    ):
        raise ValueError(f"grad_norm_sq of {name} must be a 0-dim float32 tensor on {weight.device}")
    c = update.skipped
    if c is not None and (
        not isinstance(c, torch.Tensor) or c.dtype != torch.int64 or c.dim() != 0 or c.device != weight.device
    ):
        raise ValueError(f"skipped of {name} must be a 0-dim int64 tensor on {weight.device}")
    g = update.grad_in
    if g is not None and not (_laid_out_like(g, weight) and g.dtype == update.grad_dtype):
        raise ValueError(
            f"grad_in of {name} must be a {update.grad_dtype} tensor with the shape, strides and device of the "
            f"weight ({tuple(weight.shape)}, {weight.stride()}, {weight.device})"
        )
    for key in ("lr", "beta1", "beta2", "eps", "weight_decay"):
        value = getattr(update, key)
        if not isinstance(value, float) or not math.isfinite(value) or value < 0.0:
            raise ValueError(f"{key} of {name} must be a finite float >= 0, got {value!r}")
    for key in ("beta1", "beta2"):
        if getattr(update, key) >= 1.0:
            raise ValueError(f"{key} of {name} must be in [0, 1), got {getattr(update, key)!r}")


def _like(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An unfilled tensor with the shape of ``weight`` and, when it is dense, its strides."""
    if not is_dense(weight):
        return _empty(weight.shape, dtype, weight.device)
    return _empty((weight.numel(),), dtype, weight.device).as_strided(weight.shape, weight.stride())


def moe_mlp_bwd(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    hpre: torch.Tensor,
    meta: RoutingMetadata,
    activation: str,
    needs_input_grad: tuple[bool, bool, bool, bool],
    gate_up_proj_update: AdamWUpdate | None = None,
    down_proj_update: AdamWUpdate | None = None,
    gate_up_proj_accumulator: GradAccumulator | None = None,
    down_proj_accumulator: GradAccumulator | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Triton backward of the gated expert MLP, with the optional AdamW update of the expert weights.

    Launch order (DESIGN.md): dHpre and the routing-weight partial sums (reads W2), dW2 (updates W2
    when ``down_proj_update`` is given), routing-weight reduction, dX rows and their sum over top_k
    (reads W1), dW1 (updates W1 when ``gate_up_proj_update`` is given). Each wgrad launch covers every
    expert. No host sync; no atomics.

    Args:
        grad_out: [T, H] dtype of hidden_states; any strides, 0 included.
        hidden_states, top_k_weights, gate_up_proj, down_proj: the forward's inputs.
        hpre, meta: saved by :func:`moe_mlp_fwd`.
        needs_input_grad: (hidden_states, top_k_weights, gate_up_proj, down_proj).
        gate_up_proj_update, down_proj_update: apply AdamW to that weight in place instead of
            returning its gradient (validated before any launch; ``step`` advances unless the update is
            skipped for a non-finite or too large gradient, see :class:`AdamWUpdate`).
        gate_up_proj_accumulator, down_proj_accumulator: add that weight's gradient to a buffer instead
            of returning it.
    Returns:
        (grad hidden_states, grad top_k_weights, grad gate_up_proj, grad down_proj); None where not
        needed, where the weight was updated in place, or where its gradient went to an accumulator.
    Raises:
        TypeError, ValueError: see :func:`check_adamw_update`; an accumulator whose buffer does not have
            the weight's shape, strides and device or a supported dtype, or a weight with both an
            update and an accumulator.
    """
    for name, weight, update, accumulator in (
        ("gate_up_proj", gate_up_proj, gate_up_proj_update, gate_up_proj_accumulator),
        ("down_proj", down_proj, down_proj_update, down_proj_accumulator),
    ):
        if update is not None:
            check_adamw_update(name, weight, update)
        if accumulator is not None:
            if update is not None:
                raise ValueError(f"{name}: an update and an accumulator are exclusive")
            b = accumulator.buffer
            if not (_laid_out_like(b, weight) and b.dtype in SUPPORTED_DTYPES):
                raise ValueError(
                    f"the accumulator buffer of {name} must be a float32/bfloat16/float16 tensor with the "
                    f"shape, strides and device of the weight ({tuple(weight.shape)}, {weight.stride()}, "
                    f"{weight.device})"
                )
    with _on_device(hidden_states.device):
        return _moe_mlp_bwd(
            grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation,
            needs_input_grad, gate_up_proj_update, down_proj_update, gate_up_proj_accumulator,
            down_proj_accumulator,
        )  # fmt: skip


def _moe_mlp_bwd(
    grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation,
    needs_input_grad, gate_up_proj_update, down_proj_update, gate_up_proj_accumulator=None,
    down_proj_accumulator=None,
):  # fmt: skip
    need_x, need_w, need_w1, need_w2 = needs_input_grad
    T, H = hidden_states.shape
    top_k = top_k_weights.shape[1]
    E, two_I, _ = gate_up_proj.shape
    I = two_I // 2
    S = T * top_k
    dtype = hidden_states.dtype
    device = hidden_states.device
    interpret = triton_interpreting()
    precision = _input_precision(dtype)
    # Buffers have S rows (the kept rows are fewer; the tail is never written nor read); at least one
    # row so that no kernel gets a null pointer.
    num_rows = max(S, 1)

    cfg = DHPRE_CONFIG
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    num_pid_n = triton.cdiv(I, block_n)
    need_grad_hpre = need_x or need_w1
    grad_hpre = _empty((num_rows, two_I), dtype, device) if need_grad_hpre else None
    a = _empty((num_rows, I), dtype, device) if need_w2 else None
    dw_partial = _empty((num_pid_n, num_rows), torch.float32, device) if need_w else None
    # An update needs the largest |A| and |dHpre| to bound its gradient (_overflow_possible).
    has_update = gate_up_proj_update is not None or down_proj_update is not None
    absmax = None
    if S > 0 and (need_grad_hpre or need_w or need_w2):
        max_row_tiles = _max_row_tiles(S, E, block_m)
        absmax = _empty((max_row_tiles * num_pid_n, 2), torch.float32, device) if has_update else None
        any_buffer = next(t for t in (grad_hpre, a, dw_partial) if t is not None)
        grad_hpre_arg = grad_hpre if grad_hpre is not None else any_buffer
        a_arg = a if a is not None else any_buffer
        dw_partial_arg = dw_partial if dw_partial is not None else any_buffer
        _expert_mlp_bwd_dhpre_kernel[(max_row_tiles * num_pid_n,)](
            grad_out, down_proj, hpre, top_k_weights, meta.token_of_row, meta.slot_of_row,
            meta.expert_offsets, meta.tile_offsets, grad_hpre_arg, a_arg, dw_partial_arg,
            any_buffer if absmax is None else absmax,
            E, H, I, top_k,
            grad_out.stride(0), grad_out.stride(1),
            down_proj.stride(0), down_proj.stride(1), down_proj.stride(2),
            hpre.stride(0), hpre.stride(1), top_k_weights.stride(0), top_k_weights.stride(1),
            grad_hpre_arg.stride(0), grad_hpre_arg.stride(1), a_arg.stride(0), a_arg.stride(1),
            dw_partial_arg.stride(0),
            ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg["BLOCK_K"],
            STORE_GRAD_HPRE=need_grad_hpre, STORE_A=need_w2, COMPUTE_DW=need_w, HAS_ABSMAX=absmax is not None,
            INPUT_PRECISION=precision, INTERPRET=interpret,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip

    # The magnitudes that bound each updated weight's gradient: (largest |P|, largest |Q|, most rows).
    bounds = {}
    if has_update:
        largest = absmax.amax(0) if absmax is not None else torch.zeros(2, dtype=torch.float32, device=device)
        most_rows = (meta.expert_offsets[1:] - meta.expert_offsets[:-1]).amax().float()
        if down_proj_update is not None:
            # P = w * dO[token] (rounded), Q = A.
            p_max = _inf_norm(top_k_weights) * _inf_norm(grad_out)
            bounds["down_proj"] = (p_max, largest[0], most_rows)
        if gate_up_proj_update is not None:
            # P = dHpre, Q = X[token].
            bounds["gate_up_proj"] = (largest[1], _inf_norm(hidden_states), most_rows)
    del absmax

    grad_w2 = None
    if need_w2:
        # dW2[e] = sum_r (w_r dO[token_r])^T A_r: M -> H, N -> I.
        grad_w2 = _wgrad(
            grad_out, True, a, False, top_k_weights, meta, down_proj, down_proj_update, H, I, top_k,
            dtype, interpret, bounds.get("down_proj"), down_proj_accumulator,
        )  # fmt: skip
    del a

    grad_w = None
    if need_w:
        grad_w = _empty((T, top_k), top_k_weights.dtype, device)
        if S > 0:
            dc = DWEIGHTS_CONFIG
            _expert_mlp_bwd_dweights_kernel[(triton.cdiv(S, dc["BLOCK"]),)](
                dw_partial, meta.row_of_slot, grad_w,
                S, num_pid_n, dw_partial.stride(0),
                BLOCK=dc["BLOCK"], INTERPRET=interpret, num_warps=dc["num_warps"],
            )  # fmt: skip
    del dw_partial

    grad_x = None
    if need_x:
        grad_x = _empty((T, H), dtype, device)
        if S == 0:
            grad_x.zero_()
        else:
            grad_x = _dx(grad_hpre, gate_up_proj, meta, grad_x, top_k, dtype, interpret)

    grad_w1 = None
    if need_w1:
        # dW1[e] = sum_r dHpre_r^T X[token_r]: M -> 2I, N -> H.
        grad_w1 = _wgrad(
            grad_hpre, False, hidden_states, True, top_k_weights, meta, gate_up_proj, gate_up_proj_update,
            two_I, H, top_k, dtype, interpret, bounds.get("gate_up_proj"), gate_up_proj_accumulator,
        )  # fmt: skip
    return grad_x, grad_w, grad_w1, grad_w2


def _dx(grad_hpre, gate_up_proj, meta, grad_x, top_k, dtype, interpret):
    """dX[t] = sum_j dHpre[row(t, j)] @ W1[e]: the forward's grouped GEMM (W1 read as [E, H, 2I]), then
    its combine without weights."""
    T, H = grad_x.shape
    S = T * top_k
    E, two_I, _ = gate_up_proj.shape
    cfg = FWD_GEMM_CONFIG
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    max_row_tiles = _max_row_tiles(S, E, block_m)
    dx_rows = _empty((S, H), dtype, grad_x.device)
    _expert_mlp_grouped_mm_kernel[(max_row_tiles * triton.cdiv(H, block_n),)](
        grad_hpre, gate_up_proj, meta.expert_offsets, meta.tile_offsets, dx_rows,
        E, H, two_I,
        grad_hpre.stride(0), grad_hpre.stride(1),
        gate_up_proj.stride(0), gate_up_proj.stride(2), gate_up_proj.stride(1),
        dx_rows.stride(0), dx_rows.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg["BLOCK_K"],
        INPUT_PRECISION=_input_precision(dtype), INTERPRET=interpret,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    cc = COMBINE_CONFIG
    _expert_mlp_combine_kernel[(triton.cdiv(T, cc["BLOCK_M"]), triton.cdiv(H, cc["BLOCK_N"]))](
        dx_rows, meta.row_of_slot, dx_rows, grad_x,
        T, H, top_k,
        dx_rows.stride(0), dx_rows.stride(1), 0, 0, grad_x.stride(0), grad_x.stride(1),
        BLOCK_M=cc["BLOCK_M"], BLOCK_N=cc["BLOCK_N"], HAS_WEIGHTS=False, INTERPRET=interpret,
        num_warps=cc["num_warps"],
    )  # fmt: skip
    return grad_x


def _inf_norm(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim float32 tensor (NaN when x holds a NaN; 0 for an empty x)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x, float("inf")).float()


def _overflow_possible(
    bound: tuple, grad_in: torch.Tensor | None, limit: float, operand_limit: float
) -> torch.Tensor:
    """0.0 (a 0-dim fp32 device tensor) when no entry of the wgrad, rounded, can exceed ``limit`` in
    magnitude and no GEMM operand can overflow ``operand_limit`` when rounded to the GEMM dtype, else
    1.0: the cheap test that spares the exact check pass in :func:`_wgrad`.

    An entry of sum_r P[r]^T Q[r] over at most n rows with |P| <= p, |Q| <= q is at most n * p * q in
    magnitude; the fp32 accumulation adds at most a factor 1 + n * 2**-23 (2 n unit roundoffs), the
    roundings to the GEMM and gradient dtypes (and of the sum with grad_in) under 1.03 together. A NaN
    or inf anywhere makes the bound NaN or inf, so the check pass runs.
    """
    p_max, q_max, most_rows = bound
    total = most_rows * p_max * q_max * (1.0 + most_rows * 2.0**-23)
    if grad_in is not None:
        total = total + _inf_norm(grad_in)
    safe = (total * 1.03 <= limit) & (p_max * 1.01 <= operand_limit)
    return (~safe).float()


def _wgrad(
    p, p_from_tokens, q, q_from_tokens, top_k_weights, meta, weight, update, M, N, top_k, dtype, interpret,
    bound=None, accumulator=None,
):  # fmt: skip
    """One launch for the wgrad of all experts of ``weight`` [E, M, N]; returns dW, or None when
    ``update`` was applied (fused in the epilogue, or the split path) and reported through on_done, or
    when the gradient was added to ``accumulator``.

    With an update the decision to skip it (non-finite or too large gradient, see
    :class:`AdamWUpdate`) is made on the device before the update's launch: on the split path from the
    gradient it wrote; on the fused path by a check pass of the same kernel (EPILOGUE "check": it
    recomputes each tile's gradient and flags the tiles with an entry beyond :func:`grad_limit`), which
    returns at once unless ``bound`` (largest |P|, largest |Q|, most rows of an expert) says the
    gradient may exceed the limit. No host sync.
    """
    E = weight.shape[0]
    cfg = WGRAD_CONFIG
    grid = (E * triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)

    def launch(epilogue, grad, grad_in, flag, partial, target, exp_avg, exp_avg_sq, step, hyper, limit,
               grad_dtype, arithmetic, has_norm, **options):  # fmt: skip
        _expert_mlp_bwd_dw_kernel[grid](
            p, q, top_k_weights, meta.slot_of_row, meta.expert_offsets,
            grad, grad if grad_in is None else grad_in, target, exp_avg, exp_avg_sq, step, flag, partial,
            E, M, N, top_k,
            p.stride(0), p.stride(1), q.stride(0), q.stride(1),
            top_k_weights.stride(0), top_k_weights.stride(1),
            grad.stride(0), grad.stride(1), grad.stride(2),
            *hyper, limit,
            P_FROM_TOKENS=p_from_tokens, Q_FROM_TOKENS=q_from_tokens,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
            EPILOGUE_SPLIT=cfg["EPILOGUE_SPLIT"], EPILOGUE=epilogue, HAS_GRAD_IN=grad_in is not None,
            HAS_NORM=has_norm, ARITHMETIC=arithmetic,
            GRAD_DTYPE=TL_DTYPES[grad_dtype],
            DOT_DTYPE=TL_DTYPES[dtype], INPUT_PRECISION=_input_precision(dtype), INTERPRET=interpret,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **options,
        )  # fmt: skip

    if update is None:
        offsets = meta.expert_offsets
        if accumulator is None:
            grad, grad_in = _like(weight, weight.dtype), None
        else:
            grad = accumulator.buffer
            grad_in = grad if accumulator.add else None
        launch(
            "store", grad, grad_in, offsets, offsets, grad, grad, grad, offsets, (0.0,) * 5, 0.0, grad.dtype,
            "fp64", False,
        )  # fmt: skip
        if accumulator is None:
            return grad
        if accumulator.on_done is not None:
            accumulator.on_done()
        return None

    hyper = (update.lr, update.beta1, update.beta2, update.eps, update.weight_decay)
    limit = grad_limit(update.exp_avg_sq.dtype)
    arithmetic = adamw_arithmetic(weight.device)
    state = (weight, update.exp_avg, update.exp_avg_sq, update.step)
    # The AdamW launches compile without automatic fma contraction, so the arithmetic is the one written
    # in kernels/adamw.py (explicit fmas only); the wgrad kernel's other epilogues keep it.
    no_fusion = {"enable_fp_fusion": False}
    # One fp32 per program: the check pass's flags, then the update's sums of squares (telemetry).
    partial = _empty(grid, torch.float32, weight.device)
    if update.fused:
        if bound is None:
            raise ValueError("a fused update needs the bound of its gradient")
        # A gradient entry beyond the limit, or beyond what the gradient dtype holds (it would round to inf).
        entry_limit = min(limit, torch.finfo(update.grad_dtype).max)
        maybe = _overflow_possible(bound, update.grad_in, entry_limit, torch.finfo(dtype).max)
        launch(
            "check", weight, update.grad_in, maybe, partial, *state, hyper, limit, update.grad_dtype,
            arithmetic, False,
        )  # fmt: skip
        skip = partial.amax()
        grad = None
    else:
        grad = _like(weight, update.grad_dtype)
        launch(
            "store", grad, update.grad_in, update.step, partial, *state, hyper, limit, update.grad_dtype,
            arithmetic, update.grad_norm_sq is not None,
        )  # fmt: skip
        skip = (~(_inf_norm(grad) <= limit)).float()
    # torch's AdamW increments the step before it computes the bias corrections; a skipped update
    # leaves it (as torch's fused AdamW does with found_inf).
    advance = 1.0 - skip
    update.step.add_(advance)
    applied = False
    try:
        if update.fused:
            launch(
                "adamw", weight, update.grad_in, skip, partial, *state, hyper, limit, update.grad_dtype,
                arithmetic, update.grad_norm_sq is not None, **no_fusion,
            )  # fmt: skip
        else:
            ac = ADAMW_CONFIG
            _adamw_kernel[(triton.cdiv(weight.numel(), ac["BLOCK"]),)](
                weight, grad, update.exp_avg, update.exp_avg_sq, update.step, skip,
                weight.numel(), *hyper,
                BLOCK=ac["BLOCK"], ARITHMETIC=arithmetic, INTERPRET=interpret, num_warps=ac["num_warps"],
                **no_fusion,
            )  # fmt: skip
        applied = True
    finally:
        if not applied:
            # A launch that was refused (compile error, bad argument) applied nothing: take the step back.
            update.step.sub_(advance)
    if update.grad_norm_sq is not None:
        update.grad_norm_sq.copy_(torch.where(skip != 0.0, float("inf"), partial.sum()))
    if update.skipped is not None:
        update.skipped.add_(skip.long())
    if update.on_done is not None:
        update.on_done()
    return None
