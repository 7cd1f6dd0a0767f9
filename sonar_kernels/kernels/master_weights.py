"""bf16 master weights in registers: the 16-bit remainder's split and merge, and stochastic rounding with a
counter-based stream (docs/design.md, "bf16 master weights").

``sonar_kernels/ops/master_weights.py``'s rules, operation for operation, on int32 bit patterns: a bf16
weight travels as its int16 bits (the caller loads and stores the weight through an int16 view, which
also keeps the interpreter's bf16 storage out of the way). The masters are finite (the update never
writes a non-finite one: a non-finite gradient skips it), so ``bits + 2**15`` does not overflow.
"""

import triton
import triton.language as tl

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
    """``lowbias32`` of the uint32 ``x`` (ops/master_weights.py ``hash32``): uint32 arithmetic, wrapping."""
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
