"""Backward kernels of the gated expert MLP: dHpre and the routing-weight gradient, wgrad with the fused
AdamW epilogue, and the reduction of the routing-weight partial sums.

Order of the backward (docs/design.md, "Backward and the fused update"); the dX rows reuse the forward's
grouped GEMM and combine kernels (``expert_mlp_fwd``):

1. ``expert_mlp_bwd_dhpre_kernel``: G = dO[token] @ W2[e] per row (reads W2 before its update), the
   partial sums of d w = <G, A>, A recomputed from the saved Hpre, dHpre from dA = w * G; then
   ``expert_mlp_bwd_dweights_kernel`` reduces the partial sums.
2. dX rows = dHpre @ W1[e] (reads W1 before its update), then dX[t] = sum_j of them, in j order.
3. ``expert_mlp_bwd_dw_kernel`` for W2: dW2[e] = sum_r (w_r dO[token_r])^T A_r, AdamW in the epilogue.
4. ``expert_mlp_bwd_dw_kernel`` for W1: dW1[e] = sum_r dHpre_r^T X[token_r], AdamW in the epilogue.
"""

import triton
import triton.language as tl

from sonar_kernels.kernels.adamw import adamw_tile
from sonar_kernels.kernels.common import expert_tile, grouped_mm_acc, round_to
from sonar_kernels.kernels.expert_mlp_fwd import clamp_gate_up, gelu_tanh_inner, glu_fwd

# dHpre is a grouped GEMM over row tiles, like the forward. These are the default configurations (the only
# ones for fp32); the 16-bit tuning candidates are in sonar_kernels/ops/configs.py.
DHPRE_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3}
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
    "num_warps": 8,
    "num_stages": 3,
}
DWEIGHTS_CONFIG = {"BLOCK": 256, "num_warps": 4}


@triton.jit
def _glu_bwd(gate, up, grad_a, ACTIVATION: tl.constexpr, alpha, limit, GATED: tl.constexpr = True):
    """(d gate, d up) of A = act(gate) * up, fp32 in and out; silu (SwiGLU), exact erf gelu or its tanh
    approximation (GeGLU), or the clamped SwiGLU (glu_fwd), whose clamps pass the gradient where their
    input is within the bounds, bounds included (torch's clamp backward; 0 for a NaN). Without GATED
    (act(gate) alone): (grad_a * act'(gate), unspecified)."""
    if ACTIVATION == "clamped_swiglu":
        g, u = clamp_gate_up(gate, up, limit)
        sig = 1.0 / (1.0 + tl.exp(-alpha * g))
        glu = g * sig
        # d/dg g sigmoid(alpha g) = sigmoid + alpha g sigmoid (1 - sigmoid).
        grad_g = grad_a * (u + 1.0) * (sig + alpha * g * sig * (1.0 - sig))
        grad_u = grad_a * glu
        return tl.where(gate <= limit, grad_g, 0.0), tl.where((up >= -limit) & (up <= limit), grad_u, 0.0)
    if ACTIVATION == "silu":
        sig = 1.0 / (1.0 + tl.exp(-gate))
        act = gate * sig
        act_grad = sig * (1.0 + gate * (1.0 - sig))
    elif ACTIVATION == "relu2":
        r = tl.where(gate < 0.0, 0.0, gate)
        act = r * r
        act_grad = 2.0 * r
    elif ACTIVATION == "gelu_tanh":
        # d/dx 0.5 x (1 + tanh(u)) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) du/dx, as torch's GeluBackward.
        tanh = gelu_tanh_inner(gate)
        act = 0.5 * gate * (1.0 + tanh)
        act_grad = 0.5 * (1.0 + tanh) + 0.5 * gate * (1.0 - tanh * tanh) * 0.7978845608028654 * (
            1.0 + 3.0 * 0.044715 * gate * gate
        )
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(gate * 0.7071067811865476))
        act = gate * cdf
        # d/dx x * Phi(x) = Phi(x) + x * phi(x), phi the standard normal density.
        act_grad = cdf + gate * tl.exp(-0.5 * gate * gate) * 0.3989422804014327
    if GATED:
        return grad_a * up * act_grad, grad_a * act
    return grad_a * act_grad, grad_a


