"""Argument checks of the launchers and the public entry points: every bad input is refused with a
ValueError or TypeError naming the argument, before any kernel runs."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from sonar_kernels.ops.common import is_dense, laid_out_like, triton_interpreting
from sonar_kernels.specs import (
    BACKENDS,
    INDEX_DTYPES,
    LAYOUTS,
    MAX_EXPERTS,
    SUPPORTED_DTYPES,
    is_gated,
    is_real_number,
    is_separate,
    layout_name,
    parse_activation,
)
from sonar_kernels.update_state import UpdateState, kind_of


def check_layout(transposed, interleaved, gated=True, separate=False) -> str:
    """The name in :data:`sonar_kernels.specs.LAYOUTS` of the flags ``transposed``, ``interleaved`` and
    ``gated``, and ``separate`` (an ``up_proj`` tensor was given).

    Raises:
        TypeError: a flag that is not a bool.
        ValueError: ``interleaved`` without a gate (there is nothing to interleave); an ``up_proj`` with
            ``interleaved`` or without a gate.
    """
    for name, flag in (("transposed", transposed), ("interleaved", interleaved), ("gated", gated)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if interleaved and not gated:
        raise ValueError(
            "interleaved=True needs gated=True: without a gate there are no gate rows to interleave"
        )
    if separate and (interleaved or not gated):
        flag = "interleaved=True" if interleaved else "gated=False"
        raise ValueError(
            f"up_proj (a separate up projection) cannot be combined with {flag}: with up_proj, gate_up_proj is "
            "the gate projection alone"
        )
    return layout_name(transposed, interleaved, gated, separate)


def check_moe_mlp_args(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, backend,
    layout="concatenated", up_proj=None,
) -> str:  # fmt: skip
    """Validate the arguments of :func:`sonar_kernels.moe_mlp` (the weights in ``layout``, one of
    :data:`sonar_kernels.specs.LAYOUTS`; ``up_proj`` the up tensor of a separate layout) and resolve
    ``backend``.

    Returns:
        "triton" or "torch".
    Raises:
        TypeError: an argument is not a tensor, or has a dtype outside what is supported.
        ValueError: shapes disagree, tensors are on different devices, unknown activation or backend,
            an up_proj whose dtype, shape or strides are not gate_up_proj's, or backend "triton" for
            CPU tensors without the Triton interpreter.
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
    parse_activation(activation)  # ValueError naming what is expected
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")

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
    transposed = layout.endswith("_transposed")
    w1_dims, w2_dims = ("[E, H, 2I]", "[E, I, H]") if transposed else ("[E, 2I, H]", "[E, H, I]")
    if not is_gated(layout) or is_separate(layout):
        w1_dims = w1_dims.replace("2I", "I")
    if gate_up_proj.dim() != 3:
        raise ValueError(f"gate_up_proj must be {w1_dims}, got shape {tuple(gate_up_proj.shape)}")
    if down_proj.dim() != 3:
        raise ValueError(f"down_proj must be {w2_dims}, got shape {tuple(down_proj.shape)}")
    # The checks below read the weights as the concatenated layout's [E, 2I, H] and [E, H, I]; the
    # messages name the dimensions of the layout given.
    w1_axes, w2_axes = ((2, 1), (2, 1)) if transposed else ((1, 2), (1, 2))
    if transposed:
        gate_up_proj, down_proj = gate_up_proj.transpose(1, 2), down_proj.transpose(1, 2)
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
            f"gate_up_proj.shape[{w1_axes[1]}] must equal the hidden size H = {H} of hidden_states, got {H1}"
        )
    if down_proj.shape[0] != E:
        raise ValueError(
            f"down_proj.shape[0] must equal the number of experts E = {E} of gate_up_proj, got {down_proj.shape[0]}"
        )
    if down_proj.shape[1] != H:
        raise ValueError(
            f"down_proj.shape[{w2_axes[0]}] must equal the hidden size H = {H} of hidden_states, "
            f"got {down_proj.shape[1]}"
        )
    halves = 2 if is_gated(layout) and not is_separate(layout) else 1
    if two_I != halves * down_proj.shape[2] or two_I == 0:
        what = "2 * " if halves == 2 else ""
        raise ValueError(
            f"gate_up_proj.shape[{w1_axes[0]}] must be {what}down_proj.shape[{w2_axes[1]}] = {what}I (I >= 1), "
            f"got {two_I} and I = {down_proj.shape[2]}"
        )
    if not is_gated(layout) and parse_activation(activation)[0] == "clamped_swiglu":
        raise ValueError(
            "activation clamped_swiglu needs a gate (gated=True): it clamps a gate and an up projection"
        )

    if is_separate(layout):
        _check_up_proj(up_proj, tensors["gate_up_proj"])
        tensors["up_proj"] = up_proj
    elif up_proj is not None:
        raise ValueError(
            f"up_proj is given, but the layout {layout!r} holds the up projection in gate_up_proj"
        )

    # devices
    device = hidden_states.device
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(
                f"{name} is on {t.device}, but hidden_states is on {device}: put all tensors on one device"
            )

    if backend == "auto":
        return resolve_backend(backend, device)
    if backend == "triton" and device.type != "cuda" and not (device.type == "cpu" and triton_interpreting()):
        raise ValueError(
            f"backend='triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before "
            f"sonar_kernels is imported; got tensors on {device}. Use backend='torch' or 'auto'."
        )
    return backend


