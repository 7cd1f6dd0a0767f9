"""Triton launchers of one expert tensor's gradient, the backward's per-tensor job: the wgrad over all
experts in one launch, and what happens to the gradient (returned; the AdamW update in the epilogue or its
split path, after a check pass that decides on the device whether to skip it; or added to a micro-batch
buffer). :class:`AdamWUpdate` and :class:`GradAccumulator` say which. No host sync.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

from sonar_kernels.kernels.adamw import ADAMW_CONFIG, ADAMW_MASTER_CONFIG, adamw_kernel, adamw_scalars_kernel
from sonar_kernels.kernels.expert_wgrad import expert_mlp_bwd_dw_kernel
from sonar_kernels.ops import common, configs, moments_8bit
from sonar_kernels.ops.adamw import adamw_arithmetic, overflow_possible
from sonar_kernels.ops.bias import ones_rows
from sonar_kernels.ops.common import (
    TL_DTYPES,
    inf_norm,
    input_precision,
    like,
    on_device,
    triton_interpreting,
)
from sonar_kernels.ops.validation import check_buffer, check_update
from sonar_kernels.rules.adamw import adamw_scalars, grad_limit
from sonar_kernels.rules.moments_8bit import tables as moments_8bit_tables
from sonar_kernels.specs import down_view, gate_up_bias_view, gate_up_view


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
        fused: True: AdamW in the wgrad epilogue, no gradient tensor. False: the split path, the same
            wgrad kernel writing a temporary gradient, then the standalone AdamW kernel (same bits).
        grad_in: the gradient of earlier micro-batches (gradient accumulation), in ``grad_dtype`` with
            the weight's strides; the update uses round(grad_in + round(wgrad)), as autograd would sum
            them in ``.grad``. None: this backward's gradient alone.
        grad_norm_sq: a 0-dim float32 tensor on the weight's device that receives the squared L2 norm of
            the gradient the update used (per-program partial sums, added in a fixed order; no atomics),
            or inf when the update was skipped.
        skipped: a 0-dim int64 tensor on the weight's device, incremented when the update is skipped.
        on_done: called right after this weight's update is launched, before any later launch of the
            backward (so a failure further on cannot leave an applied update unrecorded).
        defer: when given, the wgrad launch and the update are not run in this backward:
            ``defer(run)`` is called instead, and ``run(grad_in)`` launches them later with that grad_in
            (validated then; the launch's operands are kept alive until then). The autograd layer uses
            it to apply the update once the weight's whole gradient is known (docs/design.md).
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
    launch, with no host sync (see :func:`_wgrad`).
    """

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    hyper: torch.Tensor
    grad_dtype: torch.dtype
    fused: bool = True
    grad_in: torch.Tensor | None = None
    grad_norm_sq: torch.Tensor | None = None
    skipped: torch.Tensor | None = None
    on_done: Callable[[], None] | None = None
    defer: Callable[[Callable[[torch.Tensor | None], None]], None] | None = None
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
    def moments_8bit(self) -> bool:
        """Whether the moments are 8-bit (``exp_avg`` int8 and ``exp_avg_sq`` uint8 codes with the weight's
        shape and strides, ``exp_avg_scales`` and ``exp_avg_sq_scales`` fp32 of
        :func:`sonar_kernels.rules.moments_8bit.scales_shape`, contiguous; docs/design.md, "8-bit moments")."""
        return self.exp_avg_scales is not None


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
        if update.moments_8bit and name.endswith("_bias"):
            raise ValueError(f"{name}: 8-bit moments are for the weight matrices; a bias keeps exact moments")
        if update.remainder is not None or update.seed is not None:
            _check_master(name, weight, update)
        if update.moments_8bit and _kernel_view(name, layout)(weight).stride(-1) != 1:
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
    ``update`` was applied in the epilogue (or its split path), deferred, or when the gradient went to
    ``accumulator`` (see :func:`_wgrad`).

    ``p``, ``q``: the GEMM operands :func:`moe_mlp_bwd_core` gave: ``p`` dO [T, H] (the down projection
    and its bias; rows gathered by token, scaled by the routing weight) or dHpre [S, 2I] (the gate/up
    projection and its bias; a separate layout's gate or up half [S, I]); ``q`` A [S, I] (the down
    projection), X [T, H] (the gate/up projection; rows gathered by token) or None (a bias: a column of
    ones). ``largest``: the core's magnitudes, needed by a fused update. ``checked``: the caller ran
    :func:`check_wgrad` already."""
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
        if update is not None and update.fused:
            # The magnitudes that bound the gradient: (largest |P|, largest |Q|, most rows of an expert).
            one = torch.ones((), dtype=torch.float32, device=weight.device)
            most_rows = (meta.expert_offsets[1:] - meta.expert_offsets[:-1]).amax().float()
            # P = w * dO[token] (rounded) or dHpre; Q = A, X[token] or ones.
            p_max = inf_norm(top_k_weights) * inf_norm(p) if down else largest[1]
            q_max = (
                largest[0]
                if name == "down_proj"
                else inf_norm(q)
                if name in ("gate_up_proj", "up_proj")
                else one
            )
            bound = (p_max, q_max, most_rows)
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
    is dense, strides), or None when
    ``update`` was applied (fused in the epilogue, or the split path) and reported through on_done, when
    it was deferred (``update.defer``), or when the gradient was added to ``accumulator``.

    With an update the decision to skip it (non-finite or too large gradient, see
    :class:`AdamWUpdate`) is made on the device before the update's launch: on the split path from the
    gradient it wrote; on the fused path by a check pass of the same kernel (EPILOGUE "check": it
    recomputes each tile's gradient and flags the tiles with an entry beyond :func:`grad_limit`), which
    returns at once unless ``bound`` (largest |P|, largest |Q|, most rows of an expert) says the
    gradient may exceed the limit. No host sync.

    ``view`` maps a tensor of the weight's shape and strides (the weight, its moments, gradients and
    buffers) to what the kernel indexes: [E, M, N], or W1's [E, 2, M / 2, N] halves
    (:func:`sonar_kernels.specs.gate_up_view`). Everything else here holds the weight's own shape.
    """
    if update is not None and update.defer is not None:
        operands = (p, p_from_tokens, q, q_from_tokens, top_k_weights, meta, weight)

        def run(grad_in: torch.Tensor | None) -> None:
            now = update._replace(grad_in=grad_in, defer=None)
            check_update(name, weight, now)
            with on_device(weight.device):
                _wgrad(*operands, now, M, N, top_k, dtype, interpret, bound, name=name, view=view)

        update.defer(run)
        return None
    E = weight.shape[0]
    view = view or (lambda t: t)

    def grid_of(cfg):
        return (E * triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N),)

    def launch(epilogue, grad, grad_in, flag, partial, target, exp_avg, exp_avg_sq, step, hyper, limit,
               grad_dtype, arithmetic, has_norm, cfg=None, scales=None, remainder=None, rng=None,
               clip_counts=None, **options):  # fmt: skip
        cfg = cfg or chosen
        if remainder is not None or rng is not None:
            # The weight as its int16 bits (merged with the remainder, or rounded stochastically, in the
            # epilogue), on the 8-bit update's 64-row tiles (the exact update's spill with the remainder on
            # sm_80: make kernel-report).
            target, cfg = target.view(torch.int16), configs.WGRAD_8BIT
            remainder = None if remainder is None else view(remainder)
        if scales is None:  # exact moments: the 8-bit arguments are not read
            scale_args, scale_strides = (hyper, hyper, hyper), (0, 0, 0)
        else:  # (exp_avg's scales, exp_avg_sq's scales, tables); its own tiles: slices of one block each
            scale_args = (*scales[:2], scales[2])
            sv = view(scales[0])
            scale_strides = (
                (sv.stride(0), sv.stride(1), sv.stride(2))
                if sv.dim() == 4
                else (sv.stride(0), 0, sv.stride(1))
            )
            cfg = configs.WGRAD_8BIT
        grad, target, exp_avg, exp_avg_sq = view(grad), view(target), view(exp_avg), view(exp_avg_sq)
        grad_in = None if grad_in is None else view(grad_in)
        if grad.dim() == 4:  # W1's halves: row m of the gradient is (half m // I, row m % I)
            strides = (grad.stride(0), grad.stride(1), grad.stride(2), grad.stride(3), grad.shape[2])
        else:
            strides = (grad.stride(0), 0, grad.stride(1), grad.stride(2), M)
        expert_mlp_bwd_dw_kernel[grid_of(cfg)](
            p, q, top_k_weights, meta.slot_of_row, meta.expert_offsets,
            grad, grad if grad_in is None else grad_in, target, exp_avg, exp_avg_sq, step, flag, partial, hyper,
            *scale_args, hyper if remainder is None else remainder, hyper if rng is None else rng,
            hyper if clip_counts is None else clip_counts,
            E, M, N, top_k,
            p.stride(0), p.stride(1), q.stride(0), q.stride(1),
            top_k_weights.stride(0), top_k_weights.stride(1),
            *strides, *scale_strides,
            limit,
            P_FROM_TOKENS=p_from_tokens, Q_FROM_TOKENS=q_from_tokens, **cfg.blocks(),
            EPILOGUE_SPLIT=cfg.EPILOGUE_SPLIT, EPILOGUE=epilogue, HAS_GRAD_IN=grad_in is not None,
            HAS_NORM=has_norm, ARITHMETIC=arithmetic, MOMENTS_8BIT=scales is not None,
            REMAINDER=remainder is not None, STOCHASTIC=rng is not None, CLIP=clip_counts is not None,
            GRAD_DTYPE=TL_DTYPES[grad_dtype],
            DOT_DTYPE=TL_DTYPES[dtype], INPUT_PRECISION=input_precision(dtype), INTERPRET=interpret,
            **cfg.launch(), **options,
        )  # fmt: skip

    # The tile configuration (ops/configs.py): tuned per layer shape on a GPU by the check pass with its flag
    # set, which computes every tile of the gradient and writes one flag per program (no gradient, no
    # update, no weight-sized scratch), so the update itself runs once, with the winner.
    grad_dtype = update.grad_dtype if update is not None else weight.dtype

    def trial(cfg):
        # The check pass's arguments as the update's launch gives them (the same compiled variant); it
        # reads the gradient's operands only.
        flag_on = torch.ones((), dtype=torch.float32, device=weight.device)
        if update is not None:
            moments, hyper_arg = (update.exp_avg, update.exp_avg_sq, update.step), update.hyper
        else:
            moments, hyper_arg = (weight, weight, flag_on), flag_on.double()
        partial = common.empty(grid_of(cfg), torch.float32, weight.device)
        launch(
            "check", weight, None, flag_on, partial, weight, *moments, hyper_arg, float("inf"), grad_dtype,
            adamw_arithmetic(weight.device), False, cfg=cfg,
        )  # fmt: skip

    key = (E, M, N, name, str(weight.dtype), str(grad_dtype), p_from_tokens, q_from_tokens)
    chosen = configs.choose("wgrad", key, dtype, weight.device, trial)
    grid = grid_of(chosen)

    if update is None:
        offsets = meta.expert_offsets
        if accumulator is None:
            grad, grad_in = like(weight, weight.dtype), None
        else:
            grad = accumulator.buffer
            grad_in = grad if accumulator.add else None
        launch(
            "store", grad, grad_in, offsets, offsets, grad, grad, grad, offsets, offsets, 0.0, grad.dtype,
            "fp64", False,
        )  # fmt: skip
        if accumulator is None:
            return grad
        if accumulator.on_done is not None:
            accumulator.on_done()
        return None

    hyper = update.hyper
    eight_bit = update.moments_8bit
    # 8-bit exp_avg_sq is fp32 levels times an fp32 scale: fp32's limit.
    limit = grad_limit(torch.float32 if eight_bit else update.exp_avg_sq.dtype)
    # 8-bit moments and stochastic rounding: the "fp64" arithmetic everywhere, the torch backend's too.
    arithmetic = "fp64" if eight_bit or update.seed is not None else adamw_arithmetic(weight.device)
    state = (weight, update.exp_avg, update.exp_avg_sq, update.step)
    # The AdamW launches compile without automatic fma contraction, so the arithmetic is the one written
    # in kernels/adamw.py (explicit fmas only); the wgrad kernel's other epilogues keep it.
    no_fusion = {"enable_fp_fusion": False}
    # The 8-bit update and bf16 master weights run their GEMM on their own tiles (configs.WGRAD_8BIT), in the
    # fused epilogue and, so that both give the same bits, on the split path (a tile shape sums in its own
    # order, on a GPU and under the interpreter alike).
    own = eight_bit or update.remainder is not None or update.seed is not None
    split_cfg = configs.WGRAD_8BIT if own else chosen
    # One fp32 per program: the check pass's flags, then the update's sums of squares (telemetry).
    partial = common.empty(grid if update.fused else grid_of(split_cfg), torch.float32, weight.device)
    if update.fused:
        if bound is None:
            raise ValueError("a fused update needs the bound of its gradient")
        # A gradient entry beyond the limit, or beyond what the gradient dtype holds (it would round to inf).
        entry_limit = min(limit, torch.finfo(update.grad_dtype).max)
        maybe = overflow_possible(bound, update.grad_in, entry_limit, torch.finfo(dtype).max)
        launch(
            "check", weight, update.grad_in, maybe, partial, *state, hyper, limit, update.grad_dtype,
            arithmetic, False,
        )  # fmt: skip
        skip = partial.amax()
        grad = None
    else:
        grad = like(weight, update.grad_dtype)
        launch(
            "store", grad, update.grad_in, update.step, partial, *state, hyper, limit, update.grad_dtype,
            arithmetic, update.grad_norm_sq is not None, cfg=split_cfg,
        )  # fmt: skip
        skip = (~(inf_norm(grad) <= limit)).float()
    # torch's AdamW increments the step before it computes the bias corrections; a skipped update
    # leaves it (as torch's fused AdamW does with found_inf).
    advance = 1.0 - skip
    update.step.add_(advance)
    # Stochastic rounding's key and counter base: the tensor's seed and the update's step, on the device.
    rng = None if update.seed is None else torch.stack([update.seed, update.step.to(torch.int64)])
    # Expert clipping: one int32 count per program of the update's launch (the spike rule's replacements).
    clip = update.clipping
    counts = None
    applied = False
    try:
        # step_size and sqrt(bc2) of this step, once (the update kernels read them); for 8-bit moments and
        # stochastic rounding the torch ops that the torch backend's update reads too.
        if eight_bit or update.seed is not None:
            scalars = adamw_scalars(update.step, hyper)
            scales = (
                (update.exp_avg_scales, update.exp_avg_sq_scales, moments_8bit_tables(weight.device))
                if eight_bit
                else None
            )
        else:
            scalars, scales = common.empty((2,), torch.float32, weight.device), None
            # The "fp32" arithmetic's beta ** step: torch's own pow (the one its fused AdamW calls; Triton's
            # libdevice powf rounds differently, kernels/adamw.py).
            powers = torch.pow(hyper[1:3].to(torch.float32), update.step) if arithmetic == "fp32" else scalars
            adamw_scalars_kernel[(1,)](
                update.step,
                hyper,
                powers,
                scalars,
                ARITHMETIC=arithmetic,
                INTERPRET=interpret,
                num_warps=1,
                **no_fusion,
            )
        if update.fused:
            if own:  # one sum of squares per program of their own tiles' grid
                partial = common.empty(grid_of(configs.WGRAD_8BIT), torch.float32, weight.device)
            if clip:
                counts = torch.zeros(partial.numel(), dtype=torch.int32, device=weight.device)
            launch(
                "adamw", weight, update.grad_in, skip, partial, weight, update.exp_avg, update.exp_avg_sq,
                scalars, hyper, limit, update.grad_dtype, arithmetic, update.grad_norm_sq is not None, scales=scales,
                remainder=update.remainder, rng=rng, clip_counts=counts, **no_fusion,
            )  # fmt: skip
        elif eight_bit:
            counts = moments_8bit.adamw_8bit_triton_(
                weight, grad, (update.exp_avg, update.exp_avg_scales), (update.exp_avg_sq, update.exp_avg_sq_scales),
                scalars, skip, hyper, remainder=update.remainder, rng=rng,
            )  # fmt: skip
        else:
            remainder = update.remainder
            bits = remainder is not None or rng is not None  # the weight through its int16 bits
            ac = ADAMW_MASTER_CONFIG if bits else ADAMW_CONFIG
            programs = triton.cdiv(weight.numel(), ac["BLOCK"])
            if clip:
                counts = torch.zeros(programs, dtype=torch.int32, device=weight.device)
            adamw_kernel[(programs,)](
                weight.view(torch.int16) if bits else weight, grad, update.exp_avg, update.exp_avg_sq, scalars,
                skip, hyper, hyper if remainder is None else remainder, hyper if rng is None else rng,
                hyper if counts is None else counts, weight.numel(),
                BLOCK=ac["BLOCK"], ARITHMETIC=arithmetic, REMAINDER=remainder is not None,
                STOCHASTIC=rng is not None, CLIP=clip, INTERPRET=interpret, num_warps=ac["num_warps"], **no_fusion,
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
    if update.clipped is not None:
        # A skipped update clipped nothing (its programs returned before counting: the counts stay 0). On the
        # device: a Python 0 copied in would be a host-to-device copy, which waits for the stream.
        if counts is None:
            update.clipped.zero_()
        else:
            update.clipped.copy_(counts.sum())
    if update.on_done is not None:
        update.on_done()
    return None
