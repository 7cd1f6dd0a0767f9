"""Forward kernels of the gated expert MLP: up-projection + GLU, down-projection, weighted combine.

The down-projection grouped GEMM and the combine also serve the backward: with B = W1 read through
transposed strides they give the dX rows dHpre[r] @ W1[e], and the combine without weights sums them
over top_k into dX.

Row r of the grouped GEMMs is the r-th kept slot in expert order (``ops.routing_metadata``). Each grouped
GEMM is one launch for all experts over a grid of (row tile, column tile) programs; the row tiles come
from ``tile_offsets`` and programs past the last tile exit at once (the grid is sized for the worst case,
cdiv(S, BLOCK_M) + min(E, S) row tiles, so no host sync is needed).
"""

import triton
import triton.language as tl

from sonar_kernels.kernels.common import expert_tile, grouped_mm_acc, round_to

# The default configuration of both grouped GEMMs (the only one for fp32; the 16-bit tuning candidates
# are in sonar_kernels/ops/triton_backend/configs.py); the routing metadata's row tile TILE_M is its BLOCK_M (a launch with
# another BLOCK_M computes its own tile offsets, ops.common.tile_offsets_for). The up-projection's dot is
# 2 * BLOCK_N wide (gate and up columns together). Chosen by `make kernel-report`: no register spills on
# sm_90a or sm_80 for fp32 (FMA, no tf32), bf16 and fp16, at aligned and unaligned shapes.
FWD_GEMM_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3}
TILE_M = FWD_GEMM_CONFIG["BLOCK_M"]
COMBINE_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4}


@triton.jit
def glu_fwd(gate, up, ACTIVATION: tl.constexpr, alpha, limit, GATED: tl.constexpr = True):
    """act(gate) * up in fp32: SwiGLU for "silu", GeGLU for "gelu" (exact erf GELU) and "gelu_tanh" (the
    tanh approximation), relu(gate)^2 * up for "relu2"; "clamped_swiglu": (clamp(up, -limit, limit) + 1)
    * g * sigmoid(alpha * g) with g = min(gate, limit) (gpt-oss; a NaN stays NaN, as torch's clamp keeps
    it). Without GATED (an MLP with no gate: Nemotron-H) act(gate) alone, ``up`` unread."""
    if ACTIVATION == "clamped_swiglu":
        g, u = clamp_gate_up(gate, up, limit)
        return g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    if ACTIVATION == "silu":
        act = gate / (1.0 + tl.exp(-gate))
    elif ACTIVATION == "gelu_tanh":
        act = 0.5 * gate * (1.0 + gelu_tanh_inner(gate))
    elif ACTIVATION == "relu2":
        r = tl.where(gate < 0.0, 0.0, gate)  # a NaN stays NaN, as in torch's relu
        act = r * r
    else:
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    if GATED:
        return act * up
    return act


@triton.jit
def clamp_gate_up(gate, up, limit):
    """(min(gate, limit), clamp(up, -limit, limit)); a NaN passes through (comparisons with NaN are false)."""
    g = tl.where(gate > limit, limit, gate)
    u = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    return g, u


@triton.jit
def gelu_tanh_inner(x):
    """tanh(sqrt(2/pi) (x + 0.044715 x^3)) in fp32, as sign(u) (1 - e) / (1 + e) with e = exp(-2|u|) in
    (0, 1]: Triton has no tanh, and this form never overflows (a NaN stays NaN)."""
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u >= 0, t, -t)


