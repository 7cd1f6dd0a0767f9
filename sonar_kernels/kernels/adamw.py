"""AdamW in registers: the arithmetic shared by the fused wgrad epilogue and the standalone AdamW kernel.

Two arithmetics, chosen by the constexpr ``ARITHMETIC`` (``ops.adamw_arithmetic`` picks one per device).

"fp64", torch's fused CUDA AdamW as docs/design.md spells it out (fused_adam_utils.cuh with the
hyperparameters as C++ doubles); within a few ulps of torch's CPU AdamW. With p, g, m, v loaded as fp32
and lr, beta1, beta2, eps, weight_decay as fp64:

    bc1 = fp32(1 - pow(beta1, step));  bc2 = fp32(1 - pow(beta2, step));  bc2_sqrt = sqrtf(bc2)
    step_size = fp32(lr / bc1)
    p = fp32(p - lr * weight_decay * p)                 (fp64; skipped when weight_decay == 0)
    m = fp32(beta1 * m + (1 - beta1) * g)               (fp64)
    v = fp32(beta2 * v + (1 - beta2) * g * g)           (fp64)
    denom = fp32(fp32(sqrtf(v) / bc2_sqrt) + eps)       (the sum in fp64)
    p = p - (step_size * m) / denom                     (fp32, IEEE division)

"fp32", torch 2.13's fused CUDA AdamW (the same-dtype ``FusedAdamMathFunctor`` of the
fused_adam_utils.cuh that torch 2.13 ships): the hyperparameters rounded to fp32 and, all in fp32,

    bc1 = 1 - powf(beta1, step);  bc2_sqrt = sqrtf(1 - powf(beta2, step));  step_size = lr / bc1
    p = fma(-(lr * weight_decay), p, p)                 (skipped when weight_decay == 0)
    m = fma(beta1, m, fma(-beta1, g, g))
    v = fma(beta2, v, fma(-beta2, g * g, g * g))
    p = p - (step_size * m) / (sqrtf(v) / bc2_sqrt + eps)

where powf(beta, step) is torch's own: ``torch.pow`` of the fp32 betas and the step tensor, computed by the
launcher on the device (ops/triton_backend/wgrad.py) and read here (``powers_ptr``). torch's kernel calls CUDA's powf,
which is not correctly rounded, and libdevice's powf as Triton compiles it rounds differently: on an H200 it
differed from torch's in the last bit at 49 % of the steps 1 to 100000 for beta = 0.999 (an fp64 pow
rounded to fp32 at 6 %), and one bit of 1 - 0.999 ** step moves every weight of the tensor
(bench/results/2026-12-04-h200-bias-corrections.json). ``torch.pow`` on CUDA gave the fused AdamW's bits at
every step tried (3000 steps, three pairs of betas).

p, m and v are rounded to their own dtypes once, at the store. Both kernels below call
:func:`_adamw_math`, so the fused epilogue and the split path (wgrad written to memory, then
:func:`adamw_kernel`) give the same bits.

The hyperparameters reach the kernels as fp64 values in a device tensor ([5] fp64: lr, beta1, beta2, eps,
weight_decay), read at run time, so a scheduler's new learning rate reaches a compiled step and no
hyperparameter is rounded to fp32 on the way (a plain float kernel parameter is passed as fp32 on a GPU). Under the interpreter libdevice is not available, so
the "fp64" arithmetic's pow(beta, step) is evaluated as exp2(step * log2(beta)) in fp64 (rounded to fp32 right after, like
torch's bias corrections), and an fp32 fma as an exact fp64 product plus an fp64 sum rounded to fp32 (the
interpreter's own fma rounds the product to fp32 first; this form can still round twice, in rare
near-halfway cases). On the GPU both kernels are compiled without automatic fma contraction
(``enable_fp_fusion=False`` in ops.py), so only the fmas written here are fused.

Mixed dtypes (moments in another dtype than the weight) use the same arithmetic; torch's fused kernel
has a separate mixed-precision functor for them, with bias corrections in fp64, so the bit-exact target
on CUDA is the same-dtype case.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from sonar_kernels.kernels.common import round_to
from sonar_kernels.kernels.master_weights import load_weight, store_weight

# 8 elements per thread: with 8 warps (4 per thread) ptxas spilled 8 bytes in the fp16 fp64-arithmetic
# build on sm_80 once the hyperparameters came from memory (make kernel-report).
ADAMW_CONFIG = {"BLOCK": 1024, "num_warps": 4}
# The split path's AdamW with bf16 master weights (a remainder or stochastic rounding): 8 warps, 4 elements
# a thread (stochastic rounding's hash in the fp64 arithmetic spilled 8 bytes at 4 warps on sm_90a).
ADAMW_MASTER_CONFIG = {"BLOCK": 1024, "num_warps": 8}


@triton.jit
def _pow64(base, exponent, INTERPRET: tl.constexpr):
    """fp64 base ** exponent for 0 <= base < 1 (libdevice pow, the device pow torch's kernel calls)."""
    if INTERPRET:
        return tl.exp2(exponent.to(tl.float64) * tl.log2(base))
    else:
        return libdevice.pow(base, exponent.to(tl.float64))


@triton.jit
def _fma(a, b, c, INTERPRET: tl.constexpr):
    """fp32 a * b + c with one rounding."""
    if INTERPRET:
        return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def adamw_scalars_of(step, hyper_ptr, powers_ptr, ARITHMETIC: tl.constexpr, INTERPRET: tl.constexpr):
    """(step_size, bc2_sqrt) in fp32 of the fp32 step count ``step`` (already incremented; a value:
    kernels/update_steps.py computes it) and the hyperparameters at ``hyper_ptr``, each loaded just before
    its use (libdevice's pow is a call: nothing loaded early has to survive it); the "fp32" arithmetic reads
    torch's fp32 powers of the betas at ``powers_ptr`` instead of computing them (the module docstring says
    why). Once per update, in ``update_begin_kernel``: the update kernels read the scalars instead of each
    program calling libdevice's pow."""
    if ARITHMETIC == "fp32":
        bias_correction1 = 1.0 - tl.load(powers_ptr)
        bias_correction2 = 1.0 - tl.load(powers_ptr + 1)
        step_size = tl.div_rn(tl.load(hyper_ptr).to(tl.float32), bias_correction1)
    else:
        bias_correction1 = (1.0 - _pow64(tl.load(hyper_ptr + 1), step, INTERPRET)).to(tl.float32)
        bias_correction2 = (1.0 - _pow64(tl.load(hyper_ptr + 2), step, INTERPRET)).to(tl.float32)
        step_size = (tl.load(hyper_ptr) / bias_correction1.to(tl.float64)).to(tl.float32)
    return step_size, tl.sqrt_rn(bias_correction2)


@triton.jit
def _adamw_math(
    p, g, m, v, step_size, bc2_sqrt, hyper_ptr, ARITHMETIC: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One AdamW step on fp32 tiles, the fp64 hyperparameters read at ``hyper_ptr`` (each where it is
    used, so that none stays live in registers longer); returns the new (p, m, v) in fp32."""
    lr = tl.load(hyper_ptr)
    weight_decay = tl.load(hyper_ptr + 4)
    if ARITHMETIC == "fp32":
        if weight_decay != 0.0:
            lr_wd = lr.to(tl.float32) * weight_decay.to(tl.float32)
            p = _fma(-lr_wd, p, p, INTERPRET)
        beta1 = tl.load(hyper_ptr + 1).to(tl.float32)
        m = _fma(beta1, m, _fma(-beta1, g, g, INTERPRET), INTERPRET)
        gg = g * g
        beta2 = tl.load(hyper_ptr + 2).to(tl.float32)
        v = _fma(beta2, v, _fma(-beta2, gg, gg, INTERPRET), INTERPRET)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + tl.load(hyper_ptr + 3).to(tl.float32)
    else:
        if weight_decay != 0.0:
            p = (p.to(tl.float64) - lr * weight_decay * p.to(tl.float64)).to(tl.float32)
        g64 = g.to(tl.float64)
        beta1 = tl.load(hyper_ptr + 1)
        m = (beta1 * m.to(tl.float64) + (1.0 - beta1) * g64).to(tl.float32)
        beta2 = tl.load(hyper_ptr + 2)
        v = (beta2 * v.to(tl.float64) + (1.0 - beta2) * g64 * g64).to(tl.float32)
        denom = (tl.div_rn(tl.sqrt_rn(v), bc2_sqrt).to(tl.float64) + tl.load(hyper_ptr + 3)).to(tl.float32)
    p = p - tl.div_rn(step_size * m, denom)
    return p, m, v


@triton.jit
def clip_tile(grad, v, mask, hyper_ptr, GRAD_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Expert clipping (docs/design.md, "Expert clipping") of a gradient tile before its AdamW step, with
    the hyperparameter tensor's clipping entries (``hyper_ptr`` [7]: ..., spike_threshold, grad_scale):

    1. the lagged global-norm coefficient: g = round(g * grad_scale), the product in fp32, rounded to
       GRAD_DTYPE (torch's ``grad.mul_(clip_coef)``); grad_scale 1 leaves g as it is;
    2. SPAM's spike rule: where g * g > theta * v and v > 0 (fp32; v the element's exp_avg_sq before this
       step's update, theta = fp32(spike_threshold)), g = sign(g) * sqrt(theta * v), rounded to
       GRAD_DTYPE; theta = inf leaves every g (theta * v is inf or NaN, no g * g is greater).

    ``grad``: fp32 values of GRAD_DTYPE; ``v``: fp32. Returns (the clipped fp32 tile, the number of
    elements the spike rule replaced, int32)."""
    scale = tl.load(hyper_ptr + 6).to(tl.float32)
    grad = round_to(grad * scale, GRAD_DTYPE, INTERPRET).to(tl.float32)
    limit = v * tl.load(hyper_ptr + 5).to(tl.float32)
    spike = (grad * grad > limit) & (v > 0.0) & mask
    bound = tl.sqrt_rn(limit)
    grad = tl.where(spike, tl.where(grad < 0.0, -bound, bound), grad)
    grad = round_to(grad, GRAD_DTYPE, INTERPRET).to(tl.float32)
    return grad, tl.sum(spike.to(tl.int32))


@triton.jit
def adamw_tile(
    grad,  # [BLOCK_M, BLOCK_N] fp32, already rounded to the gradient dtype
    offs,  # [BLOCK_M, BLOCK_N] int64 element offsets, shared by W, exp_avg and exp_avg_sq
    mask,
    w_ptr,  # REMAINDER: the bf16 weight's int16 bits
    exp_avg_ptr,
    exp_avg_sq_ptr,
    remainder_ptr,  # REMAINDER: the int16 remainders (W's offsets); else not read
    rng_ptr,  # STOCHASTIC: [2] int64, the tensor's seed and the update's step; else not read
    index,  # STOCHASTIC: [BLOCK_M, BLOCK_N] int64, each element's offset in the tensor (the stream's counter)
    step_size,
    bc2_sqrt,
    hyper_ptr,  # [5] fp64: lr, beta1, beta2, eps, weight_decay ([7] with CLIP: spike_threshold, grad_scale)
    ARITHMETIC: tl.constexpr,
    REMAINDER: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    CLIP: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Load W, exp_avg, exp_avg_sq at ``offs``, apply :func:`_adamw_math` with ``grad`` (with CLIP, first
    :func:`clip_tile` with the loaded exp_avg_sq), store all three; returns the number of elements the spike
    rule replaced (0 without CLIP).
    With REMAINDER (docs/design.md, "bf16 master weights") the weight is the fp32 master merged from W's
    bits and the remainder, stored split again; with STOCHASTIC the bf16 weight (read as fp32) is stored as
    its stochastic rounding (W through its int16 bits), the stream's key and counter at ``rng_ptr`` and
    ``index``. :func:`adamw_tile_load` then :func:`adamw_tile_store` (which a caller may also call apart, to
    issue a tile's loads before another tile's stores)."""
    p, m, v = adamw_tile_load(
        offs, mask, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, remainder_ptr, REMAINDER, STOCHASTIC
    )
    return adamw_tile_store(
        grad, p, m, v, offs, mask, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, remainder_ptr, rng_ptr, index, step_size,
        bc2_sqrt, hyper_ptr, ARITHMETIC, REMAINDER, STOCHASTIC, CLIP, GRAD_DTYPE, INTERPRET,
    )  # fmt: skip


@triton.jit
def adamw_tile_load(
    offs, mask, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, remainder_ptr, REMAINDER: tl.constexpr, STOCHASTIC: tl.constexpr
):  # fmt: skip
    """The tile's state as :func:`adamw_tile` reads it: (W: fp32 merged with its remainder, or the bf16 bits
    read as fp32 (``master_weights.load_weight``), else in its own dtype; exp_avg and exp_avg_sq in their
    own dtypes). Values kept in their dtypes hold half the registers of fp32 ones until they are used."""
    if REMAINDER or STOCHASTIC:
        p = load_weight(w_ptr, offs, mask, remainder_ptr, REMAINDER, STOCHASTIC)
    else:
        p = tl.load(w_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    return p, m, v


@triton.jit
def adamw_tile_store(
    grad, p, m, v, offs, mask, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, remainder_ptr, rng_ptr, index, step_size,
    bc2_sqrt, hyper_ptr, ARITHMETIC: tl.constexpr, REMAINDER: tl.constexpr, STOCHASTIC: tl.constexpr,
    CLIP: tl.constexpr, GRAD_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """:func:`adamw_tile` after its loads: (``p``, ``m``, ``v``) as :func:`adamw_tile_load` returned them;
    the clipping, the AdamW step and the stores; returns the spike rule's count (0 without CLIP)."""
    p = p.to(tl.float32)
    m = m.to(tl.float32)
    v = v.to(tl.float32)
    clipped = 0
    if CLIP:
        grad, clipped = clip_tile(grad, v, mask, hyper_ptr, GRAD_DTYPE, INTERPRET)
    p, m, v = _adamw_math(p, grad, m, v, step_size, bc2_sqrt, hyper_ptr, ARITHMETIC, INTERPRET)
    store_weight(p, w_ptr, offs, mask, remainder_ptr, rng_ptr, index, REMAINDER, STOCHASTIC, INTERPRET)
    tl.store(exp_avg_ptr + offs, round_to(m, exp_avg_ptr.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, round_to(v, exp_avg_sq_ptr.dtype.element_ty, INTERPRET), mask=mask)
    return clipped


@triton.jit
def adamw_kernel(
    # pointers
    w_ptr,  # [numel] fp32/bf16/fp16, read and written
    grad_ptr,  # [numel] gradient dtype, read
    exp_avg_ptr,  # [numel] moments dtype, read and written
    exp_avg_sq_ptr,  # [numel] moments dtype, read and written
    scalars_ptr,  # [2] fp32, read: step_size, bc2_sqrt (kernels/update_steps.py, update_begin_kernel)
    skip_ptr,  # [] fp32, read: the update is skipped when != 0
    hyper_ptr,  # [5] fp64, read: lr, beta1, beta2, eps, weight_decay ([7] with CLIP: + spike_threshold, grad_scale)
    remainder_ptr,  # REMAINDER: [numel] int16, read and written (w_ptr: the bf16 weight's int16 bits)
    rng_ptr,  # STOCHASTIC: [2] int64, read: the seed and the step (w_ptr: the bf16 weight's int16 bits)
    clipped_ptr,  # CLIP: [grid] int32, written: each program's count of elements the spike rule replaced
    # sizes
    numel,
    index_base,  # STOCHASTIC: the tensor offset of element 0 (a chunk of experts: its first element's)
    # meta-parameters
    BLOCK: tl.constexpr,
    ARITHMETIC: tl.constexpr,
    REMAINDER: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    CLIP: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Standalone AdamW (the split path): W, exp_avg, exp_avg_sq updated in place from grad (with CLIP,
    clipped first: :func:`clip_tile`), unless the flag at ``skip_ptr`` is set.

    Grid: (cdiv(numel, BLOCK),).
    Preconditions: the four tensors are dense with identical strides (element i of the storage order is
    the same element in each), so they are walked as flat arrays; with STOCHASTIC, element i's stream
    counter is index_base + i (its offset in the whole tensor when these are a chunk of its experts).
    """
    pid = tl.program_id(0)
    if tl.load(skip_ptr) != 0.0:
        return
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    step_size = tl.load(scalars_ptr)
    bc2_sqrt = tl.load(scalars_ptr + 1)
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    clipped = adamw_tile(
        grad, offs, mask, w_ptr, exp_avg_ptr, exp_avg_sq_ptr, remainder_ptr, rng_ptr, index_base + offs,
        step_size, bc2_sqrt, hyper_ptr, ARITHMETIC, REMAINDER, STOCHASTIC, CLIP, grad_ptr.dtype.element_ty,
        INTERPRET,
    )  # fmt: skip
    if CLIP:
        tl.store(clipped_ptr + pid, clipped)
