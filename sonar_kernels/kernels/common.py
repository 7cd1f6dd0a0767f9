"""@triton.jit helpers shared by the grouped-GEMM kernels: dtype rounding, the tile schedule, the K loop.

``INTERPRET`` is a constexpr that the launchers set when the kernels run under the Triton interpreter
(``TRITON_INTERPRET=1``). The interpreter stores bf16 as uint16, so (docs/design.md, "Known pitfalls"):
arithmetic and ``tl.dot`` must see fp32 values, and its fp32 -> bf16 cast truncates instead of rounding
to nearest even. Under ``INTERPRET`` these helpers upcast before the dot and round bf16 by hand; on a
GPU they compile to the plain conversions and a bf16/fp16 ``tl.dot``.
"""

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Cast ``x`` to ``DTYPE`` with round-to-nearest-even (the GPU's cvt.rn), also under the interpreter."""
    if INTERPRET and tl.bfloat16 == DTYPE and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        # Round to nearest even on the 16 bits that stay; a NaN stays a (quiet) NaN.
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        hi = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def split_columns(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] -> its column halves [BLOCK_M, BLOCK_N // 2] (left, right)."""
    half: tl.constexpr = BLOCK_N // 2
    return tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, half)), (0, 2, 1)))


@triton.jit
def expert_tile(pid_m, tile_offsets_ptr, expert_offsets_ptr, E, BLOCK_M: tl.constexpr):
    """(expert, first row, end row) of grouped-GEMM row tile ``pid_m``; needs pid_m < tile_offsets[E].

    Tile m belongs to the expert e with tile_offsets[e] <= m < tile_offsets[e + 1] (binary search; an
    expert with no rows owns no tile). Its rows are [row_start, min(row_start + BLOCK_M, row_end)).
    """
    lo = 0
    hi = E
    # Invariant: tile_offsets[lo] <= pid_m < tile_offsets[hi].
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go_right = tl.load(tile_offsets_ptr + mid) <= pid_m
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    tile_in_expert = pid_m - tl.load(tile_offsets_ptr + lo)
    row_start = tl.load(expert_offsets_ptr + lo) + tile_in_expert * BLOCK_M
    row_end = tl.load(expert_offsets_ptr + lo + 1)
    return lo, row_start, row_end


@triton.jit
def grouped_mm_acc(
    acc,  # [BLOCK_M, BLOCK_N] fp32, added to
    a_ptr,
    a_rows,  # [BLOCK_M] int64 row indices into A (gathered rows allowed)
    mask_m,  # [BLOCK_M] bool
    stride_am,
    stride_ak,
    b_ptr,
    b_rows,  # [BLOCK_N] int64 row indices into B
    mask_n,  # [BLOCK_N] bool
    stride_bn,
    stride_bk,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """acc[m, n] + sum_k A[a_rows[m], k] * B[b_rows[n], k], fp32 accumulation; masked rows add 0.

    Operands are rounded to DOT_DTYPE in registers (fp32 master weights under bf16 compute are never
    copied to bf16 in memory). Returns [BLOCK_M, BLOCK_N] fp32.
    """
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + b_rows[None, :] * stride_bn + offs_k[:, None] * stride_bk  # [BLOCK_K, BLOCK_N]
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        a = round_to(a, DOT_DTYPE, INTERPRET)
        b = round_to(b, DOT_DTYPE, INTERPRET)
        if INTERPRET:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc
