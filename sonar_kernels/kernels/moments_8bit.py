"""AdamW with 8-bit moments in registers: dequantize, update, requantize (docs/design.md, "8-bit moments").

The scheme is ``sonar_kernels/rules/moments_8bit.py``'s, operation for operation: blocks of :data:`BLOCK`
consecutive elements along a tile's columns (the weight's contiguous dimension), one fp32 scale per block
(its largest magnitude), codes into the tables that ``rules/moments_8bit.py`` builds (exp_avg: int8
``sign * k`` into 128 magnitudes; exp_avg_sq: uint8 into 256 levels), the nearest entry with exact ties
to the smaller magnitude, and AdamW in the "fp64" arithmetic of ``kernels/adamw.py``. A tile's columns are
whole blocks (the launchers check it), so a block's scale is known in registers.
"""

import numpy as np
import triton
import triton.language as tl

from sonar_kernels.kernels.adamw import _adamw_math, clip_tile
from sonar_kernels.kernels.master_weights import load_weight, store_weight

BLOCK: tl.constexpr = tl.constexpr(32)
ADAMW_8BIT_CONFIG = {"BLOCK_R": 16, "BLOCK_C": 64, "num_warps": 4}
# The closed-form quantizer's thresholds (rules/moments_8bit.py, quantize_blocks): fp32(2 ** (r / 8)) for
# r = 1 .. 7, each a constexpr (a compiled kernel reads no Python list).
EIGHTH_1: tl.constexpr = tl.constexpr(float(np.float32(2.0 ** (1 / 8))))
EIGHTH_2: tl.constexpr = tl.constexpr(float(np.float32(2.0 ** (2 / 8))))
EIGHTH_3: tl.constexpr = tl.constexpr(float(np.float32(2.0 ** (3 / 8))))
EIGHTH_4: tl.constexpr = tl.constexpr(float(np.float32(2.0 ** (4 / 8))))
EIGHTH_5: tl.constexpr = tl.constexpr(float(np.float32(2.0 ** (5 / 8))))
EIGHTH_6: tl.constexpr = tl.constexpr(float(np.float32(2.0 ** (6 / 8))))
EIGHTH_7: tl.constexpr = tl.constexpr(float(np.float32(2.0 ** (7 / 8))))