def _check_up_proj(up_proj, gate_proj) -> None:
    """The up tensor of a separate layout: the gate tensor's dtype, shape, strides and device, so that the
    kernels address both from one pointer (``ops.common.gate_up_operand``)."""
    if not isinstance(up_proj, torch.Tensor):
        raise TypeError(f"up_proj must be a torch.Tensor or None, got {type(up_proj).__name__}")
    if up_proj.dtype != gate_proj.dtype:
        raise TypeError(
            f"up_proj must have the dtype of gate_up_proj ({gate_proj.dtype}), got {up_proj.dtype}"
        )
    if up_proj.shape != gate_proj.shape:
        raise ValueError(
            f"up_proj must have the shape of gate_up_proj (the gate projection) {tuple(gate_proj.shape)}, got "
            f"{tuple(up_proj.shape)}"
        )
    if up_proj.stride() != gate_proj.stride():
        raise ValueError(
            f"up_proj must have the strides of gate_up_proj {gate_proj.stride()}, got {up_proj.stride()}: the "
            "kernels read both with one set of strides"
        )
    # Checked again where the kernels take the distance (ops.common.gate_up_operand): tracing has no pointers.
    if (
        not torch.compiler.is_compiling()
        and up_proj.device == gate_proj.device
        and (up_proj.data_ptr() - gate_proj.data_ptr()) % up_proj.element_size()
    ):
        raise ValueError("up_proj and gate_up_proj must start a whole number of elements apart in memory")


def check_biases(gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias, layout="concatenated") -> None:
    """Validate the optional biases of :func:`sonar_kernels.moe_mlp` against weights already checked by
    :func:`check_moe_mlp_args` (in ``layout``).

    Raises:
        TypeError: a bias that is not a tensor or None, or not of its weight's dtype.
        ValueError: a bias not of shape [E, 2I] (gate_up_proj_bias) or [E, H] (down_proj_bias), or on
            another device; gate_up_proj_bias with a separate up projection (not implemented).
    """
    if is_separate(layout) and gate_up_proj_bias is not None:
        raise ValueError(
            "gate_up_proj_bias with a separate up_proj is not supported: pass the gate and up weights as one "
            "gate_up_proj tensor to use a bias on them"
        )
    E = gate_up_proj.shape[0]
    w2 = down_proj.transpose(1, 2) if layout.endswith("_transposed") else down_proj  # [E, H, I]
    H, I = w2.shape[1], w2.shape[2]
    width = 2 * I if is_gated(layout) else I
    for name, bias, weight, shape in (
        ("gate_up_proj_bias", gate_up_proj_bias, gate_up_proj, (E, width)),
        ("down_proj_bias", down_proj_bias, down_proj, (E, H)),
    ):
        if bias is None:
            continue
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"{name} must have the dtype of its weight ({weight.dtype}), got {bias.dtype}")
        if bias.device != weight.device:
            raise ValueError(f"{name} is on {bias.device}, but its weight is on {weight.device}")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that ``backend`` ("auto", "triton" or "torch") selects for tensors on ``device``:
    "auto" is "triton" on CUDA, "torch" otherwise."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def _check_8bit(name: str, weight: torch.Tensor, update) -> None:
    """The 8-bit moments of ``update`` (docs/design.md, "8-bit moments"): int8 and uint8 codes, fp32 block
    scales of their shape, contiguous on the weight's device; a weight contiguous along its last
    dimension, a multiple of the block."""
    from sonar_kernels.rules.moments_8bit import scales_shape

    expected = scales_shape(tuple(weight.shape))  # raises for a last dimension not a multiple of the block
    if weight.stride(-1) != 1:
        raise ValueError(f"{name}: 8-bit moments need the weight contiguous along its last dimension")
    for key, dtype in (("exp_avg", torch.int8), ("exp_avg_sq", torch.uint8)):
        codes = getattr(update, key)
        if not isinstance(codes, torch.Tensor) or codes.dtype != dtype:
            raise TypeError(f"{key} of {name} must be {dtype} codes with 8-bit moments")
        scales = getattr(update, f"{key}_scales")
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
            raise TypeError(f"{key}_scales of {name} must be a float32 tensor")
        if tuple(scales.shape) != expected or not scales.is_contiguous() or scales.device != weight.device:
            raise ValueError(
                f"{key}_scales of {name} must be contiguous with shape {expected} on {weight.device}, got "
                f"{tuple(scales.shape)} on {scales.device}"
            )


