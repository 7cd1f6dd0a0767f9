"""Backward kernels of the gated expert MLP's core: dHpre and the routing-weight gradient, and the reduction
of the routing-weight partial sums (the wgrad with its fused AdamW epilogue: ``expert_wgrad``).

Order of the backward (docs/design.md, "Backward and the fused update"); the dX rows reuse the forward's
grouped GEMM and combine kernels (``expert_mlp_fwd``):

1. ``expert_mlp_bwd_dhpre_kernel``: G = dO[token] @ W2[e] per row (reads W2 before its update), the
   partial sums of d w = <G, A>, A recomputed from the saved Hpre, dHpre from dA = w * G; then
   ``expert_mlp_bwd_dweights_kernel`` reduces the partial sums.
2. dX rows = dHpre @ W1[e] (reads W1 before its update), then dX[t] = sum_j of them, in j order.
3. ``expert_wgrad.expert_mlp_bwd_dw_kernel`` for W2: dW2[e] = sum_r (w_r dO[token_r])^T A_r, AdamW in the
   epilogue.
4. ``expert_wgrad.expert_mlp_bwd_dw_kernel`` for W1: dW1[e] = sum_r dHpre_r^T X[token_r], AdamW in the
   epilogue.
"""

import triton
import triton.language as tl

from sonar_kernels.kernels.common import expert_tile, grouped_mm_acc, round_to, split_columns
from sonar_kernels.kernels.expert_mlp_fwd import clamp_gate_up, gelu_tanh_inner, glu_fwd

# dHpre is a grouped GEMM over row tiles, like the forward. These are the default configurations (the only
# ones for fp32); the 16-bit tuning candidates are in sonar_kernels/ops/triton_backend/configs.py.
# EPILOGUE_SPLIT > 1: the rebuilt epilogue, in column slices (``_dhpre_slice``; docs/design.md, "dHpre in
# column slices"), a tuning candidate beside today's whole-tile epilogue.
DHPRE_CONFIG = {
    "BLOCK_M": 64,
    "BLOCK_N": 64,
    "BLOCK_K": 32,
    "EPILOGUE_SPLIT": 1,
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
def _magnitude(x, mask):
    """The bits of |x| as int32 for an fp32 tile where ``mask`` holds, 0 elsewhere: ordered as the
    magnitudes are, every NaN above inf (0x7F800000). The largest, through ``_bits_magnitude``, is exactly
    ``_absmax``'s value, in any order (two integer operations per element where ``_absmax`` takes four)."""
    return tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)


