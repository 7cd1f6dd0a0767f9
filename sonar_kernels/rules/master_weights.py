"""bf16 expert weights with fp32-quality updates: the 16-bit remainder and stochastic rounding, in torch ops
(docs/design.md, "bf16 master weights"); their Triton device functions, operation for operation on int32
bit patterns, are in ``sonar_kernels/kernels/master_weights.py``.

Both keep the expert weight as the model's plain bf16 tensor. The rules, written once here and followed by
every update path:

- **Remainder** (Megatron-Core's ``store_param_remainders``; MindSpeed's reuse-fp32-param): the fp32
  master ``M`` is the bf16 weight ``W`` and a signed 16-bit remainder ``r`` together, read as 32-bit
  integers (``bits``: the float's bit pattern as an int32): ``bits(M) = bits(W) * 2**16 + r``, with
  ``bits(W) = floor((bits(M) + 2**15) / 2**16)`` and so ``r`` in [-2**15, 2**15). ``W`` is ``M`` rounded to
  the nearest bf16, an exact tie away from zero (adding half of the dropped bits' range to the magnitude
  and truncating: a float's bits are its sign and magnitude, and the carry runs into the exponent as
  rounding should). torch's ``M.to(torch.bfloat16)`` rounds a tie to even instead: the two differ only at
  ties (``r == -2**15``) whose lower neighbour is even; ties away from zero keeps the split in 16 bits,
  round half to even would need a 17th. :func:`split` and :func:`merge` are exact inverses.
- **Stochastic rounding**: ``bits(W) = floor((bits(M) + u) / 2**16)``, ``u`` 16 random bits: the
  magnitude rounds up with probability (the dropped bits) / 2**16, so ``E[W] = M`` (unbiased; a NaN
  becomes torch's bf16 NaN). ``u`` is the upper half of :func:`hash32` of the element's index mixed with a stream
  ``hash32(hash32(seed) ^ step)``: a counter-based stream keyed by (seed, step, element), so every
  backend, fused or split, and every run gives the same bits.
"""

from __future__ import annotations

import torch

__all__ = [
    "REMAINDER",
    "STOCHASTIC",
    "element_index",
    "hash32",
    "merge",
    "random_bits",
    "shard_index_base",
    "split",
    "stochastic_round",
    "tensor_seed",
]

REMAINDER = "remainder"
STOCHASTIC = "stochastic"
MASK32 = 0xFFFFFFFF
# The bf16 NaN torch's cast writes (c10::BFloat16's round_to_nearest_even).
BF16_NAN_BITS = 0x7FC0


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor's bit patterns as int64 (the int32 pattern, sign-extended)."""
    if x.dtype != torch.float32:
        raise TypeError(f"expected an fp32 tensor, got {x.dtype}")
    return x.view(torch.int32).to(torch.int64)


def split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 weight, int16 remainder) of the fp32 ``master`` (module docstring: the weight is the master
    rounded to nearest, a tie away from zero)."""
    bits = _bits(master)
    high = (bits + (1 << 15)) >> 16
    remainder = bits - (high << 16)
    return high.to(torch.int16).view(torch.bfloat16), remainder.to(torch.int16)


def merge(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master of the bf16 ``weight`` and its int16 ``remainder`` (the inverse of :func:`split`).
    A pair :func:`split` never gives, a signed zero with a remainder that would cross the sign (a stale
    remainder after the weight was changed outside the optimizer: zeroed, pruned, reloaded alone), merges
    to the weight itself, not to a NaN."""
    if weight.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError(
            f"expected a bf16 weight and an int16 remainder, got {weight.dtype} and {remainder.dtype}"
        )
    # Both read as fp32 (a 16-bit pattern widened to fp32 is that pattern shifted up 16 bits, exactly, NaN
    # patterns included): no 16-bit integer arithmetic, which compiled CPU code runs a lane at a time.
    high = weight.float().view(torch.int32)
    low = remainder.view(torch.bfloat16).float().view(torch.int32) >> 16
    bits = (high.to(torch.int64) + low.to(torch.int64)).to(torch.int32)
    bits = torch.where((bits < 0) != (high < 0), high, bits)
    return bits.view(torch.float32)