def check_update(name: str, weight: torch.Tensor, update) -> None:
    """Validate the in-place AdamW update of ``weight`` (an :class:`sonar_kernels.ops.AdamWUpdate`),
    before any kernel of the backward runs.

    Raises:
        TypeError: a dtype outside float32/bfloat16/float16, a step that is not a float32 tensor, or
            hyperparameters that are not a float64 tensor.
        ValueError: moments whose shape, strides or device differ from the weight's, a weight that is
            not dense, a step, norm or counter that is not 0-dim on the weight's device, hyperparameters
            not of shape [5] on the weight's device or outside torch.optim.AdamW's ranges (checked only
            on the CPU, where reading them costs no sync, and not on fake tensors).
    """
    if weight.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16 to be updated, got {weight.dtype}")
    if not is_dense(weight):
        raise ValueError(f"{name} must be a dense tensor (no gaps or overlaps) to be updated in place")
    eight_bit = kind_of(update).moments == "8bit"
    if eight_bit:
        _check_8bit(name, weight, update)
    for key in ("exp_avg", "exp_avg_sq"):
        m = getattr(update, key)
        if not eight_bit and (not isinstance(m, torch.Tensor) or m.dtype not in SUPPORTED_DTYPES):
            raise TypeError(f"{key} of {name} must be a float32/bfloat16/float16 tensor")
        if not laid_out_like(m, weight):
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
    hyper = update.hyper
    if not isinstance(hyper, torch.Tensor) or hyper.dtype != torch.float64:
        raise TypeError(f"hyper of {name} must be a float64 tensor (lr, beta1, beta2, eps, weight_decay)")
    if hyper.shape not in ((5,), (7,)) or hyper.device != weight.device:
        raise ValueError(
            f"hyper of {name} must have shape [5] (or [7] with expert clipping) on {weight.device}, got "
            f"{tuple(hyper.shape)}"
        )
    if hyper.device.type == "cpu" and not is_fake(hyper):  # a fake tensor (FakeTensorMode) has no values
        lr, beta1, beta2, eps, weight_decay = hyper[:5].tolist()
        check_hyperparameters(lr, (beta1, beta2), eps, weight_decay, where=f" of {name}")
        if hyper.numel() == 7:
            threshold, scale = hyper[5:].tolist()
            if not threshold > 0.0 or not (0.0 <= scale <= 1.0):
                raise ValueError(
                    f"hyper of {name}: spike_threshold must be > 0 (inf: off) and grad_scale in [0, 1], got "
                    f"{threshold!r} and {scale!r}"
                )
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
    c = update.clipped
    if c is not None and (
        not isinstance(c, torch.Tensor) or c.dtype != torch.int64 or c.dim() != 0 or c.device != weight.device
    ):
        raise ValueError(f"clipped of {name} must be a 0-dim int64 tensor on {weight.device}")
    g = update.grad_in
    if g is not None and not (laid_out_like(g, weight) and g.dtype == update.grad_dtype):
        raise ValueError(
            f"grad_in of {name} must be a {update.grad_dtype} tensor with the shape, strides and device of the "
            f"weight ({tuple(weight.shape)}, {weight.stride()}, {weight.device})"
        )


