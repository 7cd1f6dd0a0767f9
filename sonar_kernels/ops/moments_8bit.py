"""8-bit AdamW moments: the scheme (docs/design.md, "8-bit moments") in torch ops.

exp_avg and exp_avg_sq of an expert tensor are stored as one 8-bit code per element and one fp32 scale per
block of :data:`BLOCK` consecutive elements along the tensor's contiguous (last) dimension. An update
dequantizes them, runs AdamW in fp32 (the "fp64" arithmetic of ``sonar_kernels/kernels/adamw.py``, with
the bias-corrected scalars of :func:`adamw_8bit_scalars`), and requantizes. Every step is an IEEE
operation with one rounding, written in the same order here and in the Triton epilogue, so given the same
gradient both give the same codes, scales and weights (the kernels: ``sonar_kernels/kernels/moments_8bit.py``,
the fused epilogue through :class:`sonar_kernels.ops.AdamWUpdate`'s ``exp_avg_scales``).

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

from sonar_kernels.ops.master_weights import element_index, merge, shard_index_base, split, stochastic_round

__all__ = [
    "BLOCK",
    "adamw_8bit_scalars",
    "adamw_8bit_update",
    "adamw_fp64",
    "chunked_fp64_update_",
    "dequantize",
    "exp_avg_magnitudes",
    "exp_avg_sq_levels",
    "quantize",
    "scales_shape",
    "tables",
]

# Elements per block: a divisor of every epilogue column slice of ops/configs.py's wgrad tiles, so that a
# block never crosses a tile, an expert or a shard (docs/design.md, "8-bit moments").
BLOCK = 32
KINDS = ("exp_avg", "exp_avg_sq")
# Elements per call of the torch backend's update (:func:`adamw_8bit_`): its temporaries (fp64 operands,
# int32 indices: about 60 bytes an element) stay near 1 MiB whatever the chunk of experts.
UPDATE_ELEMENTS = 1 << 14


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
    table = _table_on(kind, x.device)
    blocks = _blocks(x)
    magnitude = blocks.abs()
    scales = magnitude.amax(dim=-1)
    nonzero = (scales > 0)[..., None]
    normalized = torch.where(nonzero, magnitude / torch.where(nonzero, scales[..., None], 1.0), 0.0)
    above = torch.searchsorted(table, normalized, right=True, out_int32=True)  # the first entry > n
    lo = (above - 1).clamp_(min=0)
    hi = above.clamp_(max=table.numel() - 1)
    # 2 n > lo + hi exactly, as (n - lo) > (hi - n) in fp32: adjacent entries are less than a factor 2
    # apart, so both differences are exact (Sterbenz), or, next to the entry 0, on the same side.
    index = torch.where(normalized - table[lo] > table[hi] - normalized, hi, lo)
    del lo, hi, normalized
    if kind == "exp_avg":
        codes = torch.where(blocks < 0, -index, index).to(torch.int8)
    else:
        codes = index.to(torch.uint8)
    return codes.reshape(x.shape), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, kind: str) -> torch.Tensor:
    """The fp32 values of ``codes`` (int8 for "exp_avg", uint8 for "exp_avg_sq") with their block
    ``scales``: ``table[code] * scale``, one fp32 rounding (the sign of an exp_avg code applied exactly)."""
    table = _table_on(kind, codes.device)
    if kind == "exp_avg":
        index = codes.to(torch.int64)
        values = torch.where(index < 0, -table[-index], table[index])
    else:
        values = table[codes.to(torch.int64)]
    return (_blocks(values) * scales[..., None]).reshape(codes.shape)


def adamw_8bit_scalars(step: torch.Tensor, hyper: torch.Tensor) -> torch.Tensor:
    """The [2] fp32 bias-corrected scalars of an 8-bit update, on ``step``'s device, no host read:
    ``step_size = fp32(lr / fp32(1 - beta1 ** step))`` and ``bc2_sqrt = sqrt(fp32(1 - beta2 ** step))``,
    the powers and the quotient in fp64, the square root correctly rounded to fp32. ``step``: the 0-dim fp32 step count,
    already incremented; ``hyper``: the [5] fp64 (lr, beta1, beta2, eps, weight_decay). Both backends
    read this tensor, so its last bits are the same for both."""
    step64 = step.to(torch.float64)
    bc1 = (1.0 - torch.pow(hyper[1], step64)).to(torch.float32)
    bc2 = (1.0 - torch.pow(hyper[2], step64)).to(torch.float32)
    step_size = (hyper[0] / bc1.to(torch.float64)).to(torch.float32)
    return torch.stack([step_size, torch.sqrt(bc2.to(torch.float64)).to(torch.float32)])


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
    gradient dtype); ``exp_avg``, ``exp_avg_sq``: (codes, scales); ``scalars``: :func:`adamw_8bit_scalars`;
    ``hyper``: [5] fp64. The arithmetic, each line one rounding to fp32 at its end (kernels/adamw.py's
    "fp64" arithmetic), with m and v dequantized first:

        p = fp32(p - lr * weight_decay * p)                 (fp64; p unchanged when weight_decay == 0)
        m = fp32(beta1 * m + (1 - beta1) * g)               (fp64)
        v = fp32(beta2 * v + (1 - beta2) * g * g)           (fp64)
        denom = fp32(fp32(sqrt(v) / bc2_sqrt) + eps)        (sqrt correctly rounded; the sum in fp64)
        p = p - (step_size * m) / denom                     (fp32)

    then m and v are requantized (:func:`quantize`). The caller rounds p to the weight's dtype.
    """
    m = dequantize(*exp_avg, "exp_avg")
    v = dequantize(*exp_avg_sq, "exp_avg_sq")
    p, m, v = adamw_fp64(p, g, m, v, scalars, hyper)
    return p, quantize(m, "exp_avg"), quantize(v, "exp_avg_sq")


