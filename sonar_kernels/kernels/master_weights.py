"""bf16 master weights in registers: the 16-bit remainder's split and merge, and stochastic rounding with a
counter-based stream (docs/design.md, "bf16 master weights").

``sonar_kernels/rules/master_weights.py``'s rules, operation for operation, on int32 bit patterns: a bf16
weight travels as its int16 bits (the caller loads and stores the weight through an int16 view, which
also keeps the interpreter's bf16 storage out of the way). The masters are finite (the update never
writes a non-finite one: a non-finite gradient skips it), so ``bits + 2**15`` does not overflow.
"""

import triton
import triton.language as tl

from sonar_kernels.kernels.common import round_to

HALF: tl.constexpr = tl.constexpr(1 << 15)
# The bf16 NaN torch's cast writes (c10::BFloat16's round_to_nearest_even: 0x7FC0).
BF16_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC0)
HASH_A: tl.constexpr = tl.constexpr(0x7FEB352D)
HASH_B: tl.constexpr = tl.constexpr(0x846CA68B)


@triton.jit
def split_tile(master):
    """(the bf16 weight's int16 bits, the int16 remainder) of the fp32 ``master``: the weight is the master
    rounded to nearest, a tie away from zero; ``bits(master) = bits(weight) * 2**16 + remainder``."""
    bits = master.to(tl.int32, bitcast=True)
    high = (bits + HALF) >> 16
    remainder = bits - (high << 16)
    return high.to(tl.int16), remainder.to(tl.int16)


@triton.jit
def merge_tile(weight_bits, remainder):
    """The fp32 master of a bf16 weight (its int16 bits) and its int16 remainder; a signed zero with a
    remainder that would cross the sign (never split's) merges to the weight itself."""
    high = weight_bits.to(tl.int32) << 16
    bits = high + remainder.to(tl.int32)
    bits = tl.where((bits < 0) != (high < 0), high, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def hash32(x):
    """``lowbias32`` of the uint32 ``x`` (rules/master_weights.py ``hash32``): uint32 arithmetic, wrapping."""
    x = x ^ (x >> 16)
    x = x * tl.full((), HASH_A, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), HASH_B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def random_bits(seed, step, index):
    """16 random bits (uint32 in [0, 2**16)) of element ``index`` at ``step`` with ``seed`` (each the low
    32 bits of the value, as uint32): the upper half of ``hash32(index ^ hash32(hash32(seed) ^ step))``."""
    stream = hash32(hash32(seed) ^ step)
    return hash32(index ^ stream) >> 16


@triton.jit
def stochastic_round_tile(master, bits16):
    """The int16 bits of the fp32 ``master`` rounded to bf16 stochastically with the 16 random bits
    ``bits16`` (uint32): ``floor((bits(master) + bits16) / 2**16)``; NaN to torch's bf16 NaN."""
    bits = master.to(tl.int32, bitcast=True)
    high = (bits + bits16.to(tl.int32)) >> 16
    return tl.where(master != master, BF16_NAN_BITS, high).to(tl.int16)


@triton.jit
def load_weight(w_ptr, offs, mask, remainder_ptr, REMAINDER: tl.constexpr, STOCHASTIC: tl.constexpr):
    """The fp32 weight an AdamW tile updates: with REMAINDER the master merged from the bf16 weight's int16
    bits at ``w_ptr`` and the remainder; with STOCHASTIC the bf16 weight (its int16 bits) read as fp32;
    else the weight at ``w_ptr`` in its own dtype, as fp32."""
    if REMAINDER:
        bits = tl.load(w_ptr + offs, mask=mask, other=0)
        return merge_tile(bits, tl.load(remainder_ptr + offs, mask=mask, other=0))
    elif STOCHASTIC:  # the bf16 weight's bits as the upper half of its fp32 value
        return (tl.load(w_ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_weight(
    p, w_ptr, offs, mask, remainder_ptr, rng_ptr, index, REMAINDER: tl.constexpr, STOCHASTIC: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Store the updated fp32 weight ``p`` as :func:`load_weight` read it: split into the bf16 bits and the
    remainder (REMAINDER), rounded stochastically with the stream of the [2] int64 (seed, step) at
    ``rng_ptr`` and each element's counter ``index`` (STOCHASTIC), else rounded to nearest in W's dtype."""
    if REMAINDER:
        bits, remainder = split_tile(p)
        tl.store(w_ptr + offs, bits, mask=mask)
        tl.store(remainder_ptr + offs, remainder, mask=mask)
    elif STOCHASTIC:
        seed = tl.load(rng_ptr).to(tl.uint32)
        step = tl.load(rng_ptr + 1).to(tl.uint32)
        tl.store(
            w_ptr + offs, stochastic_round_tile(p, random_bits(seed, step, index.to(tl.uint32))), mask=mask
        )
    else:
        tl.store(w_ptr + offs, round_to(p, w_ptr.dtype.element_ty, INTERPRET), mask=mask)