def check_buffer(name: str, weight: torch.Tensor, buffer) -> None:
    """Validate a gradient-accumulation buffer of ``weight``.

    Raises:
        ValueError: a buffer that is not a float32/bfloat16/float16 tensor with the weight's shape,
            strides and device.
    """
    if not (laid_out_like(buffer, weight) and buffer.dtype in SUPPORTED_DTYPES):
        raise ValueError(
            f"the accumulator buffer of {name} must be a float32/bfloat16/float16 tensor with the "
            f"shape, strides and device of the weight ({tuple(weight.shape)}, {weight.stride()}, "
            f"{weight.device})"
        )


def as_float(value, name: str) -> float:
    """A hyperparameter as a Python float: a real number, or the value of a one-element CPU tensor.

    Raises:
        ValueError: a tensor of more or fewer than one element (torch.optim.AdamW raises ValueError for
            it: "Tensor lr must be 1-element"), or one that is not on the CPU (reading it would sync).
        TypeError: anything else that is not a real number.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
        if value.device.type != "cpu":
            raise ValueError(
                f"{name} must be a Python float or a one-element CPU tensor, got one on {value.device}"
            )
        value = value.item()
    if not is_real_number(value):
        raise TypeError(f"{name} must be a real number (a float), got {type(value).__name__}")
    return float(value)


def check_hyperparameters(lr, betas, eps, weight_decay, where: str = "") -> None:
    """torch.optim.AdamW's ranges: lr, eps, weight_decay >= 0 and finite; betas a pair in [0, 1). Each
    value a real number or a one-element CPU tensor (see :func:`as_float`).

    Raises:
        TypeError: a value that is not a number.
        ValueError: a value outside its range, a tensor that does not hold one element or is not on the CPU.
    """
    lr = as_float(lr, "lr")
    if not (0.0 <= lr < float("inf")):
        raise ValueError(f"lr{where} must be a finite float >= 0, got {lr}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas{where} must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        beta = as_float(beta, f"betas[{i}]")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}]{where} must be in [0, 1), got {beta}")
    for key, value in (("eps", eps), ("weight_decay", weight_decay)):
        value = as_float(value, key)
        if not (0.0 <= value < float("inf")):
            raise ValueError(f"{key}{where} must be a finite float >= 0, got {value}")


def check_master_state(name: str, weight: torch.Tensor, state: list) -> None:
    """Raise before anything is written when an update's ``state`` list cannot apply to ``weight``: 8-bit
    moments' scales that are not fp32; with bf16 master weights (a tensor after the moments' fields), a last
    tensor that is neither an int16 remainder of the weight's shape nor a 0-dim int64 seed, on the weight's
    device, or a weight that is not bf16.

    Raises:
        TypeError: the weight's dtype.
        ValueError: the rest.
    """
    decoded = UpdateState.of(state, name)
    if decoded.kind.moments == "8bit" and any(
        t.dtype != torch.float32 for t in (decoded.exp_avg_scales, decoded.exp_avg_sq_scales)
    ):
        raise ValueError(f"{name}: the state's last two tensors must be the 8-bit moments' fp32 scales")
    extra = decoded.remainder if decoded.remainder is not None else decoded.seed
    if extra is None:
        return
    if decoded.remainder is not None and extra.shape != weight.shape:
        raise ValueError(
            f"{name}: the remainder has shape {tuple(extra.shape)}, the weight {tuple(weight.shape)}"
        )
    if extra.device != weight.device:
        raise ValueError(f"{name}: the remainder or seed is on {extra.device}, the weight on {weight.device}")
    if weight.dtype != torch.bfloat16:
        raise TypeError(
            f"{name}: a remainder or a stochastic rounding is for a bf16 weight, got {weight.dtype}"
        )
