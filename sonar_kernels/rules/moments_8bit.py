"""8-bit AdamW moments: the scheme (docs/design.md, "8-bit moments") in torch ops; its Triton tiles are
``dequantize_tile`` and ``quantize_tile`` in ``sonar_kernels/kernels/moments_8bit.py``.

exp_avg and exp_avg_sq of an expert tensor are stored as one 8-bit code per element and one fp32 scale per
block of :data:`BLOCK` consecutive elements along the tensor's contiguous (last) dimension. An update
dequantizes them, runs AdamW in fp32 (the "fp64" arithmetic of ``rules/adamw.py``, with the
bias-corrected scalars of its ``adamw_scalars``), and requantizes. Every step is an IEEE
operation with one rounding, written in the same order here and in the Triton epilogue, so given the same
gradient both give the same codes, scales and weights (the kernels: ``sonar_kernels/kernels/moments_8bit.py``,
the fused epilogue through :class:`sonar_kernels.ops.AdamWUpdate`'s ``exp_avg_scales``; the torch backend's
driver: ``sonar_kernels/ops/torch_backend/fp64_update.py``).

The scheme:

- a block's scale is the largest magnitude of its values (0 for a block of zeros);
- exp_avg: the code is a signed int8 ``sign * k``, k in 0..127, the value ``sign * MAGNITUDES[k] * scale``
  with ``MAGNITUDES[0] = 0`` and ``MAGNITUDES[k] = 2 ** ((k - 127) / 8)`` (rounded to fp32) for k >= 1;
- exp_avg_sq: the code is a uint8 c, the value ``LEVELS[c] * scale`` with ``LEVELS[c] = 2 ** ((c - 255) / 8)``
  (rounded to fp32): no zero level, so a small second moment is never read back as 0 (the zero-point
  problem of "Memory Efficient Optimizers with 4-bit States", Li et al. 2023); a block of zeros has scale 0;
- dequantize: one fp32 multiplication, ``table[code] * scale``;
- quantize: the normalized magnitude ``n = fp32(|x| / scale)`` (0 when the scale is 0) goes to the nearest
  table entry: between the entries ``lo <= n < hi`` next to it, ``hi`` when ``2 n > lo + hi`` exactly
  (compared as ``n - lo > hi - n`` in fp32, where both differences are exact), else ``lo``: an exact tie
  goes to the smaller magnitude.
"""

from __future__ import annotations

import functools

import torch

from sonar_kernels.rules.adamw import adamw_fp64

__all__ = [
    "BLOCK",
    "KINDS",
    "adamw_8bit_update",
    "dequantize",
    "dequantize_blocks",
    "exp_avg_magnitudes",
    "exp_avg_sq_levels",
    "quantize",
    "quantize_blocks",
    "scales_shape",
    "tables",
]

# Elements per block: a divisor of every epilogue column slice of ops/triton_backend/configs.py's wgrad tiles, so that a
# block never crosses a tile, an expert or a shard (docs/design.md, "8-bit moments").
BLOCK = 32
KINDS = ("exp_avg", "exp_avg_sq")
# The quantizer's closed form (:func:`quantize_blocks`): fp32(2 ** (r / 8)) for r in 0..7. Every entry of
# both tables is one of them times a power of two (exactly: no entry is subnormal).
_EIGHTHS = [float(torch.tensor(2.0 ** (r / 8), dtype=torch.float64).to(torch.float32)) for r in range(8)]


@functools.cache
def _table(kind: str) -> torch.Tensor:
    if kind == "exp_avg":
        exponents = torch.arange(128, dtype=torch.float64) - 127
        table = torch.exp2(exponents / 8)
        table[0] = 0.0
    elif kind == "exp_avg_sq":
        table = torch.exp2((torch.arange(256, dtype=torch.float64) - 255) / 8)
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return table.to(torch.float32)


def exp_avg_magnitudes(device: torch.device | str = "cpu") -> torch.Tensor:
    """The [128] fp32 magnitudes of exp_avg's codes, ascending: 0, then 2 ** ((k - 127) / 8)."""
    return _table("exp_avg").to(device)


def exp_avg_sq_levels(device: torch.device | str = "cpu") -> torch.Tensor:
    """The [256] fp32 levels of exp_avg_sq's codes, ascending: 2 ** ((c - 255) / 8)."""
    return _table("exp_avg_sq").to(device)


@functools.cache
def _tables(device: torch.device) -> torch.Tensor:
    return torch.cat([_table("exp_avg"), _table("exp_avg_sq")]).to(device)


