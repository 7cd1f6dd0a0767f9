"""The overflow bound of an expert tensor's gradient, which decides whether the update's check pass runs
(docs/design.md, "Backward and the fused update"): one pass per layer step over the operands that bound every
updated tensor's gradient (:func:`bound_magnitudes_kernel`), then one single-program launch that reduces the
pass's partial maxima and computes the 0.0 / 1.0 flag of every expert tensor at every pair of limits an
update can meet (:func:`bound_table_kernel`); an update with the gradient of earlier micro-batches (or other
limits) takes its own single-program launch (:func:`bound_flag_kernel`). They replace some twenty torch ops
per update (``ops/triton_backend/update_bound.py``); the flag is the one the torch expression gives (``ops/arithmetic.py``,
``overflow_possible``), or 1.0 where that expression meets a NaN.

The layer's buffer (fp32): first the table, one flag per (entry limit, operand limit, expert tensor) every
FLAG_STRIDE elements (each flag 16-byte aligned, as the check pass's pointer is specialised), then one row of
COLUMNS partial maxima per program of the pass."""

import triton
import triton.language as tl

# The columns of the magnitudes (one row per program of the pass): largest |A|, largest |dHpre| (from the
# dHpre kernel's per-program maxima), largest |top_k_weights|, |dO|, |X|, the most rows of an expert.
COLUMNS = 6
# The table: ENTRY_LIMITS x OPERAND_LIMITS x EXPERT TENSORS (``ops/triton_backend/update_bound.py``; the tensors in
# ``specs.EXPERT_TENSORS``' order: gate_up_proj, down_proj, up_proj, gate_up_proj_bias, down_proj_bias), one
# fp32 flag every FLAG_STRIDE elements.
NUM_ENTRY_LIMITS = 3
NUM_OPERAND_LIMITS = 3
NUM_TENSORS = 5
FLAG_STRIDE = 4
TABLE = NUM_ENTRY_LIMITS * NUM_OPERAND_LIMITS * NUM_TENSORS * FLAG_STRIDE
# The same, as the kernels read them (a Triton kernel reads only constexpr globals).
_COLUMNS = tl.constexpr(COLUMNS)
_NUM_TENSORS = tl.constexpr(NUM_TENSORS)
_FLAG_STRIDE = tl.constexpr(FLAG_STRIDE)
_TABLE = tl.constexpr(TABLE)


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


# T, num_absmax and E only bound loops and masks: one build for every token and expert count (top_k
# and H keep their specialisation: the loads' vector width).
@triton.jit(do_not_specialize=("T", "num_absmax", "E"))
def bound_magnitudes_kernel(
    # pointers
    x_ptr,  # [T, H] fp32/bf16/fp16, read: the layer's input X
    grad_out_ptr,  # [T, H] X's dtype, read: dO (any strides, 0 included)
    weights_ptr,  # [T, top_k] fp32/bf16/fp16, read: the routing weights
    absmax_ptr,  # [num_absmax, 2] fp32, read: the dHpre kernel's per-program largest |A|, |dHpre| (NaN -> inf)
    offsets_ptr,  # [E + 1] int32, read: the expert offsets
    out_ptr,  # [TABLE + num_programs * COLUMNS] fp32, written past the table: each program's largest magnitudes
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
    """out[TABLE + pid * COLUMNS:][:COLUMNS] = (max |A|, max |dHpre|, max |top_k_weights|, max |dO|, max |X|, max rows of an expert) over
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
    out = out_ptr + _TABLE + pid.to(tl.int64) * _COLUMNS
    tl.store(out + cols2, a_largest.to(tl.float32, bitcast=True))
    tl.store(out + 2, _largest(w_bits))
    tl.store(out + 3, _largest(g_bits))
    tl.store(out + 4, _largest(x_bits))
    # Integers first, then one rounding to fp32: torch's amax(...).float() of the same counts.
    tl.store(out + 5, tl.max(most, axis=0).to(tl.float32))


@triton.jit
def _column_largest(magnitudes_ptr, num_rows, BLOCK_ROWS: tl.constexpr):
    """[8] fp32: the largest of each column of the pass's rows (past the table; columns 6 and 7 are 0)."""
    offs_r = tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, 8)
    largest = tl.zeros([BLOCK_ROWS, 8], dtype=tl.float32)
    for r0 in range(0, num_rows, BLOCK_ROWS):
        rows = r0 + offs_r
        mask = (rows < num_rows)[:, None] & (cols < _COLUMNS)[None, :]
        ptrs = magnitudes_ptr + _TABLE + rows[:, None] * _COLUMNS + cols[None, :]
        # magnitudes: >= 0, no NaN (a NaN was counted as inf)
        largest = tl.maximum(largest, tl.load(ptrs, mask=mask, other=0.0))
    return tl.max(largest, axis=0)


@triton.jit
def _pick(column, c: tl.constexpr):
    """Entry ``c`` of the [8] column maxima, as a scalar."""
    return tl.max(tl.where(tl.arange(0, 8) == c, column, 0.0), axis=0)


@triton.jit
def _flag(n, p, q, grad_in_max, entry_limit, operand_limit):
    """1.0 unless (total * 1.03 <= entry_limit) and (p * 1.01 <= operand_limit), total = n * p * q * (1 + n *
    2**-23) + grad_in_max: ``ops/arithmetic.py``'s ``overflow_possible`` in fp32, in torch's order."""
    total = n * p * q * (tl.full([], 1.0, tl.float32) + n * tl.full([], 1.1920928955078125e-07, tl.float32))
    total = total + grad_in_max
    safe = (total * tl.full([], 1.03, tl.float32) <= entry_limit) & (
        p * tl.full([], 1.01, tl.float32) <= operand_limit
    )
    return tl.where(safe, 0.0, 1.0)