@triton.jit(do_not_specialize=("E",))  # E only bounds loops and masks: one build for every expert count
def expert_mlp_fwd_up_kernel(
    # pointers
    x_ptr,  # [T, H] activation dtype, read (rows gathered by token_of_row)
    w1_ptr,  # [E, 2, I, H] (gate, up halves; any layout's strides) activation dtype or fp32, read
    b1_ptr,  # [E, 2, I] (the halves of gate_up_proj_bias) dtype of w1, read when HAS_BIAS
    token_of_row_ptr,  # [S] int32, read
    expert_offsets_ptr,  # [E + 1] int32, read
    tile_offsets_ptr,  # [E + 1] int32, read
    hpre_ptr,  # [S, 2I] activation dtype, written for rows < expert_offsets[E]
    a_ptr,  # [S, I] activation dtype, written for rows < expert_offsets[E]
    # sizes
    E,
    H,
    I,
    # strides
    stride_xt,
    stride_xh,
    stride_we,
    stride_wg,
    stride_wn,
    stride_wh,
    stride_hs,
    stride_hn,
    stride_as,
    stride_an,
    stride_be,
    stride_bg,
    stride_bn,
    # the clamped SwiGLU's slope and clamp (read only by ACTIVATION "clamped_swiglu")
    alpha: tl.float32,
    limit: tl.float32,
    # meta-parameters
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Hpre[r] = X[token(r)] @ W1[e(r)]^T; A[r] = act(Hpre[r, :I]) * Hpre[r, I:] from the rounded Hpre.

    W1 is read as [E, 2, I, H] through its strides (half 0 the gate rows, half 1 the up rows), so every
    layout of :func:`sonar_kernels.specs.gate_up_view` is read in place; Hpre is [gate | up] in all.
    Mapping: M -> rows r, N -> I (each program owns gate columns n and up columns I + n, one dot of
    width 2 * BLOCK_N), K -> H.
    Grid: (row tiles * cdiv(I, BLOCK_N),), row tile fastest-varying last (programs of one row tile are
    adjacent and share the gathered X rows).
    Preconditions: tile_offsets for row tiles of BLOCK_M rows (ops.common.tile_offsets_for).
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    if pid_m >= tl.load(tile_offsets_ptr + E):
        return
    expert, row_start, row_end = expert_tile(pid_m, tile_offsets_ptr, expert_offsets_ptr, E, BLOCK_M)
    dtype = hpre_ptr.dtype.element_ty

    offs_m = row_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < row_end
    tokens = tl.load(token_of_row_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    # Columns j < BLOCK_N of the dot are the gate rows n of W1 (half 0), columns j >= BLOCK_N the up rows
    # n (half 1); each row's element offset in W1 from the layout's strides (passed as rows of stride 1).
    # Without GATED, W1 has one half (the up projection: [E, 1, I, H]) and the dot is BLOCK_N wide.
    HALVES: tl.constexpr = 2 if GATED else 1
    offs_j = tl.arange(0, HALVES * BLOCK_N)
    offs_n = pid_n * BLOCK_N + offs_j % BLOCK_N
    mask_n = offs_n < I
    w_rows = offs_n.to(tl.int64) * stride_wn + (offs_j // BLOCK_N).to(tl.int64) * stride_wg
    acc = grouped_mm_acc(
        tl.zeros((BLOCK_M, HALVES * BLOCK_N), dtype=tl.float32), x_ptr, tokens, mask_m, stride_xt, stride_xh,
        w1_ptr + expert.to(tl.int64) * stride_we, w_rows, mask_n, 1, stride_wh,
        H, BLOCK_M, HALVES * BLOCK_N, BLOCK_K, dtype, INPUT_PRECISION, INTERPRET,
    )  # fmt: skip  # [BLOCK_M, HALVES * BLOCK_N]
    up_epilogue(
        acc, expert, offs_m, mask_m, pid_n, b1_ptr, hpre_ptr, a_ptr, I, stride_hs, stride_hn, stride_as,
        stride_an, stride_be, stride_bg, stride_bn, alpha, limit, ACTIVATION, GATED, HAS_BIAS, BLOCK_M, BLOCK_N,
        INTERPRET,
    )  # fmt: skip


@triton.jit
def up_epilogue(
    acc,  # [BLOCK_M, HALVES * BLOCK_N] fp32: columns j < BLOCK_N the gate, j >= BLOCK_N the up projection
    expert,
    offs_m,  # [BLOCK_M] the tile's rows
    mask_m,  # [BLOCK_M] rows < the expert's end
    pid_n,
    b1_ptr,
    hpre_ptr,
    a_ptr,
    I,
    stride_hs,
    stride_hn,
    stride_as,
    stride_an,
    stride_be,
    stride_bg,
    stride_bn,
    alpha,
    limit,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """The up-projection's epilogue (expert_mlp_fwd_up_kernel and its TMA variant, kernels/expert_mlp_tma.py):
    the bias in fp32, Hpre's one rounding and store, A = act(gate) * up from the rounded Hpre."""
    dtype = hpre_ptr.dtype.element_ty
    HALVES: tl.constexpr = 2 if GATED else 1
    offs_j = tl.arange(0, HALVES * BLOCK_N)
    offs_n = pid_n * BLOCK_N + offs_j % BLOCK_N
    mask_n = offs_n < I
    if HAS_BIAS:  # added in fp32 before the one rounding of Hpre
        b_offsets = offs_n.to(tl.int64) * stride_bn + (offs_j // BLOCK_N).to(tl.int64) * stride_bg
        bias = tl.load(b1_ptr + expert.to(tl.int64) * stride_be + b_offsets, mask=mask_n, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if GATED:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    else:
        gate, up = acc, acc  # the one projection, in the gate's place; up unused
    gate = round_to(gate, dtype, INTERPRET)  # [BLOCK_M, BLOCK_N]
    up = round_to(up, dtype, INTERPRET)

    rows = offs_m.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = mask_m[:, None] & (cols < I)[None, :]
    h_ptrs = hpre_ptr + rows[:, None] * stride_hs + cols[None, :] * stride_hn
    tl.store(h_ptrs, gate, mask=mask)
    if GATED:
        tl.store(h_ptrs + I * stride_hn, up, mask=mask)
    # The activation reads the rounded Hpre, exactly what the backward recomputes it from.
    a = glu_fwd(gate.to(tl.float32), up.to(tl.float32), ACTIVATION, alpha, limit, GATED)
    tl.store(
        a_ptr + rows[:, None] * stride_as + cols[None, :] * stride_an,
        round_to(a, dtype, INTERPRET),
        mask=mask,
    )


@triton.jit(do_not_specialize=("E",))  # E only bounds loops and masks: one build for every expert count
def expert_mlp_grouped_mm_kernel(
    # pointers
    a_ptr,  # [S, I] activation dtype, read
    w2_ptr,  # [E, H, I] (or W1 [E, 2, I, H] with HALVES 2) activation dtype or fp32, read
    b2_ptr,  # [E, H] dtype of w2, read when HAS_BIAS
    expert_offsets_ptr,  # [E + 1] int32, read
    tile_offsets_ptr,  # [E + 1] int32, read
    y_ptr,  # [S, H] activation dtype, written for rows < expert_offsets[E]
    # sizes
    E,
    H,
    I,
    # strides
    stride_as,
    stride_ai,
    stride_we,
    stride_wh,
    stride_wi,
    stride_whalf,
    stride_ys,
    stride_yh,
    stride_be,
    stride_bh,
    # meta-parameters
    HALVES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Y[r] = A[r] @ W2[e(r)]^T (forward, HALVES 1), or the dX rows dHpre[r] @ W1[e(r)] (backward,
    HALVES 2): the sum over the gate half (dHpre columns [0, I), W1 half 0) and the up half (columns
    [I, 2I), W1 half 1 at ``stride_whalf``) of A[r, half] @ W[e(r), half]^T, W1's half read as [H, I]
    through its strides (any layout of :func:`sonar_kernels.specs.gate_up_view`).

    Mapping: M -> rows r, N -> H, K -> I (per half).
    Grid: (row tiles * cdiv(H, BLOCK_N),).
    Preconditions: tile_offsets for row tiles of BLOCK_M rows (ops.common.tile_offsets_for).
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    if pid_m >= tl.load(tile_offsets_ptr + E):
        return
    expert, row_start, row_end = expert_tile(pid_m, tile_offsets_ptr, expert_offsets_ptr, E, BLOCK_M)
    dtype = y_ptr.dtype.element_ty

    rows = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = rows < row_end
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = cols < H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_ptr = w2_ptr + expert.to(tl.int64) * stride_we
    for half in tl.static_range(HALVES):
        acc = grouped_mm_acc(
            acc, a_ptr + half * I * stride_ai, rows, mask_m, stride_as, stride_ai,
            w_ptr + half * stride_whalf, cols, mask_n, stride_wh, stride_wi,
            I, BLOCK_M, BLOCK_N, BLOCK_K, dtype, INPUT_PRECISION, INTERPRET,
        )  # fmt: skip  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:  # Y = A W2^T + b2[e], added in fp32 before the one rounding
        bias = tl.load(b2_ptr + expert.to(tl.int64) * stride_be + cols * stride_bh, mask=mask_n, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ys + cols[None, :] * stride_yh
    tl.store(y_ptrs, round_to(acc, dtype, INTERPRET), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def expert_mlp_combine_kernel(
    # pointers
    y_ptr,  # [S, H] activation dtype, read at kept rows only
    row_of_slot_ptr,  # [S] int32, read
    weights_ptr,  # [T, top_k] floating, read when HAS_WEIGHTS
    out_ptr,  # [T, H] activation dtype, written
    # sizes
    T,
    H,
    top_k,
    # strides
    stride_ys,
    stride_yh,
    stride_wt,
    stride_wj,
    stride_ot,
    stride_oh,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out[t] = sum_j w[t, j] * Y[row_of_slot(t, j)] over kept slots, in fp32, j in order (no atomics).

    Without HAS_WEIGHTS, w = 1: dX[t] = sum_j of the dX rows.

    Mapping: M -> tokens t, N -> H.
    Grid: (cdiv(T, BLOCK_M), cdiv(H, BLOCK_N)).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_t = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_t = offs_t < T
    offs_h = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_h = offs_h < H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, top_k):
        rows = tl.load(row_of_slot_ptr + offs_t * top_k + j, mask=mask_t, other=-1)
        kept = rows >= 0
        # A dropped slot's weight is never loaded (it may be NaN), nor its row of Y (never written).
        y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ys + offs_h[None, :] * stride_yh
        y = tl.load(y_ptrs, mask=kept[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + offs_t * stride_wt + j * stride_wj, mask=kept, other=0.0)
            y = w.to(tl.float32)[:, None] * y
        acc += y
    out_ptrs = out_ptr + offs_t[:, None] * stride_ot + offs_h[None, :] * stride_oh
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptrs, round_to(acc, dtype, INTERPRET), mask=mask_t[:, None] & mask_h[None, :])
