"""The wgrad kernel of one expert tensor, with the AdamW update fused into its epilogue: each program owns
one tile of one expert's weight gradient, reduces over all of that expert's rows, and stores the gradient,
checks it, or applies AdamW to the tile of the weight and its moments (exact moments: ``kernels/adamw.py``;
8-bit moments: ``kernels/moments_8bit.py``). Launched by ``ops/triton_backend/wgrad.py`` (docs/design.md, "Backward and
the fused update", steps 4 and 5).
"""

import triton
import triton.language as tl

from sonar_kernels.kernels.adamw import adamw_tile
from sonar_kernels.kernels.common import round_to, split_columns
from sonar_kernels.kernels.moments_8bit import adamw_8bit_tile
from sonar_kernels.kernels.wgrad_epilogue import (
    dw_8bit_prefetched,
    dw_epilogue_prefetched,
    scale_offsets,
    slice_gradient,
    slice_offsets,
)

# The wgrad kernels have their own tiles (M and N are weight dimensions, K runs over an expert's rows).
# The AdamW epilogue updates the accumulator EPILOGUE_SPLIT column slices at a time, so W, exp_avg and
# exp_avg_sq tiles of only BLOCK_N / EPILOGUE_SPLIT columns are live beside it. Chosen by
# `make kernel-report`: no register spills on sm_90a and sm_80 at aligned shapes (128x128 spills in
# the fused fp32 epilogue even when split 4 ways).
WGRAD_CONFIG = {
    "BLOCK_M": 128,
    "BLOCK_N": 64,
    "BLOCK_K": 32,
    "EPILOGUE_SPLIT": 4,
    "EPILOGUE_PREFETCH": False,
    "num_warps": 8,
    "num_stages": 3,
}
# The fused update with 8-bit moments: slices of one 32-column block of the scales (EPILOGUE_SPLIT =
# BLOCK_N / 32), and half the rows, so that the dequantize-update-requantize fits the registers (make
# kernel-report: the 128-row tile spills on sm_80 and sm_90a).
WGRAD_8BIT_CONFIG = WGRAD_CONFIG | {"BLOCK_M": 64, "EPILOGUE_SPLIT": 2}


