"""Triton launchers of one expert tensor's gradient, the backward's per-tensor job: the wgrad over all
experts in one launch, and what happens to the gradient (returned; the AdamW update in the epilogue or its
split path, after a check pass that decides on the device whether to skip it; or added to a micro-batch
buffer). :class:`AdamWUpdate` and :class:`GradAccumulator` say which. No host sync.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from sonar_kernels.ops.bias import ones_rows
from sonar_kernels.ops.common import like, on_device, triton_interpreting
from sonar_kernels.ops.triton_backend import configs
from sonar_kernels.ops.triton_backend.update_bound import overflow_flag
from sonar_kernels.ops.triton_backend.wgrad_launch import WgradLaunch, weight_of_row
from sonar_kernels.ops.triton_backend.wgrad_update import apply_update
from sonar_kernels.ops.validation import check_buffer, check_update
from sonar_kernels.specs import down_view, gate_up_bias_view, gate_up_view
from sonar_kernels.update_state import StateKind, kind_of


class AdamWUpdate(NamedTuple):
    """The AdamW update of one expert weight tensor, applied by its wgrad launch (docs/design.md).

    Attributes:
        exp_avg, exp_avg_sq: the moments: the weight's shape and strides, float32/bfloat16/float16.
        step: [] float32 on the weight's device, the step count; advanced by 1 - skip (0 or 1, decided on
            the device) just before the update's launch.
        hyper: [5] float64 on the weight's device: lr, beta1, beta2, eps, weight_decay, as in
            torch.optim.AdamW (decoupled decay); read by the kernels. [7] with expert clipping
            (docs/design.md, "Expert clipping"): then spike_threshold (inf: no spike rule) and grad_scale
            (1: no scaling), applied to the gradient before the AdamW math (kernels/adamw.py, clip_tile).
        grad_dtype: the fp32 wgrad accumulator is rounded to this dtype before the AdamW math.
        fused: True: AdamW in the wgrad epilogue, no gradient tensor (the least memory). False: the split
            path, the same wgrad kernel writing the gradient of a chunk of experts into a scratch buffer
            (at most 1/8 of the tensor's gradient or 64 MiB, whichever is larger:
            ``ops.triton_backend.wgrad_update.split_chunk``), then the standalone AdamW kernel, chunk after chunk (the same
            bits at the same tiles). None: the faster of the two, timed per layer shape, dtype, state
            kind and clipping on CUDA (``ops/triton_backend/configs.py``; the fused path elsewhere).
        grad_in: the gradient of earlier micro-batches (gradient accumulation), in ``grad_dtype`` with
            the weight's strides; the update uses round(grad_in + round(wgrad)), as autograd would sum
            them in ``.grad``. None: this backward's gradient alone.
        grad_norm_sq: a 0-dim float32 tensor on the weight's device that receives the squared L2 norm of
            the gradient the update used (per-program partial sums, added in a fixed order; no atomics),
            or inf when the update was skipped.
        skipped: a 0-dim int64 tensor on the weight's device, incremented when the update is skipped.
        exp_avg_scales, exp_avg_sq_scales: the block scales of 8-bit moments (:attr:`moments_8bit`), or
            None: ``exp_avg`` and ``exp_avg_sq`` hold the moments themselves.
        remainder: None, or the int16 remainder (the bf16 weight's shape and strides) that completes the
            weight to its fp32 master (docs/design.md, "bf16 master weights"): the update merges the master,
            applies AdamW to it with fp32 moments and stores it split again.
        seed: None, or the 0-dim int64 seed of the bf16 weight's stochastic rounding (the same): the update
            applies AdamW to the weight read as fp32, with fp32 moments, and stores its stochastic rounding.
        clipped: None, or a 0-dim int64 tensor on the weight's device that receives the number of gradient
            entries the spike rule replaced in this update (0 when it was skipped or ``hyper`` has no
            clipping entries).

    Non-finite gradients: the update of the whole tensor is skipped (W, exp_avg, exp_avg_sq and step
    unchanged) when any entry of the gradient it would use, rounded to ``grad_dtype`` and summed with
    ``grad_in``, is NaN, infinite, or larger in magnitude than :func:`grad_limit` of exp_avg_sq's dtype
    (so that g * g, and exp_avg_sq, stay finite). The decision is made on the device before the update's
    launch, with no host sync (``ops/triton_backend/wgrad_update.py``).
    """

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    hyper: torch.Tensor
    grad_dtype: torch.dtype
    fused: bool | None = None
    grad_in: torch.Tensor | None = None
    grad_norm_sq: torch.Tensor | None = None
    skipped: torch.Tensor | None = None
    exp_avg_scales: torch.Tensor | None = None
    exp_avg_sq_scales: torch.Tensor | None = None
    remainder: torch.Tensor | None = None
    seed: torch.Tensor | None = None
    clipped: torch.Tensor | None = None

    @property
    def clipping(self) -> bool:
        """Whether ``hyper`` carries the expert-clipping entries ([7]): the update clips its gradient."""
        return self.hyper.numel() == 7

    @property
    def kind(self) -> StateKind:
        """What the update keeps (``update_state.StateKind``): exact or 8-bit moments (``exp_avg`` int8 and
        ``exp_avg_sq`` uint8 codes with the weight's shape and strides, ``exp_avg_scales`` and
        ``exp_avg_sq_scales`` fp32 of :func:`sonar_kernels.rules.moments_8bit.scales_shape`, contiguous;
        docs/design.md, "8-bit moments"), and a remainder, a stochastic rounding's seed or neither."""
        return kind_of(self)

    @property
    def moments_8bit(self) -> bool:
        """Whether the moments are 8-bit (:attr:`kind`)."""
        return self.kind.moments == "8bit"


class GradAccumulator(NamedTuple):
    """A gradient-accumulation buffer the wgrad launch adds this backward's gradient of a weight to
    (micro-batches before the last one, when the buffer's dtype is not the weight's, e.g. float32 for
    bfloat16 weights; ``.grad`` must have the weight's dtype).

    Attributes:
        buffer: the weight's shape and strides, float32/bfloat16/float16; receives
            round(buffer + round(wgrad)) when ``add``, round(wgrad) otherwise, round() to its dtype.
        add: whether the buffer holds earlier micro-batches' gradient.
    """

    buffer: torch.Tensor
    add: bool


def check_wgrad(
    name: str,
    weight,
    update: AdamWUpdate | None,
    accumulator: GradAccumulator | None,
    layout: str = "concatenated",
) -> None:
    """Raise TypeError or ValueError (before any launch) when ``update`` or ``accumulator`` cannot apply to
    the expert tensor ``weight`` of ``layout`` (see :func:`moe_mlp_bwd`)."""
    if weight is None:
        if update is not None or accumulator is not None:
            raise ValueError(f"{name}: an update or an accumulator without the tensor")
        return
    if update is not None:
        check_update(name, weight, update)
        kind = update.kind
        if kind.moments == "8bit" and name.endswith("_bias"):
            raise ValueError(f"{name}: 8-bit moments are for the weight matrices; a bias keeps exact moments")
        if kind.master != "none":
            _check_master(name, weight, update)
        if kind.moments == "8bit" and _kernel_view(name, layout)(weight).stride(-1) != 1:
            raise ValueError(
                f"{name}: 8-bit moments need the weight contiguous along the wgrad's columns, which the "
                f'{layout!r} layout does not give (docs/design.md, "8-bit moments")'
            )
    if accumulator is not None:
        if update is not None:
            raise ValueError(f"{name}: an update and an accumulator are exclusive")
        check_buffer(name, weight, accumulator.buffer)


def _check_master(name: str, weight, update: AdamWUpdate) -> None:
    """A remainder's or a stochastic rounding's update: a bf16 weight, an int16 remainder of the weight's
    shape and strides or a 0-dim int64 seed, not both (with any moments: fp32, bf16 or 8-bit)."""
    remainder, seed = update.remainder, update.seed
    for extra in (remainder, seed):
        if extra is not None and extra.device != weight.device:
            raise ValueError(
                f"{name}: the remainder or seed is on {extra.device}, the weight on {weight.device}"
            )
    if weight.dtype != torch.bfloat16:
        raise TypeError(
            f"{name}: a remainder or a stochastic rounding is for a bf16 weight, got {weight.dtype}"
        )
    if seed is not None and (remainder is not None or seed.dtype != torch.int64 or seed.dim() != 0):
        raise ValueError(f"{name}: a stochastic rounding's seed is a 0-dim int64 tensor, without a remainder")
    if remainder is not None and (
        remainder.dtype != torch.int16
        or remainder.shape != weight.shape
        or remainder.stride() != weight.stride()
    ):
        raise ValueError(
            f"{name}: the remainder must be int16 with the weight's shape {tuple(weight.shape)} and strides "
            f"{weight.stride()}, got {remainder.dtype} {tuple(remainder.shape)} {remainder.stride()}"
        )


def expert_wgrad(
    name, weight, p, q, top_k_weights, meta, layout="concatenated", largest=None, update=None, accumulator=None,
    *, checked=False,
):  # fmt: skip
    """The wgrad of the expert tensor ``name`` (``weight``, one of :data:`sonar_kernels.specs.EXPERT_TENSORS`)
    over all experts in one launch: returns its gradient (the weight's shape and dtype), or None when
    ``update`` was applied in the epilogue (or its split path), or when the gradient went to
    ``accumulator`` (see :func:`_wgrad`).

    ``p``, ``q``: the GEMM operands :func:`moe_mlp_bwd_core` gave: ``p`` dO [T, H] (the down projection
    and its bias; rows gathered by token, scaled by the routing weight) or dHpre [S, 2I] (the gate/up
    projection and its bias; a separate layout's gate or up half [S, I]); ``q`` A [S, I] (the down
    projection), X [T, H] (the gate/up projection; rows gathered by token) or None (a bias: a column of
    ones). ``largest``: the core's magnitudes (``ops/triton_backend/update_bound.py``), needed by an update (its check pass's
    bound). ``checked``: the caller ran :func:`check_wgrad` already."""
    if not checked:
        check_wgrad(name, weight, update, accumulator, layout)
    down = name in ("down_proj", "down_proj_bias")
    view = _kernel_view(name, layout)
    shape = view(weight).shape
    M, N = math.prod(shape[1:-1]), shape[-1]
    dtype = p.dtype
    with on_device(weight.device):
        if q is None:  # a bias: the wgrad kernel with a column of ones for X (db1) or A (db2), N = 1
            q = ones_rows(top_k_weights.numel(), dtype, weight.device)
        bound = None
        if update is not None:

            def bound(grad_in, entry_limit, operand_limit):
                """The update's 0-dim flag, computed when it needs it: 1.0 when the gradient (with
                ``grad_in``) may exceed the limits (``ops/triton_backend/update_bound.py``), from the layer's magnitudes."""
                return overflow_flag(largest, name, grad_in, entry_limit, operand_limit)

        return _wgrad(
            p, down, q, name in ("gate_up_proj", "up_proj"), top_k_weights, meta, weight, update, M, N,
            top_k_weights.shape[1], dtype, triton_interpreting(), bound, accumulator, name=name, view=view,
        )  # fmt: skip


def _kernel_view(name: str, layout: str):
    """The function that shows a tensor of the expert tensor ``name``'s shape and strides as the wgrad
    kernel indexes it: [E, M, N], or W1's [E, 2, M / 2, N] halves."""
    if name == "down_proj":
        return functools.partial(down_view, layout=layout)
    if name == "down_proj_bias":
        return lambda t: t.unsqueeze(-1)
    if name == "gate_up_proj_bias":
        return lambda t: gate_up_bias_view(t, layout).unsqueeze(-1)
    return functools.partial(gate_up_view, layout=layout)


def _wgrad(
    p, p_from_tokens, q, q_from_tokens, top_k_weights, meta, weight, update, M, N, top_k, dtype, interpret,
    bound=None, accumulator=None, name="weight", view=None,
):  # fmt: skip
    """One launch for the wgrad of all experts of ``weight``; returns dW (the weight's shape and, when it
    is dense, strides), or None when ``update`` was applied (fused in the epilogue, or the split path:
    ``ops/triton_backend/wgrad_update.py``), or when the gradient was added to ``accumulator``.

    ``view`` maps a tensor of the weight's shape and strides (the weight, its moments, gradients and
    buffers) to what the kernel indexes: [E, M, N], or W1's [E, 2, M / 2, N] halves
    (:func:`sonar_kernels.specs.gate_up_view`). Everything else here holds the weight's own shape.
    """
    # dW2's P rows are scaled by their routing weight: one fp32 per row, contiguous (else not read).
    rows_weight = weight_of_row(top_k_weights, meta) if p_from_tokens else meta.expert_offsets
    launch = WgradLaunch(
        p, p_from_tokens, q, q_from_tokens, rows_weight, meta, M, N, dtype, view or (lambda t: t), interpret
    )
    # The tuning key: the layer shape, dtypes and operands, never the token count (ops/triton_backend/configs.py).
    grad_dtype = update.grad_dtype if update is not None else weight.dtype
    key = (weight.shape[0], M, N, name, str(weight.dtype), str(grad_dtype), p_from_tokens, q_from_tokens)
    if update is not None:
        apply_update(launch, weight, update, bound, key)
        return None
    offsets = meta.expert_offsets
    if accumulator is None:
        grad, grad_in = like(weight, weight.dtype), None
    else:
        grad = accumulator.buffer
        grad_in = grad if accumulator.add else None

    def store(cfg, out):
        launch(
            "store", cfg, offsets, out, grad_in, offsets, offsets, out, out, out, offsets, offsets, 0.0, out.dtype,
            "fp64", False,
        )  # fmt: skip

    def trial(cfg):
        # The store as it ships, into a scratch gradient (an accumulator's buffer is only read).
        store(cfg, like(weight, grad.dtype))

    # The prefetched epilogue changes the fused update only: the store's candidates are the others.
    plain = tuple(c for c in configs.candidates("wgrad", dtype, weight.device) if not c.EPILOGUE_PREFETCH)
    store(configs.choose("wgrad", key, dtype, weight.device, trial, plain), grad)
    return grad if accumulator is None else None