@triton.jit
def _to_blocks(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] -> [ROWS, COLS // BLOCK, BLOCK]."""
    return tl.reshape(x, (ROWS, COLS // BLOCK, BLOCK))


@triton.jit
def dequantize_tile(codes, scales, table_ptr, SIGNED: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """fp32 values of ``codes`` [ROWS, COLS] with their block ``scales`` [ROWS, COLS // BLOCK]: one fp32
    product ``table[code] * scale``, the sign of a signed code applied exactly."""
    index = codes.to(tl.int32)
    if SIGNED:
        magnitude = tl.load(table_ptr + tl.abs(index))
        values = tl.where(index < 0, -magnitude, magnitude)
    else:
        values = tl.load(table_ptr + index)
    values = _to_blocks(values, ROWS, COLS) * scales[:, :, None]
    return tl.reshape(values, (ROWS, COLS))


@triton.jit
def _entries_at_or_below(normalized, TABLE_SIZE: tl.constexpr, SEARCH_STEPS: tl.constexpr, table_ptr):
    """The number of table entries <= n (searchsorted, right side): a binary search of SEARCH_STEPS =
    log2(TABLE_SIZE) + 1 steps, each a gather from the table (1 KB at most)."""
    count = tl.zeros(normalized.shape, dtype=tl.int32)
    for i in tl.static_range(SEARCH_STEPS):
        candidate = count + (TABLE_SIZE >> i)
        inside = candidate <= TABLE_SIZE
        entry = tl.load(table_ptr + candidate - 1, mask=inside, other=float("inf"))
        count = tl.where(inside & (entry <= normalized), candidate, count)
    return count


@triton.jit
def _entries_at_or_below_closed(normalized, SIGNED: tl.constexpr):
    """:func:`_entries_at_or_below` in closed form, no gather (rules/moments_8bit.py, ``quantize_blocks``):
    n = f * 2**q with f in [1, 2) from n's bits; the entries at or below n number offset + 8 q + (the
    number of r in 0..7 with fp32(2 ** (r / 8)) <= f), offset 127 (exp_avg) or 255 (exp_avg_sq), clamped
    to the table (exp_avg's entry 0 is 0, at or below every n)."""
    bits = normalized.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 127
    f = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    count = 1 + (f >= EIGHTH_1).to(tl.int32) + (f >= EIGHTH_2).to(tl.int32) + (f >= EIGHTH_3).to(tl.int32)
    count += (f >= EIGHTH_4).to(tl.int32) + (f >= EIGHTH_5).to(tl.int32) + (f >= EIGHTH_6).to(tl.int32)
    count += (f >= EIGHTH_7).to(tl.int32)
    if SIGNED:
        return tl.minimum(tl.maximum(127 + 8 * exponent + count, 1), 128)
    else:
        return tl.minimum(tl.maximum(255 + 8 * exponent + count, 0), 256)


@triton.jit
def quantize_tile(
    x, table_ptr, SIGNED: tl.constexpr, TABLE_SIZE: tl.constexpr, SEARCH_STEPS: tl.constexpr, ROWS: tl.constexpr,
    COLS: tl.constexpr, CLOSED_FORM: tl.constexpr,
):  # fmt: skip
    """(codes [ROWS, COLS] int8 (SIGNED) or uint8, scales [ROWS, COLS // BLOCK] fp32) of the fp32 tile
    ``x``: the scale is the block's largest magnitude; the code of n = fp32(|x| / scale) (0 when the scale
    is 0) is the nearest of the table entries lo <= n < hi around it: hi when 2 n > lo + hi exactly, else
    lo. The entries around n by a binary search over the table, or with CLOSED_FORM by n's exponent and
    mantissa (the same entries: the tables are 2 ** (k / 8) rounded to fp32)."""
    blocks = _to_blocks(x, ROWS, COLS)
    magnitude = tl.abs(blocks)
    scales = tl.max(magnitude, axis=2)
    nonzero = scales > 0.0
    divisor = tl.where(nonzero, scales, 1.0)
    normalized = tl.where(nonzero[:, :, None], tl.div_rn(magnitude, divisor[:, :, None]), 0.0)
    if CLOSED_FORM:
        count = _entries_at_or_below_closed(normalized, SIGNED)
    else:
        count = _entries_at_or_below(normalized, TABLE_SIZE, SEARCH_STEPS, table_ptr)
    lo = tl.maximum(count - 1, 0)
    hi = tl.minimum(count, TABLE_SIZE - 1)
    # 2 n > lo + hi exactly, as (n - lo) > (hi - n) in fp32: adjacent entries are less than a factor 2
    # apart, so both differences are exact (Sterbenz), or, next to the entry 0, on the same side.
    lo_value = tl.load(table_ptr + lo)
    hi_value = tl.load(table_ptr + hi)
    index = tl.where(normalized - lo_value > hi_value - normalized, hi, lo)
    if SIGNED:  # noqa: SIM108 (a constexpr branch: one of them is compiled)
        codes = tl.where(blocks < 0.0, -index, index).to(tl.int8)
    else:
        codes = index.to(tl.uint8)
    return tl.reshape(codes, (ROWS, COLS)), scales


@triton.jit
def adamw_8bit_tile(
    grad,  # [ROWS, COLS] fp32, already rounded to the gradient dtype
    offs,  # [ROWS, COLS] int64 element offsets of W and of both moments' codes
    mask,  # [ROWS, COLS]
    scale_offs,  # [ROWS, COLS // BLOCK] int64 offsets of both moments' scales
    scale_mask,
    w_ptr,
    exp_avg_codes_ptr,
    exp_avg_scales_ptr,
    exp_avg_sq_codes_ptr,
    exp_avg_sq_scales_ptr,
    magnitudes_ptr,  # [128] fp32: exp_avg's table
    levels_ptr,  # [256] fp32: exp_avg_sq's table
    remainder_ptr,  # REMAINDER: the int16 remainders (W's offsets; w_ptr: the bf16 weight's int16 bits)
    rng_ptr,  # STOCHASTIC: [2] int64, the tensor's seed and the update's step (w_ptr: the int16 bits)
    index,  # STOCHASTIC: [ROWS, COLS] int64, each element's offset in the tensor (the stream's counter)
    step_size,
    bc2_sqrt,
    hyper_ptr,  # [5] fp64: lr, beta1, beta2, eps, weight_decay ([7] with CLIP: spike_threshold, grad_scale)
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    REMAINDER: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    CLIP: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
    CLOSED_FORM: tl.constexpr,  # quantize_tile's closed form (else its binary search): the same codes
):
    """Load W and both moments (codes, scales) of the tile, dequantize, apply AdamW ("fp64" arithmetic,
    kernels/adamw.py) with ``grad`` (with CLIP, clipped first by :func:`clip_tile` against the dequantized
    exp_avg_sq), requantize and store all of them; W read and written as ``kernels/master_weights.py``'s
    :func:`load_weight` and :func:`store_weight` do (bf16 master weights: a remainder or stochastic
    rounding). Returns the number of elements the spike rule replaced (0 without CLIP).
    :func:`adamw_8bit_tile_load` then :func:`adamw_8bit_tile_store` (which a caller may also call apart, to
    issue a tile's loads before another tile's stores)."""
    state = adamw_8bit_tile_load(
        offs, mask, scale_offs, scale_mask, w_ptr, exp_avg_codes_ptr, exp_avg_scales_ptr, exp_avg_sq_codes_ptr,
        exp_avg_sq_scales_ptr, remainder_ptr, REMAINDER, STOCHASTIC,
    )  # fmt: skip
    return adamw_8bit_tile_store(
        grad, state, offs, mask, scale_offs, scale_mask, w_ptr, exp_avg_codes_ptr, exp_avg_scales_ptr,
        exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, magnitudes_ptr, levels_ptr, remainder_ptr, rng_ptr, index,
        step_size, bc2_sqrt, hyper_ptr, ROWS, COLS, REMAINDER, STOCHASTIC, CLIP, GRAD_DTYPE, INTERPRET, CLOSED_FORM,
    )  # fmt: skip


@triton.jit
def adamw_8bit_tile_load(
    offs, mask, scale_offs, scale_mask, w_ptr, exp_avg_codes_ptr, exp_avg_scales_ptr, exp_avg_sq_codes_ptr,
    exp_avg_sq_scales_ptr, remainder_ptr, REMAINDER: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    """The tile's state as :func:`adamw_8bit_tile` reads it, a tuple (W as fp32, exp_avg's codes and scales,
    exp_avg_sq's codes and scales), the codes still 8-bit."""
    p = load_weight(w_ptr, offs, mask, remainder_ptr, REMAINDER, STOCHASTIC)
    m_codes = tl.load(exp_avg_codes_ptr + offs, mask=mask, other=0)
    m_scales = tl.load(exp_avg_scales_ptr + scale_offs, mask=scale_mask, other=0.0)
    v_codes = tl.load(exp_avg_sq_codes_ptr + offs, mask=mask, other=0)
    v_scales = tl.load(exp_avg_sq_scales_ptr + scale_offs, mask=scale_mask, other=0.0)
    return p, m_codes, m_scales, v_codes, v_scales


@triton.jit
def adamw_8bit_tile_store(
    grad, state, offs, mask, scale_offs, scale_mask, w_ptr, exp_avg_codes_ptr, exp_avg_scales_ptr,
    exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, magnitudes_ptr, levels_ptr, remainder_ptr, rng_ptr, index,
    step_size, bc2_sqrt, hyper_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, REMAINDER: tl.constexpr,
    STOCHASTIC: tl.constexpr, CLIP: tl.constexpr, GRAD_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
    CLOSED_FORM: tl.constexpr,
):  # fmt: skip
    """:func:`adamw_8bit_tile` after its loads (``state``: :func:`adamw_8bit_tile_load`'s): dequantize, the
    clipping, the AdamW step, requantize and the stores; returns the spike rule's count (0 without CLIP)."""
    p, m_codes, m_scales, v_codes, v_scales = state
    m = dequantize_tile(m_codes, m_scales, magnitudes_ptr, True, ROWS, COLS)
    v = dequantize_tile(v_codes, v_scales, levels_ptr, False, ROWS, COLS)
    clipped = 0
    if CLIP:
        grad, clipped = clip_tile(grad, v, mask, hyper_ptr, GRAD_DTYPE, INTERPRET)
    p, m, v = _adamw_math(p, grad, m, v, step_size, bc2_sqrt, hyper_ptr, "fp64", INTERPRET)
    store_weight(p, w_ptr, offs, mask, remainder_ptr, rng_ptr, index, REMAINDER, STOCHASTIC, INTERPRET)
    codes, scales = quantize_tile(m, magnitudes_ptr, True, 128, 8, ROWS, COLS, CLOSED_FORM)
    tl.store(exp_avg_codes_ptr + offs, codes, mask=mask)
    tl.store(exp_avg_scales_ptr + scale_offs, scales, mask=scale_mask)
    codes, scales = quantize_tile(v, levels_ptr, False, 256, 9, ROWS, COLS, CLOSED_FORM)
    tl.store(exp_avg_sq_codes_ptr + offs, codes, mask=mask)
    tl.store(exp_avg_sq_scales_ptr + scale_offs, scales, mask=scale_mask)
    return clipped


@triton.jit
def adamw_8bit_kernel(
    # pointers
    w_ptr,  # [R, C] fp32/bf16/fp16, read and written
    grad_ptr,  # [R, C] gradient dtype, read
    exp_avg_codes_ptr,  # [R, C] int8, read and written
    exp_avg_scales_ptr,  # [R, C // BLOCK] fp32, read and written
    exp_avg_sq_codes_ptr,  # [R, C] uint8, read and written
    exp_avg_sq_scales_ptr,  # [R, C // BLOCK] fp32, read and written
    magnitudes_ptr,  # [128] fp32, read
    levels_ptr,  # [256] fp32, read
    scalars_ptr,  # [2] fp32, read: step_size, bc2_sqrt (rules/adamw.py, adamw_scalars)
    skip_ptr,  # [] fp32, read: the update is skipped when != 0
    hyper_ptr,  # [5] fp64, read ([7] with CLIP)
    remainder_ptr,  # REMAINDER: [R, C] int16, read and written (w_ptr: the bf16 weight's int16 bits)
    rng_ptr,  # STOCHASTIC: [2] int64, read: the seed and the step (w_ptr: the bf16 weight's int16 bits)
    clipped_ptr,  # CLIP: [grid size] int32, written: each program's count of elements the spike rule replaced
    # sizes
    R,
    C,
    index_base,  # STOCHASTIC: the tensor offset of element 0 (a chunk of experts: its first element's)
    # meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    REMAINDER: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    CLIP: tl.constexpr,
    INTERPRET: tl.constexpr,
    CLOSED_FORM: tl.constexpr,  # quantize_tile's closed form (else its binary search): the same codes
):
    """Standalone AdamW with 8-bit moments (the split path): the tensors seen as [R, C] rows of their
    contiguous dimension (C a multiple of BLOCK, every tensor contiguous), updated in place unless the flag
    at ``skip_ptr`` is set. With STOCHASTIC, element i's stream counter is index_base + i.

    Grid: (cdiv(R, BLOCK_R), cdiv(C, BLOCK_C)).
    """
    if tl.load(skip_ptr) != 0.0:
        return
    offs_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    offs_b = (tl.program_id(1) * (BLOCK_C // BLOCK) + tl.arange(0, BLOCK_C // BLOCK)).to(tl.int64)
    mask = (offs_r < R)[:, None] & (offs_c < C)[None, :]
    offs = offs_r[:, None] * C + offs_c[None, :]
    scale_mask = (offs_r < R)[:, None] & (offs_b * BLOCK < C)[None, :]
    scale_offs = offs_r[:, None] * (C // BLOCK) + offs_b[None, :]
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    clipped = adamw_8bit_tile(
        grad, offs, mask, scale_offs, scale_mask, w_ptr, exp_avg_codes_ptr, exp_avg_scales_ptr,
        exp_avg_sq_codes_ptr, exp_avg_sq_scales_ptr, magnitudes_ptr, levels_ptr, remainder_ptr, rng_ptr,
        index_base + offs, tl.load(scalars_ptr), tl.load(scalars_ptr + 1), hyper_ptr, BLOCK_R, BLOCK_C, REMAINDER, STOCHASTIC,
        CLIP, grad_ptr.dtype.element_ty, INTERPRET, CLOSED_FORM,
    )  # fmt: skip
    if CLIP:
        tl.store(clipped_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), clipped)
