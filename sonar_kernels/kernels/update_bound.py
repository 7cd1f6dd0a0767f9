"""The overflow bound of an expert tensor's gradient, which decides whether the update's check pass runs
(docs/design.md, "Backward and the fused update"): one pass per layer step over the operands that bound every
updated tensor's gradient (:func:`bound_magnitudes_kernel`), then one single-program launch per update that
reduces the pass's partial maxima and computes its 0.0 / 1.0 flag (:func:`bound_flag_kernel`). They replace
some twenty torch ops per update (``ops/update_bound.py``); the flag is the one the torch expression gives
(``ops/adamw.py``, ``overflow_possible``), or 1.0 where that expression meets a NaN."""

import triton
import triton.language as tl

# The columns of the magnitudes (one row per program of the pass): largest |A|, largest |dHpre| (from the
# dHpre kernel's per-program maxima), largest |top_k_weights|, |dO|, |X|, the most rows of an expert.
COLUMNS = 6


@triton.jit
def _bits_max(bits, ptrs, mask):
    """``bits`` (int32 tile) raised elementwise to the magnitude bits of the fp32 values at ``ptrs``: |x|'s
    bits order as |x| does, every NaN above inf (0x7F800000); 0 where ``mask`` is off."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return tl.maximum(bits, tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0))


@triton.jit
def _largest(bits):
    """fp32 of the largest magnitude bits of a tile: inf for a NaN, 0 for an empty tile."""
    return tl.minimum(tl.max(tl.max(bits, axis=1), axis=0), 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def bound_magnitudes_kernel(
    # pointers
    x_ptr,  # [T, H] fp32/bf16/fp16, read: the layer's input X
    grad_out_ptr,  # [T, H] X's dtype, read: dO (any strides, 0 included)
    weights_ptr,  # [T, top_k] fp32/bf16/fp16, read: the routing weights
    absmax_ptr,  # [num_absmax, 2] fp32, read: the dHpre kernel's per-program largest |A|, |dHpre| (NaN -> inf)
    offsets_ptr,  # [E + 1] int32, read: the expert offsets
    out_ptr,  # [num_programs, COLUMNS] fp32, written: each program's largest magnitudes (NaN -> inf)
    # sizes
    T,
    H,
    top_k,
    num_absmax,
    E,
    # strides
    stride_xt,
    stride_xh,
    stride_gt,
    stride_gh,
    stride_wt,
    stride_wj,
    # meta-parameters
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """out[pid] = (max |A|, max |dHpre|, max |top_k_weights|, max |dO|, max |X|, max rows of an expert) over
    this program's share: the row blocks pid, pid + grid, ... of X, dO and the weights, the same stride over
    the dHpre kernel's maxima and over the experts. A NaN counts as inf; an empty share gives 0.

    Grid: (num_programs,), any number >= 1 (the largest of the rows is the same whatever it is).
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs_t = tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, BLOCK_J)
    x_bits = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.int32)
    g_bits = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.int32)
    w_bits = tl.zeros([BLOCK_T, BLOCK_J], dtype=tl.int32)
    for t0 in range(pid * BLOCK_T, T, programs * BLOCK_T):
        rows = (t0 + offs_t).to(tl.int64)
        mask_t = rows < T
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + offs_h
            mask = mask_t[:, None] & (cols < H)[None, :]
            x_ptrs = x_ptr + rows[:, None] * stride_xt + cols[None, :] * stride_xh
            x_bits = _bits_max(x_bits, x_ptrs, mask)
            g_ptrs = grad_out_ptr + rows[:, None] * stride_gt + cols[None, :] * stride_gh
            g_bits = _bits_max(g_bits, g_ptrs, mask)
        w_ptrs = weights_ptr + rows[:, None] * stride_wt + offs_j[None, :] * stride_wj
        w_bits = _bits_max(w_bits, w_ptrs, mask_t[:, None] & (offs_j < top_k)[None, :])
    offs_a = tl.arange(0, BLOCK_A)
    cols2 = tl.arange(0, 2)
    a_bits = tl.zeros([BLOCK_A, 2], dtype=tl.int32)
    for a0 in range(pid * BLOCK_A, num_absmax, programs * BLOCK_A):
        rows_a = a0 + offs_a
        a_ptrs = absmax_ptr + rows_a[:, None] * 2 + cols2[None, :]
        a_bits = _bits_max(a_bits, a_ptrs, (rows_a < num_absmax)[:, None] & (cols2 < 2)[None, :])
    # [2]: the largest |A| and |dHpre| bits of the share (already magnitudes, inf for a NaN)
    a_largest = tl.max(a_bits, axis=0)
    offs_e = tl.arange(0, BLOCK_E)
    most = tl.zeros([BLOCK_E], dtype=tl.int32)
    for e0 in range(pid * BLOCK_E, E, programs * BLOCK_E):
        experts = e0 + offs_e
        mask_e = experts < E
        low = tl.load(offsets_ptr + experts, mask=mask_e, other=0)
        high = tl.load(offsets_ptr + experts + 1, mask=mask_e, other=0)
        most = tl.maximum(most, high - low)
    out = out_ptr + pid.to(tl.int64) * 6
    tl.store(out + cols2, a_largest.to(tl.float32, bitcast=True))
    tl.store(out + 2, _largest(w_bits))
    tl.store(out + 3, _largest(g_bits))
    tl.store(out + 4, _largest(x_bits))
    # Integers first, then one rounding to fp32: torch's amax(...).float() of the same counts.
    tl.store(out + 5, tl.max(most, axis=0).to(tl.float32))