def adamw_fp64(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    scalars: torch.Tensor,
    hyper: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step in the "fp64" arithmetic of ``sonar_kernels/kernels/adamw.py`` (each line of
    :func:`adamw_8bit_update`'s docstring one rounding to fp32), out of place: returns the new fp32
    (p, m, v). ``p``: any float dtype, read as fp32; ``g``, ``m``, ``v``: fp32; ``scalars``:
    :func:`adamw_8bit_scalars`; ``hyper``: [5] fp64. What the Triton kernels compute op for op, so both
    backends give the same bits from the same operands."""
    lr, beta1, beta2, eps, weight_decay = hyper[:5].unbind()
    p = p.to(torch.float32)
    p64 = p.to(torch.float64)
    p = torch.where(weight_decay != 0.0, (p64 - lr * weight_decay * p64).to(torch.float32), p)
    g64 = g.to(torch.float64)
    m = (beta1 * m.to(torch.float64) + (1.0 - beta1) * g64).to(torch.float32)
    v = (beta2 * v.to(torch.float64) + (1.0 - beta2) * g64 * g64).to(torch.float32)
    step_size, bc2_sqrt = scalars.unbind()
    # torch's fp32 sqrt on the CPU is not correctly rounded (SLEEF's); fp32(sqrt in fp64) is: an fp32
    # square root is never within an fp64 ulp of a point halfway between two fp32 values.
    root = torch.sqrt(v.to(torch.float64)).to(torch.float32)
    denom = ((root / bc2_sqrt).to(torch.float64) + eps).to(torch.float32)
    p = p - (step_size * m) / denom
    return p, m, v


def adamw_8bit_triton_(
    weight: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: tuple[torch.Tensor, torch.Tensor],
    exp_avg_sq: tuple[torch.Tensor, torch.Tensor],
    scalars: torch.Tensor,
    skip: torch.Tensor,
    hyper: torch.Tensor,
    *,
    remainder: torch.Tensor | None = None,
    rng: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The split path's update on the Triton backend: ``weight`` and both moments' (codes, scales) updated
    in place by :func:`sonar_kernels.kernels.moments_8bit.adamw_8bit_kernel` from ``grad`` (the weight's
    shape, rounded to the gradient dtype), unless ``skip`` (a 0-dim fp32 device flag) is not 0: the
    arithmetic of :func:`adamw_8bit_update`, bit for bit. Every tensor contiguous, the last dimension a
    multiple of :data:`BLOCK`. A bf16 ``weight`` with its int16 ``remainder`` is updated as its fp32 master
    (docs/design.md, "bf16 master weights"); with ``rng`` ([2] int64: the tensor's seed and the step) it is
    rounded back stochastically, each element's counter its offset in the tensor. A ``hyper`` of [7] clips the
    gradient first (docs/design.md, "Expert clipping"); returns then the per-program int32 counts of the
    elements the spike rule replaced (zeros when skipped), else None."""
    import triton

    from sonar_kernels.kernels.moments_8bit import ADAMW_8BIT_CONFIG, adamw_8bit_kernel
    from sonar_kernels.ops.common import on_device, triton_interpreting

    tensors = (weight, grad, *exp_avg, *exp_avg_sq, *([] if remainder is None else [remainder]))
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("the 8-bit update's tensors must be contiguous")
    C = weight.shape[-1]
    scales_shape(tuple(weight.shape))
    R = weight.numel() // C
    config = ADAMW_8BIT_CONFIG
    grid = (triton.cdiv(R, config["BLOCK_R"]), triton.cdiv(C, config["BLOCK_C"]))
    table = tables(weight.device)
    magnitudes, levels = table[:128], table[128:]
    bits = remainder is not None or rng is not None  # the weight through its int16 bits
    clip = hyper.numel() == 7
    counts = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=weight.device) if clip else None
    with on_device(weight.device):
        adamw_8bit_kernel[grid](
            weight.view(torch.int16) if bits else weight, grad, *exp_avg, *exp_avg_sq, magnitudes, levels, scalars,
            skip, hyper, hyper if remainder is None else remainder, hyper if rng is None else rng,
            hyper if counts is None else counts, R, C,
            BLOCK_R=config["BLOCK_R"], BLOCK_C=config["BLOCK_C"], REMAINDER=remainder is not None,
            STOCHASTIC=rng is not None, CLIP=clip, INTERPRET=triton_interpreting(), num_warps=config["num_warps"],
            enable_fp_fusion=False,
        )  # fmt: skip
    return counts


def _is_dtensor(t) -> bool:
    return callable(getattr(t, "to_local", None))


def adamw_8bit_(
    weight: torch.Tensor,
    gradient,
    grad_in: torch.Tensor | None,
    state: list[torch.Tensor],
    hyper: torch.Tensor,
    *,
    grad_dtype: torch.dtype | None,
    chunk_bytes: int | None,
    found: torch.Tensor | None = None,
    index_base: int = 0,
) -> None:
    """The torch backend's update of one expert tensor with 8-bit moments, in place: ``state`` the update's
    tensors (exp_avg's codes, exp_avg_sq's codes, step, grad_norm_sq, skipped, clipped, exp_avg's scales,
    exp_avg_sq's scales; ``ops/library.py``'s order; then, for a bf16 weight with master weights
    (docs/design.md, "bf16 master weights"), its int16 remainder, merged into the fp32 master before the
    update and split from it after, or the 0-dim int64 seed of its stochastic rounding at the update's
    step and each element's offset), ``hyper`` the [5] fp64 hyperparameters ([7] with expert clipping:
    each part's gradient clipped against its dequantized exp_avg_sq first, ``ops/clipping.py``; the count
    in ``clipped``).

    ``gradient``: the gradient as a tensor, or an ``ExpertGradient`` (``ops/expert_gradient.py``) that
    computes it by chunks of experts of at most ``chunk_bytes`` (None: whole), each chunk updated before the
    next is computed (blocks lie along the last dimension, chunks along the first: a chunk holds whole
    blocks). The gradient is rounded to ``grad_dtype`` (None: the weight's), plus ``grad_in`` (earlier
    micro-batches) rounded once more, as autograd sums them. The update is skipped as a whole (weight,
    codes, scales and step unchanged; ``grad_norm_sq`` inf, ``skipped`` + 1) when an entry of that gradient
    is not finite or beyond ``ops.grad_limit(float32)``: decided before the first chunk is updated (a bound
    from the GEMM operands, else a check pass) when chunked (the CPU: read on the host, which costs
    nothing), on the device without a host read otherwise.

    A DTensor ``weight`` (FSDP2's shard; its gradient a DTensor of the same placements, its codes and scales
    DTensors sharded like it, along a dimension other than the last): each rank updates its own shard, every
    element and block as one process would on the whole tensor; the skip and ``grad_norm_sq`` are decided
    over the whole gradient (a collective over the mesh).

    Args:
        found: the skip decided by the caller (a 0-dim bool on the weight's device) in place of the
            gradient's own check, for a whole gradient only: a shard's update uses the whole tensor's.
        index_base: added to every element's stream counter with stochastic rounding (a shard's position in
            the whole tensor).
    """
    from sonar_kernels.ops.adamw import grad_limit
    from sonar_kernels.ops.clipping import clip_gradient, clips
    from sonar_kernels.ops.common import inf_norm, whole

    m_codes, v_codes, step, grad_norm_sq, skipped, clipped, m_scales, v_scales, *master = state
    remainder = master[0] if master and master[0].dtype == torch.int16 else None
    seed = master[0] if master and remainder is None else None
    limit = grad_limit(torch.float32)
    dtype = grad_dtype or weight.dtype
    if _is_dtensor(weight):
        if not _is_dtensor(gradient) or grad_in is not None:
            raise ValueError(
                "a sharded (DTensor) weight's 8-bit update takes its whole gradient as a DTensor"
            )
        with torch.no_grad():
            grad = gradient.to(dtype)
            decided = ~(whole(inf_norm(grad)) <= limit)
            norm_sq = whole(torch.linalg.vector_norm(grad, dtype=torch.float32)).square()
            local = [t.to_local() if _is_dtensor(t) else t for t in (weight, grad, *state)]
            base = shard_index_base(weight) if seed is not None else 0  # the shard's stream counters
            adamw_8bit_(
                local[0],
                local[1],
                None,
                local[2:],
                hyper,
                grad_dtype=dtype,
                chunk_bytes=None,
                found=decided,
                index_base=base,
            )
            grad_norm_sq.copy_(torch.where(decided, float("inf"), norm_sq))
        return

    start_offset = weight.storage_offset()
    clip = clips(hyper)
    clipped.zero_()

    def apply(first: int, last: int, grad: torch.Tensor, scalars: torch.Tensor, found=None) -> None:
        """Update experts ``first`` to ``last - 1`` in place, :data:`UPDATE_ELEMENTS` at a time (whole rows
        of the last dimension: whole blocks), each slice unchanged where ``found`` (a device flag) is set."""
        columns = weight.shape[-1]
        tensors = (weight, m_codes, m_scales, v_codes, v_scales, *([] if remainder is None else [remainder]))
        held = [t[first:last].view(-1, t.shape[-1]) for t in tensors]
        grad = grad.reshape(-1, columns)
        rows = max(1, UPDATE_ELEMENTS // columns)
        for start in range(0, grad.shape[0], rows):
            part = slice(start, start + rows)
            w, mc, ms, vc, vs, *r = (t[part] for t in held)
            master = merge(w, r[0]) if r else w
            g = grad[part].float()
            if clip:  # a skipped update's gradient is zeros here: nothing counted
                g, replaced = clip_gradient(g, dequantize(vc, vs, "exp_avg_sq"), hyper, dtype)
                clipped.add_(replaced)
            p, m, v = adamw_8bit_update(master, g, (mc, ms), (vc, vs), scalars, hyper)
            if r:
                new_w = split(p)
            elif seed is not None:
                index = element_index(w) + (w.storage_offset() - start_offset + index_base)
                new_w = (stochastic_round(p, seed, step, index),)
            else:
                new_w = (p.to(weight.dtype),)
            for target, new in zip((w, *r, mc, ms, vc, vs), (*new_w, *m, *v), strict=True):
                target.copy_(new if found is None else torch.where(found, target, new))

    chunked_fp64_update_(
        weight, gradient, grad_in, step, grad_norm_sq, skipped, hyper, apply,
        grad_dtype=dtype, chunk_bytes=chunk_bytes, found=found,
    )  # fmt: skip


def chunked_fp64_update_(
    weight: torch.Tensor,
    gradient,
    grad_in: torch.Tensor | None,
    step: torch.Tensor,
    grad_norm_sq: torch.Tensor,
    skipped: torch.Tensor,
    hyper: torch.Tensor,
    apply,
    *,
    grad_dtype: torch.dtype,
    chunk_bytes: int | None,
    found: torch.Tensor | None = None,
) -> None:
    """The torch backend's driver of an update in the "fp64" arithmetic (:func:`adamw_fp64`): 8-bit moments
    (:func:`adamw_8bit_`) and stochastic rounding (``ops/master_weights.py``). ``gradient`` (a tensor, or
    an ``ExpertGradient`` computed by chunks of experts of at most ``chunk_bytes``) rounded to
    ``grad_dtype``, plus ``grad_in`` rounded once more; the skip decided for the whole tensor (an entry not
    finite or beyond ``ops.grad_limit(float32)``: on the device for a whole gradient, or ``found`` given;
    before the first chunk otherwise); ``step`` incremented unless skipped; then ``apply(first, last,
    grad, scalars, found)`` updates experts ``first`` to ``last - 1`` from their fp32 gradient with
    :func:`adamw_8bit_scalars` (``found``: None, or the device flag where nothing may change);
    ``grad_norm_sq`` and ``skipped`` as the exact update's."""
    from sonar_kernels.ops.adamw import chunked_update_skipped, grad_limit
    from sonar_kernels.ops.common import inf_norm
    from sonar_kernels.ops.expert_gradient import ExpertGradient

    limit = grad_limit(torch.float32)

    def total_of(grad: torch.Tensor, first: int, last: int) -> torch.Tensor:
        grad = grad.to(grad_dtype)
        return grad if grad_in is None else grad_in[first:last] + grad.to(grad_in.dtype)

    chunks = gradient.chunks(chunk_bytes) if isinstance(gradient, ExpertGradient) else [(0, weight.shape[0])]
    if found is not None and len(chunks) > 1:
        raise ValueError("found= is taken with a whole gradient only")
    with torch.no_grad():
        if len(chunks) == 1:  # whole: decided on the device
            whole = gradient.full() if isinstance(gradient, ExpertGradient) else gradient
            grad = total_of(whole, 0, weight.shape[0])
            if found is None:
                found = ~(inf_norm(grad) <= limit)
            step.add_((~found).float())
            scalars = adamw_8bit_scalars(step, hyper)
            apply(0, weight.shape[0], torch.where(found, 0.0, grad.float()), scalars, found)
            norm_sq = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
            grad_norm_sq.copy_(torch.where(found, float("inf"), norm_sq))
            skipped.add_(found.long())
            return
        largest = max(last - first for first, last in chunks)
        buffer = torch.empty_like(weight[:largest])

        def chunk_gradient(first: int, last: int) -> torch.Tensor:
            return total_of(gradient.compute(first, last, buffer[: last - first]), first, last)

        if chunked_update_skipped(gradient, chunks, chunk_gradient, grad_in, limit, grad_dtype):
            grad_norm_sq.fill_(float("inf"))
            skipped.add_(1)
            return
        step.add_(1.0)
        scalars = adamw_8bit_scalars(step, hyper)
        norm_sq = torch.zeros((), dtype=torch.float32, device=weight.device)
        for first, last in chunks:
            grad = chunk_gradient(first, last)
            norm_sq += torch.linalg.vector_norm(grad, dtype=torch.float32).square()
            apply(first, last, grad, scalars)
        grad_norm_sq.copy_(norm_sq)