@triton.jit
def _bits_magnitude(bits):
    """fp32 of the largest ``_magnitude`` bits: inf for a NaN."""
    return tl.minimum(bits, 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _dhpre_slice(
    grad_proj,  # [BLOCK_M, SLICE_N] fp32: G at columns [col0, col0 + SLICE_N)
    w,  # [BLOCK_M] fp32 routing weights of the rows (0 where masked)
    rows,  # [BLOCK_M] int64
    mask_m,  # [BLOCK_M] bool
    col0,
    partial,  # the routing-weight partial sums' row this slice writes
    I,
    hpre_ptr, grad_hpre_ptr, a_ptr, dw_partial_ptr,
    stride_hs, stride_hn, stride_gs, stride_gn, stride_as, stride_an, stride_dwp,
    alpha, limit,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, SLICE_N: tl.constexpr, STORE_GRAD_HPRE: tl.constexpr,
    STORE_A: tl.constexpr, COMPUTE_DW: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One column slice of dHpre's epilogue, the same operations on the same values as the whole-tile
    epilogue of ``expert_mlp_bwd_dhpre_kernel``: A recomputed and stored, the routing-weight partial sum of
    the slice's columns written to row ``partial``, dHpre stored. Returns the elementwise magnitudes
    (``_magnitude``) of A and of dHpre (the larger of gate and up), [BLOCK_M, SLICE_N] int32 each."""
    dtype = hpre_ptr.dtype.element_ty
    cols = (col0 + tl.arange(0, SLICE_N)).to(tl.int64)
    mask = mask_m[:, None] & (cols < I)[None, :]
    h_ptrs = hpre_ptr + rows[:, None] * stride_hs + cols[None, :] * stride_hn
    gate = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptrs + I * stride_hn, mask=mask, other=0.0).to(tl.float32) if GATED else gate
    a = round_to(glu_fwd(gate, up, ACTIVATION, alpha, limit, GATED), dtype, INTERPRET)
    if STORE_A:
        tl.store(a_ptr + rows[:, None] * stride_as + cols[None, :] * stride_an, a, mask=mask)
    if COMPUTE_DW:
        sums = tl.sum(tl.where(mask, grad_proj * a.to(tl.float32), 0.0), axis=1)  # [BLOCK_M]
        tl.store(dw_partial_ptr + partial.to(tl.int64) * stride_dwp + rows, sums, mask=mask_m)
    largest_a = _magnitude(a.to(tl.float32), mask)
    largest_g = tl.zeros_like(largest_a)
    if STORE_GRAD_HPRE:
        grad_a = round_to(w[:, None] * grad_proj, dtype, INTERPRET).to(tl.float32)
        grad_gate, grad_up = _glu_bwd(gate, up, grad_a, ACTIVATION, alpha, limit, GATED)
        grad_gate = round_to(grad_gate, dtype, INTERPRET)
        g_ptrs = grad_hpre_ptr + rows[:, None] * stride_gs + cols[None, :] * stride_gn
        tl.store(g_ptrs, grad_gate, mask=mask)
        largest_g = _magnitude(grad_gate.to(tl.float32), mask)
        if GATED:
            grad_up = round_to(grad_up, dtype, INTERPRET)
            tl.store(g_ptrs + I * stride_gn, grad_up, mask=mask)
            largest_g = tl.maximum(largest_g, _magnitude(grad_up.to(tl.float32), mask))
    return largest_a, largest_g


@triton.jit(do_not_specialize=("E",))  # E only bounds loops and masks: one build for every expert count
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
    EPILOGUE_SPLIT: tl.constexpr,
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
    EPILOGUE_SPLIT 1: the whole tile's epilogue at once; 2 or 4: in that many column slices of BLOCK_N /
    EPILOGUE_SPLIT (``_dhpre_slice``: fewer values live at once, the magnitudes reduced once per tile),
    the partial sums of slice s written to row pid_n * EPILOGUE_SPLIT + s (as the whole-tile epilogue at
    BLOCK_N / EPILOGUE_SPLIT writes them: the same bits; docs/design.md, "dHpre in column slices").
    Grid: (row tiles * cdiv(I, BLOCK_N),).
    Preconditions: tile_offsets for row tiles of BLOCK_M rows (ops.common.tile_offsets_for); dw_partial has
    cdiv(I, BLOCK_N) * EPILOGUE_SPLIT rows.
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
    if EPILOGUE_SPLIT > 1:
        _dhpre_sliced_epilogue(
            grad_proj, rows, mask_m, pid, pid_n, I, top_k, hpre_ptr, weights_ptr, slot_of_row_ptr, grad_hpre_ptr,
            a_ptr, dw_partial_ptr, absmax_ptr, stride_hs, stride_hn, stride_wt, stride_wj, stride_gs, stride_gn,
            stride_as, stride_an, stride_dwp, alpha, limit, ACTIVATION, GATED, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT,
            STORE_GRAD_HPRE, STORE_A, COMPUTE_DW, HAS_ABSMAX, INTERPRET,
        )  # fmt: skip
        return

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
def _dhpre_sliced_epilogue(
    grad_proj, rows, mask_m, pid, pid_n, I, top_k,
    hpre_ptr, weights_ptr, slot_of_row_ptr, grad_hpre_ptr, a_ptr, dw_partial_ptr, absmax_ptr,
    stride_hs, stride_hn, stride_wt, stride_wj, stride_gs, stride_gn, stride_as, stride_an, stride_dwp,
    alpha, limit,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr, STORE_GRAD_HPRE: tl.constexpr, STORE_A: tl.constexpr, COMPUTE_DW: tl.constexpr,
    HAS_ABSMAX: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """dHpre's epilogue in EPILOGUE_SPLIT (2 or 4) column slices of G (``_dhpre_slice``), the routing
    weights loaded once, the magnitudes of the slices kept elementwise and reduced once."""
    tl.static_assert(EPILOGUE_SPLIT == 2 or EPILOGUE_SPLIT == 4, "EPILOGUE_SPLIT must be 1, 2 or 4")
    w = tl.zeros((BLOCK_M,), tl.float32)
    if STORE_GRAD_HPRE:
        slots = tl.load(slot_of_row_ptr + rows, mask=mask_m, other=0)
        w = tl.load(
            weights_ptr + (slots // top_k).to(tl.int64) * stride_wt + (slots % top_k) * stride_wj,
            mask=mask_m,
            other=0.0,
        ).to(tl.float32)
    SLICE_N: tl.constexpr = BLOCK_N // EPILOGUE_SPLIT
    col0 = pid_n * BLOCK_N
    part = pid_n * EPILOGUE_SPLIT
    left, right = split_columns(grad_proj, BLOCK_M, BLOCK_N)
    if EPILOGUE_SPLIT == 2:
        big_a, big_g = _dhpre_slice(
            left, w, rows, mask_m, col0, part, I, hpre_ptr, grad_hpre_ptr, a_ptr, dw_partial_ptr,
            stride_hs, stride_hn, stride_gs, stride_gn, stride_as, stride_an, stride_dwp, alpha, limit,
            ACTIVATION, GATED, SLICE_N, STORE_GRAD_HPRE, STORE_A, COMPUTE_DW, INTERPRET,
        )  # fmt: skip
        more_a, more_g = _dhpre_slice(
            right, w, rows, mask_m, col0 + SLICE_N, part + 1, I, hpre_ptr, grad_hpre_ptr, a_ptr, dw_partial_ptr,
            stride_hs, stride_hn, stride_gs, stride_gn, stride_as, stride_an, stride_dwp, alpha, limit,
            ACTIVATION, GATED, SLICE_N, STORE_GRAD_HPRE, STORE_A, COMPUTE_DW, INTERPRET,
        )  # fmt: skip
        big_a = tl.maximum(big_a, more_a)
        big_g = tl.maximum(big_g, more_g)
    else:
        q0, q1 = split_columns(left, BLOCK_M, BLOCK_N // 2)
        big_a, big_g = _dhpre_slice(
            q0, w, rows, mask_m, col0, part, I, hpre_ptr, grad_hpre_ptr, a_ptr, dw_partial_ptr,
            stride_hs, stride_hn, stride_gs, stride_gn, stride_as, stride_an, stride_dwp, alpha, limit,
            ACTIVATION, GATED, SLICE_N, STORE_GRAD_HPRE, STORE_A, COMPUTE_DW, INTERPRET,
        )  # fmt: skip
        more_a, more_g = _dhpre_slice(
            q1, w, rows, mask_m, col0 + SLICE_N, part + 1, I, hpre_ptr, grad_hpre_ptr, a_ptr, dw_partial_ptr,
            stride_hs, stride_hn, stride_gs, stride_gn, stride_as, stride_an, stride_dwp, alpha, limit,
            ACTIVATION, GATED, SLICE_N, STORE_GRAD_HPRE, STORE_A, COMPUTE_DW, INTERPRET,
        )  # fmt: skip
        big_a = tl.maximum(big_a, more_a)
        big_g = tl.maximum(big_g, more_g)
        q2, q3 = split_columns(right, BLOCK_M, BLOCK_N // 2)
        more_a, more_g = _dhpre_slice(
            q2, w, rows, mask_m, col0 + 2 * SLICE_N, part + 2, I, hpre_ptr, grad_hpre_ptr, a_ptr, dw_partial_ptr,
            stride_hs, stride_hn, stride_gs, stride_gn, stride_as, stride_an, stride_dwp, alpha, limit,
            ACTIVATION, GATED, SLICE_N, STORE_GRAD_HPRE, STORE_A, COMPUTE_DW, INTERPRET,
        )  # fmt: skip
        big_a = tl.maximum(big_a, more_a)
        big_g = tl.maximum(big_g, more_g)
        more_a, more_g = _dhpre_slice(
            q3, w, rows, mask_m, col0 + 3 * SLICE_N, part + 3, I, hpre_ptr, grad_hpre_ptr, a_ptr, dw_partial_ptr,
            stride_hs, stride_hn, stride_gs, stride_gn, stride_as, stride_an, stride_dwp, alpha, limit,
            ACTIVATION, GATED, SLICE_N, STORE_GRAD_HPRE, STORE_A, COMPUTE_DW, INTERPRET,
        )  # fmt: skip
        big_a = tl.maximum(big_a, more_a)
        big_g = tl.maximum(big_g, more_g)
    if HAS_ABSMAX:
        tl.store(absmax_ptr + 2 * pid, _bits_magnitude(tl.max(big_a)))
        tl.store(absmax_ptr + 2 * pid + 1, _bits_magnitude(tl.max(big_g)))


@triton.jit(do_not_specialize=("num_partials",))  # a loop bound: one build for every count
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