@triton.jit
def bound_flag_kernel(
    # pointers
    magnitudes_ptr,  # [num_rows, COLUMNS] fp32, read: bound_magnitudes_kernel's rows
    grad_in_max_ptr,  # [] fp32, read with HAS_GRAD_IN: max |grad_in| (NaN when it holds one)
    flag_ptr,  # [] fp32, written: 1.0 when the gradient may exceed the limits, else 0.0
    # sizes
    num_rows,
    entry_limit: tl.float32,  # the largest gradient entry the update takes (fp32 holds it exactly)
    operand_limit: tl.float32,  # the largest magnitude of the GEMM operands' dtype (the same)
    # meta-parameters
    P_FROM_TOKENS: tl.constexpr,
    Q_COLUMN: tl.constexpr,
    HAS_GRAD_IN: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """flag = not((total * 1.03 <= entry_limit) and (p * 1.01 <= operand_limit)), total = n * p * q * (1 + n *
    2**-23) (+ max |grad_in|), in fp32 in torch's order (``ops/adamw.py``, ``overflow_possible``): n the most
    rows of an expert, p = max |w| * max |dO| (P_FROM_TOKENS) or max |dHpre|, q the column Q_COLUMN's largest
    (0: |A|, 4: |X|; -1: 1, a bias). The magnitudes count a NaN as inf, which gives 1.0 as the NaN would.

    Grid: (1,). Launched without fp fusion (the expression's roundings are torch's).
    """
    offs_r = tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, 8)
    largest = tl.zeros([BLOCK_ROWS, 8], dtype=tl.float32)
    for r0 in range(0, num_rows, BLOCK_ROWS):
        rows = r0 + offs_r
        mask = (rows < num_rows)[:, None] & (cols < 6)[None, :]
        m = tl.load(magnitudes_ptr + rows[:, None] * 6 + cols[None, :], mask=mask, other=0.0)
        largest = tl.maximum(largest, m)
    # [8]: the largest of each column (magnitudes: >= 0, no NaN)
    column = tl.max(largest, axis=0)
    n = tl.max(tl.where(cols == 5, column, 0.0), axis=0)
    if P_FROM_TOKENS:
        p = tl.max(tl.where(cols == 2, column, 0.0), axis=0) * tl.max(
            tl.where(cols == 3, column, 0.0), axis=0
        )
    else:
        p = tl.max(tl.where(cols == 1, column, 0.0), axis=0)
    if Q_COLUMN < 0:
        q = tl.full([], 1.0, tl.float32)
    else:
        q = tl.max(tl.where(cols == Q_COLUMN, column, 0.0), axis=0)
    total = n * p * q * (tl.full([], 1.0, tl.float32) + n * tl.full([], 1.1920928955078125e-07, tl.float32))
    if HAS_GRAD_IN:
        total = total + tl.load(grad_in_max_ptr)
    safe = (total * tl.full([], 1.03, tl.float32) <= entry_limit) & (
        p * tl.full([], 1.01, tl.float32) <= operand_limit
    )
    tl.store(flag_ptr, tl.where(safe, 0.0, 1.0))
