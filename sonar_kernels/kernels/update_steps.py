"""The small steps of one expert tensor's AdamW update around its wgrad launches, each merged into one
single-program launch (docs/design.md, "Backward and the fused update", the fused path): before the update, the skip
decision, the step count and the bias-corrected scalars; after it, the telemetry (norm, skips, clipped
entries). The same arithmetic as the torch ops they replace, so every bit is unchanged."""

import triton
import triton.language as tl

from sonar_kernels.kernels.adamw import adamw_scalars_of


@triton.jit
def update_begin_kernel(
    # pointers
    flags_ptr,  # [num_flags] fp32, read: the check pass's flags (1.0 where a tile's gradient is beyond the limit)
    step_ptr,  # [] fp32, read and written: the step count, advanced by 1 - skip
    hyper_ptr,  # [5] or [7] fp64, read: lr, beta1, beta2, eps, weight_decay (with SCALARS)
    powers_ptr,  # [2] fp32, read by the "fp32" arithmetic: torch.pow(fp32 (beta1, beta2), step + 1)
    skip_ptr,  # [] fp32, written: the largest flag (0.0: the update runs)
    scalars_ptr,  # [2] fp32, written with SCALARS: step_size, bc2_sqrt at the advanced step
    # sizes
    num_flags,
    # meta-parameters
    BLOCK: tl.constexpr,
    SCALARS: tl.constexpr,
    ARITHMETIC: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """skip = max(flags); step += 1 - skip; with SCALARS, the scalars of the advanced step (as
    ``kernels/adamw.py``'s ``adamw_scalars_of``). Replaces ``flags.amax()``, ``step.add_(1.0 - skip)`` and a scalars launch.

    Grid: (1,).
    Preconditions: the flags are 0.0 or 1.0 (max is then exact in any order); with the "fp32" arithmetic
    the powers are those of step + 1 (the scalars are read only when the update is not skipped, and then
    the step is step + 1).
    """
    offs = tl.arange(0, BLOCK)
    largest = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, num_flags, BLOCK):
        flags = tl.load(flags_ptr + start + offs, mask=start + offs < num_flags, other=0.0)
        largest = tl.maximum(largest, flags)
    skip = tl.max(largest, axis=0)
    step = tl.load(step_ptr) + (1.0 - skip)
    tl.store(skip_ptr, skip)
    tl.store(step_ptr, step)
    if SCALARS:
        step_size, bc2_sqrt = adamw_scalars_of(step, hyper_ptr, powers_ptr, ARITHMETIC, INTERPRET)
        tl.store(scalars_ptr, step_size)
        tl.store(scalars_ptr + 1, bc2_sqrt)


@triton.jit
def update_end_kernel(
    # pointers
    skip_ptr,  # [] fp32, read
    norm_ptr,  # [] fp32, read and written with HAS_NORM: the sum of squares, inf when skipped
    skipped_ptr,  # [] int64, read and written with HAS_SKIPPED: + 1 when skipped
    clipped_ptr,  # [] int64, written with HAS_CLIPPED: the count at clipped_in_ptr (HAS_CLIPPED_IN), else 0
    clipped_in_ptr,  # [] int64, read with HAS_CLIPPED_IN: the entries the spike rule replaced
    # meta-parameters
    HAS_NORM: tl.constexpr,
    HAS_SKIPPED: tl.constexpr,
    HAS_CLIPPED: tl.constexpr,
    HAS_CLIPPED_IN: tl.constexpr,
):
    """The update's telemetry once its launches ran: the norm inf when skipped, the skip counted, the
    clipped entries copied (0 without them). Replaces ``where(skip != 0, inf, norm)``, ``skipped.add_``
    and ``clipped.copy_`` / ``zero_``.

    Grid: (1,).
    """
    skipped = tl.load(skip_ptr) != 0.0
    if HAS_NORM:
        norm = tl.load(norm_ptr)
        tl.store(norm_ptr, tl.where(skipped, float("inf"), norm))
    if HAS_SKIPPED:
        tl.store(skipped_ptr, tl.load(skipped_ptr) + skipped.to(tl.int64))
    if HAS_CLIPPED:
        if HAS_CLIPPED_IN:
            tl.store(clipped_ptr, tl.load(clipped_in_ptr))
        else:
            tl.store(clipped_ptr, tl.full([], 0, tl.int64))