@triton.jit
def _table_row(out_ptr, row: tl.constexpr, n, p_tokens, p_dhpre, q_a, q_x, entry_limit, operand_limit):
    """The flags of the five expert tensors at one pair of limits (specs.EXPERT_TENSORS' order): P is w * dO
    for the down projection and its bias, dHpre otherwise; Q is A, X, or 1 for a bias."""
    zero = tl.full([], 0.0, tl.float32)
    one = tl.full([], 1.0, tl.float32)
    base = out_ptr + row * _NUM_TENSORS * _FLAG_STRIDE
    tl.store(base, _flag(n, p_dhpre, q_x, zero, entry_limit, operand_limit))
    tl.store(base + _FLAG_STRIDE, _flag(n, p_tokens, q_a, zero, entry_limit, operand_limit))
    tl.store(base + 2 * _FLAG_STRIDE, _flag(n, p_dhpre, q_x, zero, entry_limit, operand_limit))
    tl.store(base + 3 * _FLAG_STRIDE, _flag(n, p_dhpre, one, zero, entry_limit, operand_limit))
    tl.store(base + 4 * _FLAG_STRIDE, _flag(n, p_tokens, one, zero, entry_limit, operand_limit))


@triton.jit(do_not_specialize=("num_rows",))  # a loop bound: one build for every count
def bound_table_kernel(
    # pointers
    magnitudes_ptr,  # [TABLE + num_rows * COLUMNS] fp32, read past the table, the table written
    # sizes
    num_rows,
    entry_limit_0: tl.float32,  # ops/triton_backend/update_bound.py's ENTRY_LIMITS (fp32 holds each exactly)
    entry_limit_1: tl.float32,
    entry_limit_2: tl.float32,
    operand_limit_0: tl.float32,  # ops/triton_backend/update_bound.py's OPERAND_LIMITS (the same)
    operand_limit_1: tl.float32,
    operand_limit_2: tl.float32,
    # meta-parameters
    BLOCK_ROWS: tl.constexpr,
):
    """table[(i * NUM_OPERAND_LIMITS + j) * NUM_TENSORS + k] = the flag of expert tensor k at entry limit i
    and operand limit j (:func:`bound_flag_kernel`'s, without grad_in), every FLAG_STRIDE elements.

    Grid: (1,). Launched without fp fusion (the expression's roundings are torch's).
    """
    column = _column_largest(magnitudes_ptr, num_rows, BLOCK_ROWS)
    n = _pick(column, 5)
    p_tokens = _pick(column, 2) * _pick(column, 3)
    p_dhpre = _pick(column, 1)
    q_a = _pick(column, 0)
    q_x = _pick(column, 4)
    _table_row(magnitudes_ptr, 0, n, p_tokens, p_dhpre, q_a, q_x, entry_limit_0, operand_limit_0)
    _table_row(magnitudes_ptr, 1, n, p_tokens, p_dhpre, q_a, q_x, entry_limit_0, operand_limit_1)
    _table_row(magnitudes_ptr, 2, n, p_tokens, p_dhpre, q_a, q_x, entry_limit_0, operand_limit_2)
    _table_row(magnitudes_ptr, 3, n, p_tokens, p_dhpre, q_a, q_x, entry_limit_1, operand_limit_0)
    _table_row(magnitudes_ptr, 4, n, p_tokens, p_dhpre, q_a, q_x, entry_limit_1, operand_limit_1)
    _table_row(magnitudes_ptr, 5, n, p_tokens, p_dhpre, q_a, q_x, entry_limit_1, operand_limit_2)
    _table_row(magnitudes_ptr, 6, n, p_tokens, p_dhpre, q_a, q_x, entry_limit_2, operand_limit_0)
    _table_row(magnitudes_ptr, 7, n, p_tokens, p_dhpre, q_a, q_x, entry_limit_2, operand_limit_1)
    _table_row(magnitudes_ptr, 8, n, p_tokens, p_dhpre, q_a, q_x, entry_limit_2, operand_limit_2)


@triton.jit
def bound_flag_kernel(
    # pointers
    magnitudes_ptr,  # [TABLE + num_rows * COLUMNS] fp32, read past the table: bound_magnitudes_kernel's rows
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
    2**-23) (+ max |grad_in|), in fp32 in torch's order (``ops/arithmetic.py``, ``overflow_possible``): n the most
    rows of an expert, p = max |w| * max |dO| (P_FROM_TOKENS) or max |dHpre|, q the column Q_COLUMN's largest
    (0: |A|, 4: |X|; -1: 1, a bias). The magnitudes count a NaN as inf, which gives 1.0 as the NaN would.

    Grid: (1,). Launched without fp fusion (the expression's roundings are torch's).
    """
    column = _column_largest(magnitudes_ptr, num_rows, BLOCK_ROWS)
    n = _pick(column, 5)
    p = _pick(column, 2) * _pick(column, 3) if P_FROM_TOKENS else _pick(column, 1)
    q = tl.full([], 1.0, tl.float32) if Q_COLUMN < 0 else _pick(column, Q_COLUMN)
    grad_in_max = tl.full([], 0.0, tl.float32)
    if HAS_GRAD_IN:
        grad_in_max = tl.load(grad_in_max_ptr)
    tl.store(flag_ptr, _flag(n, p, q, grad_in_max, entry_limit, operand_limit))
