"""The column slices of the wgrad kernel's epilogue (``kernels/expert_wgrad.py``): a slice's element offsets,
its gradient, and the prefetched "adamw" epilogues, which issue one slice's loads of the weight and its
state before the previous slice's math and stores (exact moments: ``kernels/adamw.py``; 8-bit moments:
``kernels/moments_8bit.py``; docs/design.md, "Backward and the fused update").
"""

import triton
import triton.language as tl

from sonar_kernels.kernels.adamw import adamw_tile_load, adamw_tile_store
from sonar_kernels.kernels.common import round_to, split_columns
from sonar_kernels.kernels.moments_8bit import BLOCK as MOMENTS_BLOCK
from sonar_kernels.kernels.moments_8bit import adamw_8bit_tile_load, adamw_8bit_tile_store


@triton.jit
def slice_offsets(offs_m, m_offsets, col0, M, N, stride_n, SLICE_N: tl.constexpr):
    """The element offsets [BLOCK_M, SLICE_N] (int64) of columns [col0, col0 + SLICE_N) of the tile's rows, and
    their mask."""
    offs_n = (col0 + tl.arange(0, SLICE_N)).to(tl.int64)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    return m_offsets[:, None] + offs_n[None, :] * stride_n, mask


@triton.jit
def slice_gradient(
    acc, offs, mask, grad_in_ptr, GRAD_DTYPE: tl.constexpr, HAS_GRAD_IN: tl.constexpr, INTERPRET: tl.constexpr
):  # fmt: skip
    """A slice's gradient in GRAD_DTYPE: the fp32 accumulator rounded, plus with HAS_GRAD_IN the gradient of
    earlier micro-batches at ``offs``, as autograd adds a new gradient to ``.grad``: round(previous +
    round(acc))."""
    grad = round_to(acc, GRAD_DTYPE, INTERPRET)
    if HAS_GRAD_IN:
        previous = tl.load(grad_in_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        grad = round_to(previous + grad.to(tl.float32), GRAD_DTYPE, INTERPRET)
    return grad


@triton.jit
def dw_adamw_slice(
    acc, p, m, v, offs, mask, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_size, bc2_sqrt, hyper_ptr,
    remainder_ptr, rng_ptr, base, GRAD_DTYPE: tl.constexpr, HAS_GRAD_IN: tl.constexpr, HAS_NORM: tl.constexpr,
    ARITHMETIC: tl.constexpr, REMAINDER: tl.constexpr, STOCHASTIC: tl.constexpr, CLIP: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """The "adamw" epilogue of ``expert_wgrad._dw_epilogue_slice`` for a slice whose state (``p``, ``m``, ``v``:
    ``adamw_tile_load``'s) was loaded before: the same arithmetic, the same bits; returns (the slice's sum
    of squared gradient entries when HAS_NORM, else 0; the spike rule's count)."""
    grad32 = slice_gradient(acc, offs, mask, grad_in_ptr, GRAD_DTYPE, HAS_GRAD_IN, INTERPRET).to(tl.float32)
    result = 0.0
    if HAS_NORM:
        result = tl.sum(tl.where(mask, grad32 * grad32, 0.0))
    clipped = adamw_tile_store(
        grad32, p, m, v, offs, mask, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, remainder_ptr, rng_ptr, base + offs,
        step_size, bc2_sqrt, hyper_ptr, ARITHMETIC, REMAINDER, STOCHASTIC, CLIP, GRAD_DTYPE, INTERPRET,
    )  # fmt: skip
    return result, clipped


@triton.jit
def dw_epilogue_prefetched(
    acc, offs_m, m_offsets, col0, M, N, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, stride_n, step_size,
    bc2_sqrt, hyper_ptr, remainder_ptr, rng_ptr, base, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr, GRAD_DTYPE: tl.constexpr, HAS_GRAD_IN: tl.constexpr, HAS_NORM: tl.constexpr,
    ARITHMETIC: tl.constexpr, REMAINDER: tl.constexpr, STOCHASTIC: tl.constexpr, CLIP: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """The "adamw" epilogue in EPILOGUE_SPLIT (2 or 4) column slices, each slice's W, exp_avg and exp_avg_sq
    loaded before the previous slice's math and stores (EPILOGUE_PREFETCH): the compiler cannot move a load
    above a store to memory that may alias, so ``expert_wgrad._dw_epilogue_slice`` waits for each slice's loads after
    the previous slice's stores; here one slice's loads are in flight while another is computed. The same
    arithmetic per element and the same fixed order of the slices' sums; returns (sum of squares, count)."""
    tl.static_assert(EPILOGUE_SPLIT == 2 or EPILOGUE_SPLIT == 4, "a prefetched epilogue has 2 or 4 slices")
    left, right = split_columns(acc, BLOCK_M, BLOCK_N)
    if EPILOGUE_SPLIT == 2:
        half: tl.constexpr = BLOCK_N // 2
        o0, k0 = slice_offsets(offs_m, m_offsets, col0, M, N, stride_n, half)
        p0, m0, v0 = adamw_tile_load(
            o0, k0, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, remainder_ptr, REMAINDER, STOCHASTIC
        )
        o1, k1 = slice_offsets(offs_m, m_offsets, col0 + half, M, N, stride_n, half)
        p1, m1, v1 = adamw_tile_load(
            o1, k1, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, remainder_ptr, REMAINDER, STOCHASTIC
        )
        total, clipped = dw_adamw_slice(
            left, p0, m0, v0, o0, k0, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_size, bc2_sqrt, hyper_ptr,
            remainder_ptr, rng_ptr, base, GRAD_DTYPE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, REMAINDER, STOCHASTIC, CLIP,
            INTERPRET,
        )  # fmt: skip
        more, more_clipped = dw_adamw_slice(
            right, p1, m1, v1, o1, k1, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_size, bc2_sqrt, hyper_ptr,
            remainder_ptr, rng_ptr, base, GRAD_DTYPE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, REMAINDER, STOCHASTIC, CLIP,
            INTERPRET,
        )  # fmt: skip
        total += more
        clipped += more_clipped
    else:
        half: tl.constexpr = BLOCK_N // 2
        quarter: tl.constexpr = BLOCK_N // 4
        q0, q1 = split_columns(left, BLOCK_M, half)
        q2, q3 = split_columns(right, BLOCK_M, half)
        o0, k0 = slice_offsets(offs_m, m_offsets, col0, M, N, stride_n, quarter)
        p0, m0, v0 = adamw_tile_load(
            o0, k0, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, remainder_ptr, REMAINDER, STOCHASTIC
        )
        o1, k1 = slice_offsets(offs_m, m_offsets, col0 + quarter, M, N, stride_n, quarter)
        p1, m1, v1 = adamw_tile_load(
            o1, k1, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, remainder_ptr, REMAINDER, STOCHASTIC
        )
        total, clipped = dw_adamw_slice(
            q0, p0, m0, v0, o0, k0, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_size, bc2_sqrt, hyper_ptr,
            remainder_ptr, rng_ptr, base, GRAD_DTYPE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, REMAINDER, STOCHASTIC, CLIP,
            INTERPRET,
        )  # fmt: skip
        o2, k2 = slice_offsets(offs_m, m_offsets, col0 + half, M, N, stride_n, quarter)
        p2, m2, v2 = adamw_tile_load(
            o2, k2, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, remainder_ptr, REMAINDER, STOCHASTIC
        )
        more, more_clipped = dw_adamw_slice(
            q1, p1, m1, v1, o1, k1, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_size, bc2_sqrt, hyper_ptr,
            remainder_ptr, rng_ptr, base, GRAD_DTYPE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, REMAINDER, STOCHASTIC, CLIP,
            INTERPRET,
        )  # fmt: skip
        total += more
        clipped += more_clipped
        o3, k3 = slice_offsets(offs_m, m_offsets, col0 + half + quarter, M, N, stride_n, quarter)
        p3, m3, v3 = adamw_tile_load(
            o3, k3, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, remainder_ptr, REMAINDER, STOCHASTIC
        )
        more, more_clipped = dw_adamw_slice(
            q2, p2, m2, v2, o2, k2, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_size, bc2_sqrt, hyper_ptr,
            remainder_ptr, rng_ptr, base, GRAD_DTYPE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, REMAINDER, STOCHASTIC, CLIP,
            INTERPRET,
        )  # fmt: skip
        total += more
        clipped += more_clipped
        more, more_clipped = dw_adamw_slice(
            q3, p3, m3, v3, o3, k3, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_size, bc2_sqrt, hyper_ptr,
            remainder_ptr, rng_ptr, base, GRAD_DTYPE, HAS_GRAD_IN, HAS_NORM, ARITHMETIC, REMAINDER, STOCHASTIC, CLIP,
            INTERPRET,
        )  # fmt: skip
        total += more
        clipped += more_clipped
    return total, clipped


@triton.jit
def scale_offsets(offs_m, m_soffsets, col0, M, N, SLICE_N: tl.constexpr):
    """The offsets (int64) and mask [BLOCK_M, SLICE_N / 32] of the 8-bit moments' scales of columns
    [col0, col0 + SLICE_N): whole blocks of the contiguous dimension (the launcher checks stride_n == 1 and
    SLICE_N % 32 == 0)."""
    tl.static_assert((SLICE_N // MOMENTS_BLOCK) * MOMENTS_BLOCK == SLICE_N, "slices of whole blocks")
    offs_b = (col0 // MOMENTS_BLOCK + tl.arange(0, SLICE_N // MOMENTS_BLOCK)).to(tl.int64)
    mask = (offs_m < M)[:, None] & (offs_b * MOMENTS_BLOCK < N)[None, :]
    return m_soffsets[:, None] + offs_b[None, :], mask


@triton.jit
def dw_8bit_slice(
    acc, state, offs, mask, scale_offs, scale_mask, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr,
    exp_avg_scales_ptr, exp_avg_sq_scales_ptr, tables_ptr, remainder_ptr, rng_ptr, base, step_size, bc2_sqrt,
    hyper_ptr, BLOCK_M: tl.constexpr, SLICE_N: tl.constexpr, GRAD_DTYPE: tl.constexpr, HAS_GRAD_IN: tl.constexpr,
    HAS_NORM: tl.constexpr, REMAINDER: tl.constexpr, STOCHASTIC: tl.constexpr, CLIP: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """The 8-bit "adamw" epilogue of ``expert_wgrad._dw_epilogue_slice`` for a slice whose W, codes and scales
    (``state``: ``adamw_8bit_tile_load``'s) were loaded before, requantized by the closed-form quantizer
    (``moments_8bit.quantize_tile``): the same arithmetic, the same bits; returns (the slice's sum of squared
    gradient entries when HAS_NORM, else 0; the spike rule's count)."""
    grad32 = slice_gradient(acc, offs, mask, grad_in_ptr, GRAD_DTYPE, HAS_GRAD_IN, INTERPRET).to(tl.float32)
    result = 0.0
    if HAS_NORM:
        result = tl.sum(tl.where(mask, grad32 * grad32, 0.0))
    clipped = adamw_8bit_tile_store(
        grad32, state, offs, mask, scale_offs, scale_mask, w_ptr, exp_avg_ptr, exp_avg_scales_ptr, exp_avg_sq_ptr,
        exp_avg_sq_scales_ptr, tables_ptr, tables_ptr + 128, remainder_ptr, rng_ptr, base + offs, step_size,
        bc2_sqrt, hyper_ptr, BLOCK_M, SLICE_N, REMAINDER, STOCHASTIC, CLIP, GRAD_DTYPE, INTERPRET, True,
    )  # fmt: skip
    return result, clipped


@triton.jit
def dw_8bit_prefetched(
    acc, offs_m, m_offsets, m_soffsets, col0, M, N, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr,
    exp_avg_scales_ptr, exp_avg_sq_scales_ptr, tables_ptr, stride_n, step_size, bc2_sqrt, hyper_ptr, remainder_ptr,
    rng_ptr, base, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GRAD_DTYPE: tl.constexpr,
    HAS_GRAD_IN: tl.constexpr, HAS_NORM: tl.constexpr, REMAINDER: tl.constexpr, STOCHASTIC: tl.constexpr,
    CLIP: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The 8-bit "adamw" epilogue rebuilt (EPILOGUE_PREFETCH): 2 column slices, the right slice's W, codes
    and scales loaded before the left slice's math and stores (as :func:`dw_epilogue_prefetched` for exact
    moments), the codes found in closed form instead of by a binary search of gathers. The same arithmetic
    per element, the same codes, the same order of the slices' sums; returns (sum of squares, count)."""
    half: tl.constexpr = BLOCK_N // 2
    left, right = split_columns(acc, BLOCK_M, BLOCK_N)
    o0, k0 = slice_offsets(offs_m, m_offsets, col0, M, N, stride_n, half)
    s0, j0 = scale_offsets(offs_m, m_soffsets, col0, M, N, half)
    state0 = adamw_8bit_tile_load(
        o0, k0, s0, j0, w_ptr, exp_avg_ptr, exp_avg_scales_ptr, exp_avg_sq_ptr, exp_avg_sq_scales_ptr, remainder_ptr,
        REMAINDER, STOCHASTIC,
    )  # fmt: skip
    o1, k1 = slice_offsets(offs_m, m_offsets, col0 + half, M, N, stride_n, half)
    s1, j1 = scale_offsets(offs_m, m_soffsets, col0 + half, M, N, half)
    state1 = adamw_8bit_tile_load(
        o1, k1, s1, j1, w_ptr, exp_avg_ptr, exp_avg_scales_ptr, exp_avg_sq_ptr, exp_avg_sq_scales_ptr, remainder_ptr,
        REMAINDER, STOCHASTIC,
    )  # fmt: skip
    total, clipped = dw_8bit_slice(
        left, state0, o0, k0, s0, j0, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, exp_avg_scales_ptr,
        exp_avg_sq_scales_ptr, tables_ptr, remainder_ptr, rng_ptr, base, step_size, bc2_sqrt, hyper_ptr, BLOCK_M,
        half, GRAD_DTYPE, HAS_GRAD_IN, HAS_NORM, REMAINDER, STOCHASTIC, CLIP, INTERPRET,
    )  # fmt: skip
    more, more_clipped = dw_8bit_slice(
        right, state1, o1, k1, s1, j1, grad_in_ptr, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, exp_avg_scales_ptr,
        exp_avg_sq_scales_ptr, tables_ptr, remainder_ptr, rng_ptr, base, step_size, bc2_sqrt, hyper_ptr, BLOCK_M,
        half, GRAD_DTYPE, HAS_GRAD_IN, HAS_NORM, REMAINDER, STOCHASTIC, CLIP, INTERPRET,
    )  # fmt: skip
    return total + more, clipped + more_clipped