def hash32(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit integer hash (``lowbias32``, C. Wellons' hash-prospector: two multiply-xorshift rounds)
    of the low 32 bits of ``x``, in [0, 2**32): an int64 tensor for an int64 tensor, an int for an int."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def random_bits(seed: torch.Tensor | int, step: torch.Tensor | int, index: torch.Tensor) -> torch.Tensor:
    """16 random bits (int64 in [0, 2**16)) per element ``index`` (int64, the element's position in the
    tensor) of the update at ``step`` of a tensor with ``seed``: the upper half of
    ``hash32(index ^ hash32(hash32(seed) ^ step))``, each operand's low 32 bits."""
    seed = torch.as_tensor(seed, dtype=torch.int64, device=index.device)
    step = torch.as_tensor(step, device=index.device).to(torch.int64)
    stream = hash32(hash32(seed) ^ (step & MASK32))
    return hash32(index ^ stream) >> 16


def stochastic_round(
    master: torch.Tensor,
    seed: torch.Tensor | int,
    step: torch.Tensor | int,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp32 ``master`` rounded to bf16 stochastically (module docstring), with the random bits of
    :func:`random_bits` at each element's ``index`` (default: its position in ``master``, row-major)."""
    if index is None:
        index = torch.arange(master.numel(), device=master.device, dtype=torch.int64).reshape(master.shape)
    high = (_bits(master) + random_bits(seed, step, index)) >> 16
    high = torch.where(master.isnan(), BF16_NAN_BITS, high)
    return high.to(torch.int16).view(torch.bfloat16)


def shard_index_base(t: torch.Tensor) -> int:
    """The row-major position, in the whole tensor, of the first element of this rank's part of the DTensor
    ``t`` sharded along its first dimension only (FSDP2's default): the stream's counter of that element
    (:func:`element_index` of the unsharded tensor), so that a shard draws what one process draws there.

    Raises:
        ValueError: ``t`` is sharded along another dimension, or not contiguous.
    """
    from torch.distributed.tensor import Replicate, Shard

    if any(not isinstance(q, Replicate) and not (isinstance(q, Shard) and q.dim == 0) for q in t.placements):
        raise ValueError(
            f"stochastic rounding of a sharded tensor needs it sharded along its first dimension only (FSDP2's "
            f"default), got placements {t.placements}"
        )
    if not t.to_local().is_contiguous():
        raise ValueError("stochastic rounding of a sharded tensor needs a contiguous shard")
    # DTensor's Shard(0) split, torch.chunk's (ceil(rows / parts) rows a part), nested over the mesh's
    # dimensions in order, in Python ints from the mesh coordinate (torch's own helper builds index
    # tensors and reads them back)
    coordinate = t.device_mesh.get_coordinate()
    first, rows = 0, t.shape[0]
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Shard):
            chunk = -(-rows // t.device_mesh.size(dim))
            start = min(coordinate[dim] * chunk, rows)
            first, rows = first + start, min(chunk, rows - start)
    if rows != t.to_local().shape[0]:  # DTensor's split changed
        raise AssertionError(f"shard of {rows} rows computed, {t.to_local().shape[0]} held")
    rest = 1
    for size in t.shape[1:]:
        rest *= size
    return first * rest


def element_index(t: torch.Tensor) -> torch.Tensor:
    """Each element's offset from ``t``'s first element in its storage, int64, ``t``'s shape: the counter
    of the stochastic rounding's stream (for a contiguous tensor its row-major position)."""
    span = (
        1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        if t.numel()
        else 0
    )
    return torch.arange(span, dtype=torch.int64, device=t.device).as_strided(t.shape, t.stride())


def tensor_seed(seed: int, ordinal: int) -> int:
    """The seed of the ``ordinal``-th tensor an optimizer with ``seed`` manages (its stream's key):
    ``hash32(hash32(seed) ^ ordinal)``, so that tensors, and optimizers with other seeds, draw apart."""
    return hash32(hash32(seed & MASK32) ^ (ordinal & MASK32))  # Python ints: no tensor, no host read