@triton.jit
def _absmax(x, mask):
    """max |x| over the masked entries of an fp32 tile, a NaN counting as inf (0 for an empty mask)."""
    return tl.max(tl.where(mask, tl.where(x == x, tl.abs(x), float("inf")), 0.0))


@triton.jit
def expert_mlp_bwd_dhpre_kernel(
    # pointers
    grad_out_ptr,  # [T, H] activation dtype, read (rows gathered by token; any strides, 0 included)
    w2_ptr,  # [E, H, I] activation dtype or fp32, read
    hpre_ptr,  # [S, 2I] activation dtype, read (saved by the forward)
    weights_ptr,  # [T, top_k] floating, read at kept slots
    token_of_row_ptr,  # [S] int32, read
    slot_of_row_ptr,  # [S] int32, read
    expert_offsets_ptr,  # [E + 1] int32, read
    tile_offsets_ptr,  # [E + 1] int32, read
    grad_hpre_ptr,  # [S, 2I] activation dtype, written for rows < expert_offsets[E] when STORE_GRAD_HPRE
    a_ptr,  # [S, I] activation dtype, written for rows < expert_offsets[E] when STORE_A
    dw_partial_ptr,  # [cdiv(I, BLOCK_N), S] fp32, written for rows < expert_offsets[E] when COMPUTE_DW
    absmax_ptr,  # [grid, 2] fp32, written when HAS_ABSMAX: per program max |A| and max |dHpre| (NaN -> inf)
    # sizes
    E,
    H,
    I,
    top_k,
    # strides
    stride_got,
    stride_goh,
    stride_we,
    stride_wh,
    stride_wi,
    stride_hs,
    stride_hn,
    stride_wt,
    stride_wj,
    stride_gs,
    stride_gn,
    stride_as,
    stride_an,
    stride_dwp,
    # the clamped SwiGLU's slope and clamp (read only by ACTIVATION "clamped_swiglu")
    alpha: tl.float32,
    limit: tl.float32,
    # meta-parameters
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STORE_GRAD_HPRE: tl.constexpr,
    STORE_A: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    HAS_ABSMAX: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """G[r] = dO[token(r)] @ W2[e(r)]; dw partial = sum_n G * A; dHpre = GLU'(Hpre) applied to w * G.

    A = act(Hpre[:, :I]) * Hpre[:, I:] is recomputed exactly as the forward computed it (same code, same
    rounding). dA = w * G is rounded to the activation dtype, as the gradient of the rounded A is.
    Mapping: M -> rows r, N -> I, K -> H.
    With HAS_ABSMAX each program writes the largest magnitude of the A and dHpre entries it computed
    (rounded; a NaN counts as inf; 0 where it has none): the wgrad launches bound their gradients
    with them (``ops.overflow_possible``).
    Grid: (row tiles * cdiv(I, BLOCK_N),).
    Preconditions: tile_offsets for row tiles of BLOCK_M rows (ops.common.tile_offsets_for).
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    if pid_m >= tl.load(tile_offsets_ptr + E):
        if HAS_ABSMAX:
            tl.store(absmax_ptr + 2 * pid + tl.arange(0, 2), tl.zeros((2,), tl.float32))
        return
    expert, row_start, row_end = expert_tile(pid_m, tile_offsets_ptr, expert_offsets_ptr, E, BLOCK_M)
    dtype = hpre_ptr.dtype.element_ty

    rows = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = rows < row_end
    tokens = tl.load(token_of_row_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = cols < I
    grad_proj = grouped_mm_acc(
        tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), grad_out_ptr, tokens, mask_m, stride_got, stride_goh,
        w2_ptr + expert.to(tl.int64) * stride_we, cols, mask_n, stride_wi, stride_wh,
        H, BLOCK_M, BLOCK_N, BLOCK_K, dtype, INPUT_PRECISION, INTERPRET,
    )  # fmt: skip  # [BLOCK_M, BLOCK_N] G

    mask = mask_m[:, None] & mask_n[None, :]
    h_ptrs = hpre_ptr + rows[:, None] * stride_hs + cols[None, :] * stride_hn
    gate = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)  # without GATED: the one projection
    up = tl.load(h_ptrs + I * stride_hn, mask=mask, other=0.0).to(tl.float32) if GATED else gate
    a = round_to(glu_fwd(gate, up, ACTIVATION, alpha, limit, GATED), dtype, INTERPRET)
    if STORE_A:
        tl.store(a_ptr + rows[:, None] * stride_as + cols[None, :] * stride_an, a, mask=mask)
    if HAS_ABSMAX:
        tl.store(absmax_ptr + 2 * pid, _absmax(a.to(tl.float32), mask))
    if COMPUTE_DW:
        # <dO[t], Y[r]> = <G[r], A[r]>: the routing-weight gradient without the expert outputs Y.
        partial = tl.sum(tl.where(mask, grad_proj * a.to(tl.float32), 0.0), axis=1)  # [BLOCK_M]
        tl.store(dw_partial_ptr + pid_n.to(tl.int64) * stride_dwp + rows, partial, mask=mask_m)

    if STORE_GRAD_HPRE:
        slots = tl.load(slot_of_row_ptr + rows, mask=mask_m, other=0)
        w = tl.load(
            weights_ptr + (slots // top_k).to(tl.int64) * stride_wt + (slots % top_k) * stride_wj,
            mask=mask_m,
            other=0.0,
        ).to(tl.float32)
        grad_a = round_to(w[:, None] * grad_proj, dtype, INTERPRET).to(tl.float32)
        grad_gate, grad_up = _glu_bwd(gate, up, grad_a, ACTIVATION, alpha, limit, GATED)
        grad_gate = round_to(grad_gate, dtype, INTERPRET)
        g_ptrs = grad_hpre_ptr + rows[:, None] * stride_gs + cols[None, :] * stride_gn
        tl.store(g_ptrs, grad_gate, mask=mask)
        largest = _absmax(grad_gate.to(tl.float32), mask)
        if GATED:
            grad_up = round_to(grad_up, dtype, INTERPRET)
            tl.store(g_ptrs + I * stride_gn, grad_up, mask=mask)
            largest = tl.maximum(largest, _absmax(grad_up.to(tl.float32), mask))
        if HAS_ABSMAX:
            tl.store(absmax_ptr + 2 * pid + 1, largest)
    elif HAS_ABSMAX:
        tl.store(absmax_ptr + 2 * pid + 1, 0.0)


@triton.jit
def _split_columns(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] -> its column halves [BLOCK_M, BLOCK_N // 2] (left, right)."""
    half: tl.constexpr = BLOCK_N // 2
    return tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, half)), (0, 2, 1)))


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
    SLICE_N: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HAS_GRAD_IN: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ARITHMETIC: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Columns [col0, col0 + SLICE_N) of the tile: the gradient stored ("store"), AdamW applied to W and
    its moments ("adamw"), or the gradient only checked ("check").

    With HAS_GRAD_IN the gradient of earlier micro-batches (GRAD_DTYPE) is added first, as autograd adds
    a new gradient to ``.grad``: round(previous + round(acc)). Returns, for "check", the number of
    entries that are not <= grad_limit in magnitude (NaN included); otherwise the slice's sum of squared
    gradient entries (fp32) when HAS_NORM, else 0.
    """
    offs_n = (col0 + tl.arange(0, SLICE_N)).to(tl.int64)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    offs = m_offsets[:, None] + offs_n[None, :] * stride_n
    grad = round_to(acc, GRAD_DTYPE, INTERPRET)
    if HAS_GRAD_IN:
        previous = tl.load(grad_in_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        grad = round_to(previous + grad.to(tl.float32), GRAD_DTYPE, INTERPRET)
    grad32 = grad.to(tl.float32)
    result = 0.0
    if EPILOGUE == "check":
        result = tl.sum(tl.where(mask & ~(tl.abs(grad32) <= grad_limit), 1.0, 0.0))
    else:
        if HAS_NORM:
            result = tl.sum(tl.where(mask, grad32 * grad32, 0.0))
        if EPILOGUE == "adamw":
            adamw_tile(
                grad32, offs, mask, w_ptr, exp_avg_ptr, exp_avg_sq_ptr,
                step_size, bc2_sqrt, hyper_ptr, ARITHMETIC, INTERPRET,
            )  # fmt: skip
        else:
            tl.store(dw_ptr + offs, grad, mask=mask)
    return result


@triton.jit
def expert_mlp_bwd_dw_kernel(
    # pointers
    p_ptr,  # left operand rows: grad_out [T, H] (P_FROM_TOKENS) or grad_hpre [S, 2I]; activation dtype
    q_ptr,  # right operand rows: A [S, I] or hidden_states [T, H] (Q_FROM_TOKENS); activation dtype
    weights_ptr,  # [T, top_k] floating, read when P_FROM_TOKENS
    slot_of_row_ptr,  # [S] int32, read
    expert_offsets_ptr,  # [E + 1] int32, read
    dw_ptr,  # [E, M, N] GRAD_DTYPE, written by "store" (may be grad_in_ptr: each entry is read first)
    grad_in_ptr,  # [E, M, N] GRAD_DTYPE, read when HAS_GRAD_IN (earlier micro-batches' gradient)
    w_ptr,  # [E, M, N] fp32/bf16/fp16, read and written by "adamw"
    exp_avg_ptr,  # [E, M, N] moments dtype, read and written by "adamw"
    exp_avg_sq_ptr,  # [E, M, N] moments dtype, read and written by "adamw"
    scalars_ptr,  # [2] fp32, read by "adamw": step_size, bc2_sqrt (kernels/adamw.py, adamw_scalars_kernel)
    flag_ptr,  # [] fp32, read by "adamw" (skip the update when != 0) and "check" (run only when != 0)
    partial_ptr,  # [grid] fp32, written by "check" (1.0: the tile has a gradient entry beyond grad_limit)
    #               and, with HAS_NORM, by the others (each program's sum of squared gradient entries)
    hyper_ptr,  # [5] fp64, read by "adamw": lr, beta1, beta2, eps, weight_decay (torch's fused AdamW
    #             takes them as C++ doubles, docs/design.md)
    # sizes
    E,
    M,
    N,
    top_k,
    # strides
    stride_pr,
    stride_pm,
    stride_qr,
    stride_qn,
    stride_wt,
    stride_wj,
    stride_e,  # dW, W, exp_avg and exp_avg_sq share their strides
    stride_half,  # W1 as [E, 2, I, H] (any layout): row m is (m // m_half, m % m_half); 0 for W2
    stride_m,
    stride_n,
    m_half,  # I for W1, M for W2
    # the largest gradient magnitude an update takes ("check")
    grad_limit: tl.float32,
    # meta-parameters
    P_FROM_TOKENS: tl.constexpr,
    Q_FROM_TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HAS_GRAD_IN: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ARITHMETIC: tl.constexpr,
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
    arithmetic ARITHMETIC names (see kernels/adamw.py; "adamw"), or only checked against grad_limit
    ("check": the pass that decides, before the update's launch, whether the whole tensor's update is
    skipped, since one tile cannot skip it once other tiles are stored). With HAS_NORM each program also
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
        slots = tl.load(slot_of_row_ptr + rows, mask=mask_k, other=0)
        tokens = (slots // top_k).to(tl.int64)
        p_rows = tokens if P_FROM_TOKENS else rows.to(tl.int64)
        p = tl.load(
            p_ptr + p_rows[None, :] * stride_pr + offs_m[:, None] * stride_pm,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        if P_FROM_TOKENS:
            w = tl.load(
                weights_ptr + tokens * stride_wt + (slots % top_k) * stride_wj, mask=mask_k, other=0.0
            ).to(tl.float32)
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
    col0 = pid_n * BLOCK_N
    m_offsets = (offs_m // m_half) * stride_half + (offs_m % m_half) * stride_m
    # One call per column slice (unrolled: EPILOGUE_SPLIT is a constexpr); the slices' sums of squares
    # (or out-of-range counts) are added in a fixed order.
    if EPILOGUE_SPLIT == 1:
        total = _dw_epilogue_slice(
            acc, offs_m, m_offsets, col0, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, stride_n,
            step_size, bc2_sqrt, hyper_ptr, grad_limit,
            BLOCK_N, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, INTERPRET,
        )  # fmt: skip
    elif EPILOGUE_SPLIT == 2:
        half: tl.constexpr = BLOCK_N // 2
        left, right = _split_columns(acc, BLOCK_M, BLOCK_N)
        total = _dw_epilogue_slice(
            left, offs_m, m_offsets, col0, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, stride_n,
            step_size, bc2_sqrt, hyper_ptr, grad_limit,
            half, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, INTERPRET,
        )  # fmt: skip
        total += _dw_epilogue_slice(
            right, offs_m, m_offsets, col0 + half, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr,
            stride_n, step_size, bc2_sqrt, hyper_ptr, grad_limit,
            half, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, INTERPRET,
        )  # fmt: skip
    else:
        tl.static_assert(EPILOGUE_SPLIT == 4, "EPILOGUE_SPLIT must be 1, 2 or 4")
        half: tl.constexpr = BLOCK_N // 2
        quarter: tl.constexpr = BLOCK_N // 4
        left, right = _split_columns(acc, BLOCK_M, BLOCK_N)
        q0, q1 = _split_columns(left, BLOCK_M, half)
        total = _dw_epilogue_slice(
            q0, offs_m, m_offsets, col0, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, stride_n,
            step_size, bc2_sqrt, hyper_ptr, grad_limit,
            quarter, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, INTERPRET,
        )  # fmt: skip
        total += _dw_epilogue_slice(
            q1, offs_m, m_offsets, col0 + quarter, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr,
            stride_n, step_size, bc2_sqrt, hyper_ptr, grad_limit,
            quarter, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, INTERPRET,
        )  # fmt: skip
        q2, q3 = _split_columns(right, BLOCK_M, half)
        total += _dw_epilogue_slice(
            q2, offs_m, m_offsets, col0 + half, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr,
            stride_n, step_size, bc2_sqrt, hyper_ptr, grad_limit,
            quarter, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, INTERPRET,
        )  # fmt: skip
        total += _dw_epilogue_slice(
            q3, offs_m, m_offsets, col0 + half + quarter, M, N, dw_ptr, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr,
            stride_n, step_size, bc2_sqrt, hyper_ptr, grad_limit,
            quarter, GRAD_DTYPE, EPILOGUE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, INTERPRET,
        )  # fmt: skip
    if EPILOGUE == "check":
        tl.store(partial_ptr + pid, tl.where(total > 0.0, 1.0, 0.0))
    elif HAS_NORM:
        tl.store(partial_ptr + pid, total)


@triton.jit
def expert_mlp_bwd_dweights_kernel(
    # pointers
    dw_partial_ptr,  # [num_partials, S] fp32, read at kept rows
    extra_ptr,  # [S] fp32, read at kept slots when HAS_EXTRA (the down bias's term <dO[t], b2[e]>)
    row_of_slot_ptr,  # [S] int32, read
    grad_weights_ptr,  # [S] (contiguous [T, top_k]) routing-weight dtype, written
    # sizes
    S,
    num_partials,
    # strides
    stride_dwp,
    # meta-parameters
    BLOCK: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """d w[s] = sum_p partial[p, row_of_slot(s)] in p order (deterministic), plus extra[s] with
    HAS_EXTRA; 0 for a dropped slot.

    Grid: (cdiv(S, BLOCK),).
    """
    offs_s = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask_s = offs_s < S
    rows = tl.load(row_of_slot_ptr + offs_s, mask=mask_s, other=-1)
    kept = rows >= 0
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    partial_ptrs = dw_partial_ptr + rows  # advanced by pointer increments: no int32 product
    for _ in range(0, num_partials):
        acc += tl.load(partial_ptrs, mask=kept, other=0.0)
        partial_ptrs += stride_dwp
    if HAS_EXTRA:
        acc += tl.load(extra_ptr + offs_s, mask=kept, other=0.0)
    tl.store(
        grad_weights_ptr + offs_s, round_to(acc, grad_weights_ptr.dtype.element_ty, INTERPRET), mask=mask_s
    )