def _table_on(kind: str, device: torch.device) -> torch.Tensor:
    """``kind``'s table on ``device``: a view of :func:`tables` (made once per device, not per call)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    table = tables(device)
    return table[:128] if kind == "exp_avg" else table[128:]


def tables(device: torch.device | str = "cpu") -> torch.Tensor:
    """[384] fp32: exp_avg's 128 magnitudes, then exp_avg_sq's 256 levels (what the Triton kernels read);
    one tensor per device, made once."""
    return _tables(torch.device(device))


def scales_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the scales of a tensor of ``shape``: its last dimension divided by :data:`BLOCK`.

    Raises:
        ValueError: a 0-dim shape, or a last dimension that is not a multiple of :data:`BLOCK`.
    """
    if len(shape) == 0 or shape[-1] % BLOCK:
        raise ValueError(
            f"8-bit moments need a last (contiguous) dimension that is a multiple of {BLOCK}, got shape "
            f"{tuple(shape)}"
        )
    return (*shape[:-1], shape[-1] // BLOCK)


def _blocks(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(*scales_shape(tuple(t.shape)), BLOCK)


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of the fp32 tensor ``x`` by the scheme's rule (module docstring): int8 codes for
    ``kind`` "exp_avg", uint8 for "exp_avg_sq" (``x`` >= 0), of ``x``'s shape; fp32 scales of
    :func:`scales_shape`. ``x`` must be finite."""
    if x.dtype != torch.float32:
        raise TypeError(f"quantize takes fp32 values, got {x.dtype}")
    codes, scales = quantize_blocks(_blocks(x), kind, _table_on(kind, x.device))
    return codes.reshape(x.shape), scales.squeeze(-1)


def quantize_blocks(
    blocks: torch.Tensor, kind: str, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` of fp32 ``blocks`` [..., BLOCK] with ``kind``'s ``table`` (a view of :func:`tables`):
    returns codes [..., BLOCK] and scales [..., 1].

    The entry next to n = fp32(|x| / scale) in closed form, no search: write n = f * 2**q with f in [1, 2)
    (q its exponent field less 127, f its mantissa under the exponent of 1); an entry whose code less the
    table's offset (127 for exp_avg, 255 for exp_avg_sq) is 8 q' + r has the value 2**q' * fp32(2 ** (r /
    8)), so the first entry above n has the code offset + 8 q + (the number of r in 0..7 with fp32(2 ** (r
    / 8)) <= f), clamped to the table (a subnormal or zero n has a q far below every entry). Then lo and hi
    around n and the tie rule as the module docstring states them: the codes of a binary search over the
    table, which tests/test_moments_8bit.py checks against a float64 reference."""
    magnitude = blocks.abs()
    scales = magnitude.amax(dim=-1, keepdim=True)
    nonzero = scales > 0
    normalized = torch.where(nonzero, magnitude / torch.where(nonzero, scales, 1.0), 0.0)
    bits = normalized.view(torch.int32)
    exponent = (bits >> 23) - 127
    mantissa = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    count = 1 + sum((mantissa >= _EIGHTHS[r]).to(torch.int32) for r in range(1, 8))
    if kind == "exp_avg":  # entry 0 is 0, at or below every n
        above = (127 + 8 * exponent + count).clamp(1, 128)
    else:
        above = (255 + 8 * exponent + count).clamp(0, 256)
    lo = (above - 1).clamp(min=0)
    hi = above.clamp(max=table.shape[0] - 1)
    # 2 n > lo + hi exactly, as (n - lo) > (hi - n) in fp32: adjacent entries are less than a factor 2
    # apart, so both differences are exact (Sterbenz), or, next to the entry 0, on the same side.
    index = torch.where(normalized - table[lo] > table[hi] - normalized, hi, lo)
    if kind == "exp_avg":
        return torch.where(blocks < 0, -index, index).to(torch.int8), scales
    return index.to(torch.uint8), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, kind: str) -> torch.Tensor:
    """The fp32 values of ``codes`` (int8 for "exp_avg", uint8 for "exp_avg_sq") with their block
    ``scales``: ``table[code] * scale``, one fp32 rounding (the sign of an exp_avg code applied exactly)."""
    values = dequantize_blocks(_blocks(codes), scales[..., None], kind, _table_on(kind, codes.device))
    return values.reshape(codes.shape)


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, kind: str, table: torch.Tensor
) -> torch.Tensor:
    """:func:`dequantize` of ``codes`` [..., BLOCK] with ``scales`` [..., 1] and ``kind``'s ``table``."""
    index = codes.to(torch.int32)
    signed = kind == "exp_avg"  # the sign of a code applied exactly
    values = torch.where(index < 0, -table[-index], table[index]) if signed else table[index]
    return values * scales


def adamw_8bit_update(
    p: torch.Tensor,
    g: torch.Tensor,
    exp_avg: tuple[torch.Tensor, torch.Tensor],
    exp_avg_sq: tuple[torch.Tensor, torch.Tensor],
    scalars: torch.Tensor,
    hyper: torch.Tensor,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """One AdamW step with 8-bit moments, out of place: returns the new (p in fp32, exp_avg's (codes,
    scales), exp_avg_sq's (codes, scales)).

    ``p``: the weight (any float dtype, read as fp32); ``g``: its gradient as fp32 (already rounded to the
    gradient dtype); ``exp_avg``, ``exp_avg_sq``: (codes, scales); ``scalars``: ``rules.adamw.adamw_scalars``;
    ``hyper``: [5] fp64. m and v dequantized, ``rules.adamw.adamw_fp64`` (the "fp64" arithmetic), then m
    and v requantized (:func:`quantize`). The caller rounds p to the weight's dtype.
    """
    m = dequantize(*exp_avg, "exp_avg")
    v = dequantize(*exp_avg_sq, "exp_avg_sq")
    p, m, v = adamw_fp64(p, g, m, v, scalars, hyper)
    return p, quantize(m, "exp_avg"), quantize(v, "exp_avg_sq")