@triton.jit
def _dw_epilogue_slice(
    acc,  # [BLOCK_M, SLICE_N] fp32 wgrad
    offs_m,  # [BLOCK_M] int64
    m_offsets,  # [BLOCK_M] int64: the element offset of each row m
    col0,
    M,
    N,
    dw_ptr,
    grad_in_ptr,
    w_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    stride_n,
    step_size,
    bc2_sqrt,
    hyper_ptr,
    grad_limit,
    exp_avg_scales_ptr,  # 8-bit moments: the scales of the expert's blocks
    exp_avg_sq_scales_ptr,
    tables_ptr,  # 8-bit moments: [384] fp32, exp_avg's 128 magnitudes then exp_avg_sq's 256 levels
    m_soffsets,  # [BLOCK_M] int64: the offset of row m's first scale (8-bit moments)
    remainder_ptr,  # REMAINDER: the int16 remainders of the bf16 weight (W's offsets)
    rng_ptr,  # STOCHASTIC: [2] int64, the seed and the step
    base,  # the expert's element offset in the tensor (STOCHASTIC: the stream's counter is base + offs)
    SLICE_N: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HAS_GRAD_IN: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ARITHMETIC: tl.constexpr,
    MOMENTS_8BIT: tl.constexpr,
    REMAINDER: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    CLIP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Columns [col0, col0 + SLICE_N) of the tile: the gradient stored ("store"), AdamW applied to W and
    its moments ("adamw"), or the gradient only checked ("check").

    With HAS_GRAD_IN the gradient of earlier micro-batches (GRAD_DTYPE) is added first, as autograd adds
    a new gradient to ``.grad``: round(previous + round(acc)). Returns (result, clipped): result, for
    "check", the number of entries that are not <= grad_limit in magnitude (NaN included); otherwise the
    slice's sum of squared gradient entries (fp32, before expert clipping) when HAS_NORM, else 0; clipped,
    the number of entries the spike rule replaced ("adamw" with CLIP, kernels/adamw.py's clip_tile), else 0.
    """
    offs, mask = slice_offsets(offs_m, m_offsets, col0, M, N, stride_n, SLICE_N)
    grad = slice_gradient(acc, offs, mask, grad_in_ptr, GRAD_DTYPE, HAS_GRAD_IN, INTERPRET)
    grad32 = grad.to(tl.float32)
    result = 0.0
    clipped = 0
    if EPILOGUE == "check":
        result = tl.sum(tl.where(mask & ~(tl.abs(grad32) <= grad_limit), 1.0, 0.0))
    else:
        if HAS_NORM:
            result = tl.sum(tl.where(mask, grad32 * grad32, 0.0))
        if EPILOGUE == "adamw" and MOMENTS_8BIT:
            # Codes share the weight's offsets; the slice's columns are whole blocks of the scales'
            # contiguous dimension (the launcher checks stride_n == 1 and SLICE_N % BLOCK == 0).
            scale_offs, scale_mask = scale_offsets(offs_m, m_soffsets, col0, M, N, SLICE_N)
            clipped = adamw_8bit_tile(
                grad32, offs, mask, scale_offs, scale_mask, w_ptr, exp_avg_ptr, exp_avg_scales_ptr, exp_avg_sq_ptr,
                exp_avg_sq_scales_ptr, tables_ptr, tables_ptr + 128, remainder_ptr, rng_ptr, base + offs, step_size,
                bc2_sqrt, hyper_ptr, BLOCK_M, SLICE_N, REMAINDER, STOCHASTIC, CLIP, GRAD_DTYPE, INTERPRET, False,
            )  # fmt: skip
        elif EPILOGUE == "adamw":
            clipped = adamw_tile(
                grad32, offs, mask, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, remainder_ptr, rng_ptr, base + offs,
                step_size, bc2_sqrt, hyper_ptr, ARITHMETIC, REMAINDER, STOCHASTIC, CLIP, GRAD_DTYPE, INTERPRET,
            )  # fmt: skip
        else:
            tl.store(dw_ptr + offs, grad, mask=mask)
    return result, clipped


@triton.jit(do_not_specialize=("E",))  # E only bounds loops and masks: one build for every expert count
def expert_mlp_bwd_dw_kernel(
    # pointers
    p_ptr,  # left operand rows: grad_out [T, H] (P_FROM_TOKENS) or grad_hpre [S, 2I]; activation dtype
    q_ptr,  # right operand rows: A [S, I] or hidden_states [T, H] (Q_FROM_TOKENS); activation dtype
    weight_of_row_ptr,  # [S] fp32, read when P_FROM_TOKENS: each row's routing weight (ops/triton_backend/wgrad_launch.py)
    token_of_row_ptr,  # [S] int32, read when P_FROM_TOKENS or Q_FROM_TOKENS
    expert_offsets_ptr,  # [E + 1] int32, read
    dw_ptr,  # [E, M, N] GRAD_DTYPE, written by "store" (may be grad_in_ptr: each entry is read first)
    grad_in_ptr,  # [E, M, N] GRAD_DTYPE, read when HAS_GRAD_IN (earlier micro-batches' gradient)
    w_ptr,  # [E, M, N] fp32/bf16/fp16, read and written by "adamw"
    exp_avg_ptr,  # [E, M, N] moments dtype, read and written by "adamw"
    exp_avg_sq_ptr,  # [E, M, N] moments dtype, read and written by "adamw"
    scalars_ptr,  # [2] fp32, read by "adamw": step_size, bc2_sqrt (kernels/update_steps.py, update_begin_kernel)
    flag_ptr,  # [] fp32, read by "adamw" (skip the update when != 0) and "check" (run only when != 0)
    partial_ptr,  # [grid] fp32, written by "check" (1.0: the tile has a gradient entry beyond grad_limit)
    #               and, with HAS_NORM, by the others (each program's sum of squared gradient entries)
    hyper_ptr,  # [5] fp64, read by "adamw": lr, beta1, beta2, eps, weight_decay (torch's fused AdamW
    #             takes them as C++ doubles, docs/design.md)
    exp_avg_scales_ptr,  # MOMENTS_8BIT: [E, M, N / 32] fp32, read and written by "adamw" (exp_avg_ptr:
    #                      its int8 codes, exp_avg_sq_ptr: its uint8 codes)
    exp_avg_sq_scales_ptr,  # MOMENTS_8BIT: [E, M, N / 32] fp32, read and written by "adamw"
    tables_ptr,  # MOMENTS_8BIT: [384] fp32, the codes' tables (rules/moments_8bit.py)
    remainder_ptr,  # REMAINDER: [E, M, N] int16 (W's strides), read and written by "adamw" (w_ptr: the
    #                 bf16 weight's int16 bits; docs/design.md, "bf16 master weights")
    rng_ptr,  # STOCHASTIC: [2] int64, read by "adamw": the seed and the step (w_ptr: the int16 bits)
    clipped_ptr,  # CLIP: [grid] int32, written by "adamw": each program's count of entries the spike rule
    #               replaced (hyper_ptr is then [7]: + spike_threshold, grad_scale; kernels/adamw.py, clip_tile)
    # sizes
    E,
    M,
    N,
    # strides
    stride_pr,
    stride_pm,
    stride_qr,
    stride_qn,
    stride_e,  # dW, W, exp_avg and exp_avg_sq share their strides
    stride_half,  # W1 as [E, 2, I, H] (any layout): row m is (m // m_half, m % m_half); 0 for W2
    stride_m,
    stride_n,
    m_half,  # I for W1, M for W2
    stride_se,  # the scales' strides (8-bit moments), as stride_e, stride_half and stride_m
    stride_shalf,
    stride_sm,
    # the largest gradient magnitude an update takes ("check")
    grad_limit: tl.float32,
    # meta-parameters
    P_FROM_TOKENS: tl.constexpr,
    Q_FROM_TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
    EPILOGUE_PREFETCH: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HAS_GRAD_IN: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ARITHMETIC: tl.constexpr,
    MOMENTS_8BIT: tl.constexpr,
    REMAINDER: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    CLIP: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """dW[e] = sum over rows r of expert e of P[r]^T Q[r] -> [E, M, N]; AdamW in the epilogue.

    dW2: M -> H, N -> I, P[r] = w_r * dO[token_r] (rounded to DOT_DTYPE), Q[r] = A[r].
    dW1: M -> 2I, N -> H, P[r] = dHpre[r], Q[r] = X[token_r]. K -> the rows of expert e.
    dW1's row m (gate rows m < I, then up rows) is stored at half m // I, row m % I of W1 seen as
    [E, 2, I, H] through its strides, so every layout of :func:`sonar_kernels.specs.gate_up_view` is
    updated in place (dW2: ``stride_half`` 0, ``m_half`` M).
    Each program owns one [BLOCK_M, BLOCK_N] tile of one expert and reduces over all of that expert's
    rows (no split-K, no atomics), so its epilogue holds the whole gradient of the tile: rounded to
    GRAD_DTYPE (plus the gradient of earlier micro-batches, HAS_GRAD_IN), it is, in EPILOGUE_SPLIT
    column slices, either stored to dW (EPILOGUE "store"), or applied to W, exp_avg and exp_avg_sq in the
    arithmetic ARITHMETIC names (see kernels/adamw.py; "adamw"; with MOMENTS_8BIT the moments are codes
    and block scales, updated by kernels/moments_8bit.py in its arithmetic), or only checked against grad_limit
    ("check": the pass that decides, before the update's launch, whether the whole tensor's update is
    skipped, since one tile cannot skip it once other tiles are stored). EPILOGUE_PREFETCH ("adamw" only;
    8-bit moments: 2 slices, and the closed-form quantizer): each slice's W and moments loaded before the
    previous slice's math and stores, the same bits. With HAS_NORM each program also
    writes the sum of its squared gradient entries (telemetry; summed in a fixed order by the launcher).
    An expert with no rows gets a zero gradient (still a full AdamW step).
    Grid: (E * cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),).
    """
    pid = tl.program_id(0)
    # Nested: the flag is only loaded in the epilogues that have one (a constexpr test first).
    if EPILOGUE == "adamw":  # noqa: SIM102
        if tl.load(flag_ptr) != 0.0:
            return
    if EPILOGUE == "check":  # noqa: SIM102
        if tl.load(flag_ptr) == 0.0:
            tl.store(partial_ptr + pid, 0.0)
            return
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    expert = pid // (num_pid_m * num_pid_n)
    tile = pid % (num_pid_m * num_pid_n)
    pid_m = tile // num_pid_n
    pid_n = tile % num_pid_n
    row_start = tl.load(expert_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_K):
        rows = r0 + offs_k
        mask_k = rows < row_end
        # The only index loaded in the loop is the gathered operand's row (contiguous, not dependent on
        # another load); a routing weight is a contiguous fp32 per row.
        tokens = rows.to(tl.int64)
        if P_FROM_TOKENS or Q_FROM_TOKENS:
            tokens = tl.load(token_of_row_ptr + rows, mask=mask_k, other=0).to(tl.int64)
        p_rows = tokens if P_FROM_TOKENS else rows.to(tl.int64)
        p = tl.load(
            p_ptr + p_rows[None, :] * stride_pr + offs_m[:, None] * stride_pm,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        if P_FROM_TOKENS:
            w = tl.load(weight_of_row_ptr + rows, mask=mask_k, other=0.0)
            p = round_to(p.to(tl.float32) * w[None, :], DOT_DTYPE, INTERPRET)
        q_rows = tokens if Q_FROM_TOKENS else rows.to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qr + offs_n[None, :] * stride_qn,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if INTERPRET:
            p = p.to(tl.float32)
            q = q.to(tl.float32)
        acc = tl.dot(p, q, acc, input_precision=INPUT_PRECISION)

    step_size = 0.0
    bc2_sqrt = 1.0
    if EPILOGUE == "adamw":
        # The epilogue slices read the hyperparameters from memory where they use them (cached), so that
        # no fp64 value stays live in registers across the slices.
        step_size = tl.load(scalars_ptr)
        bc2_sqrt = tl.load(scalars_ptr + 1)
    base = expert.to(tl.int64) * stride_e
    dw_ptr += base
    grad_in_ptr += base
    w_ptr += base
    exp_avg_ptr += base
    exp_avg_sq_ptr += base
    remainder_ptr += base
    col0 = pid_n * BLOCK_N
    m_offsets = (offs_m // m_half) * stride_half + (offs_m % m_half) * stride_m
    scale_base = expert.to(tl.int64) * stride_se
    exp_avg_scales_ptr += scale_base
    exp_avg_sq_scales_ptr += scale_base
    m_soffsets = (offs_m // m_half) * stride_shalf + (offs_m % m_half) * stride_sm
    # One call per column slice (unrolled: EPILOGUE_SPLIT is a constexpr); the slices' sums of squares
    # (or out-of-range counts) are added in a fixed order. EPILOGUE_PREFETCH: the exact-moment update's
    # slices with their loads issued one slice ahead, and the 8-bit update's 2 slices (the other epilogues
    # have nothing to prefetch; the launcher sets EPILOGUE_PREFETCH for "adamw" only).
    if EPILOGUE_PREFETCH and EPILOGUE == "adamw" and MOMENTS_8BIT:
        tl.static_assert(EPILOGUE_SPLIT == 2, "the prefetched 8-bit epilogue has 2 slices")
        total, clipped = dw_8bit_prefetched(
            acc, offs_m, m_offsets, m_soffsets, col0, M, N, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr,
            exp_avg_scales_ptr, exp_avg_sq_scales_ptr, tables_ptr, stride_n, step_size, bc2_sqrt, hyper_ptr,
            remainder_ptr, rng_ptr, base, BLOCK_M, BLOCK_N, GRAD_DTYPE, HAS_GRAD_IN, HAS_NORM, REMAINDER, STOCHASTIC,
            CLIP, INTERPRET,
        )  # fmt: skip
    elif EPILOGUE_PREFETCH and EPILOGUE == "adamw" and EPILOGUE_SPLIT > 1:
        total, clipped = dw_epilogue_prefetched(
            acc, offs_m, m_offsets, col0, M, N, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, stride_n, step_size,
            bc2_sqrt, hyper_ptr, remainder_ptr, rng_ptr, base, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT, GRAD_DTYPE,
            HAS_GRAD_IN, HAS_NORM, ARITHMETIC, REMAINDER, STOCHASTIC, CLIP, INTERPRET,
        )  # fmt: skip
    elif EPILOGUE_SPLIT == 1:
        total, clipped = _dw_epilogue_slice(
            acc, offs_m, m_offsets, col0, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, stride_n,
            step_size, bc2_sqrt, hyper_ptr, grad_limit, exp_avg_scales_ptr, exp_avg_sq_scales_ptr, tables_ptr,
            m_soffsets, remainder_ptr, rng_ptr, base,
            BLOCK_N, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, MOMENTS_8BIT, REMAINDER, STOCHASTIC, CLIP, BLOCK_M, INTERPRET,
        )  # fmt: skip
    elif EPILOGUE_SPLIT == 2:
        half: tl.constexpr = BLOCK_N // 2
        left, right = split_columns(acc, BLOCK_M, BLOCK_N)
        total, clipped = _dw_epilogue_slice(
            left, offs_m, m_offsets, col0, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, stride_n,
            step_size, bc2_sqrt, hyper_ptr, grad_limit, exp_avg_scales_ptr, exp_avg_sq_scales_ptr, tables_ptr,
            m_soffsets, remainder_ptr, rng_ptr, base,
            half, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, MOMENTS_8BIT, REMAINDER, STOCHASTIC, CLIP, BLOCK_M, INTERPRET,
        )  # fmt: skip
        more, more_clipped = _dw_epilogue_slice(
            right, offs_m, m_offsets, col0 + half, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr,
            stride_n, step_size, bc2_sqrt, hyper_ptr, grad_limit, exp_avg_scales_ptr, exp_avg_sq_scales_ptr, tables_ptr,
            m_soffsets, remainder_ptr, rng_ptr, base,
            half, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, MOMENTS_8BIT, REMAINDER, STOCHASTIC, CLIP, BLOCK_M, INTERPRET,
        )  # fmt: skip
        total += more
        clipped += more_clipped
    else:
        tl.static_assert(EPILOGUE_SPLIT == 4, "EPILOGUE_SPLIT must be 1, 2 or 4")
        half: tl.constexpr = BLOCK_N // 2
        quarter: tl.constexpr = BLOCK_N // 4
        left, right = split_columns(acc, BLOCK_M, BLOCK_N)
        q0, q1 = split_columns(left, BLOCK_M, half)
        total, clipped = _dw_epilogue_slice(
            q0, offs_m, m_offsets, col0, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, stride_n,
            step_size, bc2_sqrt, hyper_ptr, grad_limit, exp_avg_scales_ptr, exp_avg_sq_scales_ptr, tables_ptr,
            m_soffsets, remainder_ptr, rng_ptr, base,
            quarter, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, MOMENTS_8BIT, REMAINDER, STOCHASTIC, CLIP, BLOCK_M, INTERPRET,
        )  # fmt: skip
        more, more_clipped = _dw_epilogue_slice(
            q1, offs_m, m_offsets, col0 + quarter, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr,
            stride_n, step_size, bc2_sqrt, hyper_ptr, grad_limit, exp_avg_scales_ptr, exp_avg_sq_scales_ptr, tables_ptr,
            m_soffsets, remainder_ptr, rng_ptr, base,
            quarter, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, MOMENTS_8BIT, REMAINDER, STOCHASTIC, CLIP, BLOCK_M, INTERPRET,
        )  # fmt: skip
        total += more
        clipped += more_clipped
        q2, q3 = split_columns(right, BLOCK_M, half)
        more, more_clipped = _dw_epilogue_slice(
            q2, offs_m, m_offsets, col0 + half, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr,
            stride_n, step_size, bc2_sqrt, hyper_ptr, grad_limit, exp_avg_scales_ptr, exp_avg_sq_scales_ptr, tables_ptr,
            m_soffsets, remainder_ptr, rng_ptr, base,
            quarter, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, MOMENTS_8BIT, REMAINDER, STOCHASTIC, CLIP, BLOCK_M, INTERPRET,
        )  # fmt: skip
        total += more
        clipped += more_clipped
        more, more_clipped = _dw_epilogue_slice(
            q3, offs_m, m_offsets, col0 + half + quarter, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr,
            stride_n, step_size, bc2_sqrt, hyper_ptr, grad_limit, exp_avg_scales_ptr, exp_avg_sq_scales_ptr, tables_ptr,
            m_soffsets, remainder_ptr, rng_ptr, base,
            quarter, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, MOMENTS_8BIT, REMAINDER, STOCHASTIC, CLIP, BLOCK_M, INTERPRET,
        )  # fmt: skip
        total += more
        clipped += more_clipped
    if EPILOGUE == "check":
        tl.store(partial_ptr + pid, tl.where(total > 0.0, 1.0, 0.0))
    elif HAS_NORM:
        tl.store(partial_ptr + pid, total)
    if EPILOGUE == "adamw" and CLIP:
        tl.store(clipped_ptr + pid, clipped)
