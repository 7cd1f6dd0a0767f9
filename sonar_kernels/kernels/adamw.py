"""AdamW in registers: the arithmetic shared by the fused wgrad epilogue and the standalone AdamW kernel.

The arithmetic is torch's fused CUDA AdamW (``torch.optim.AdamW(fused=True)``, same-dtype path,
ATen/native/cuda/fused_adam_utils.cuh as shipped with torch 2.13), everything in fp32:

    lr, beta1, beta2, eps, weight_decay rounded to fp32;  step read as fp32 after its increment
    bc1 = 1 - powf(beta1, step);  bc2_sqrt = sqrtf(1 - powf(beta2, step));  step_size = lr / bc1
    p = fma(-(lr * weight_decay), p, p)                 (skipped when weight_decay == 0)
    m = fma(beta1, m, fma(-beta1, g, g))
    v = fma(beta2, v, fma(-beta2, g * g, g * g))
    p = p - (step_size * m) / (sqrt(v) / bc2_sqrt + eps)

with IEEE division and square root (``div_rn`` / ``sqrt_rn``), p, m and v loaded as fp32 and rounded
to their own dtypes once, at the store. Both kernels call :func:`_adamw_math`, so the fused epilogue and
the split path (wgrad written to memory, then :func:`_adamw_kernel`) give the same bits.

Under the interpreter (``INTERPRET``) ``tl.fma`` is a multiply and an add (two roundings) and libdevice
is not available, so fma is evaluated exactly in fp64 and rounded once, and powf as exp2(step * log2(beta))
in fp64 rounded to fp32.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from sonar_kernels.kernels.common import _round_to

ADAMW_CONFIG = {"BLOCK": 1024, "num_warps": 4}


@triton.jit
def _fma(a, b, c, INTERPRET: tl.constexpr):
    """fp32 a * b + c with one rounding."""
    if INTERPRET:
        return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def _powf(base, exponent, INTERPRET: tl.constexpr):
    """fp32 base ** exponent (libdevice powf, as torch's kernel calls it) for 0 <= base < 1."""
    if INTERPRET:
        return tl.exp2(exponent.to(tl.float64) * tl.log2(base.to(tl.float64))).to(tl.float32)
    else:
        return libdevice.pow(base, exponent)


@triton.jit
def _adamw_scalars(step_ptr, lr, beta1, beta2, weight_decay, INTERPRET: tl.constexpr):
    """(lr * weight_decay, step_size, bc2_sqrt) in fp32 from the step count at ``step_ptr`` (fp32)."""
    step = tl.load(step_ptr).to(tl.float32)
    lr = lr.to(tl.float32)
    bias_correction1 = 1.0 - _powf(beta1.to(tl.float32), step, INTERPRET)
    bias_correction2 = 1.0 - _powf(beta2.to(tl.float32), step, INTERPRET)
    step_size = tl.div_rn(lr, bias_correction1)
    bc2_sqrt = tl.sqrt_rn(bias_correction2)
    return lr * weight_decay.to(tl.float32), step_size, bc2_sqrt


@triton.jit
def _adamw_math(p, g, m, v, lr_wd, step_size, bc2_sqrt, beta1, beta2, eps, INTERPRET: tl.constexpr):
    """One AdamW step on fp32 tiles; returns the new (p, m, v) in fp32. See the module docstring."""
    beta1 = beta1.to(tl.float32)
    beta2 = beta2.to(tl.float32)
    if lr_wd != 0.0:
        p = _fma(-lr_wd, p, p, INTERPRET)
    m = _fma(beta1, m, _fma(-beta1, g, g, INTERPRET), INTERPRET)
    gg = g * g
    v = _fma(beta2, v, _fma(-beta2, gg, gg, INTERPRET), INTERPRET)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps.to(tl.float32)
    p = p - tl.div_rn(step_size * m, denom)
    return p, m, v


@triton.jit
def _adamw_tile(
    grad,  # [BLOCK_M, BLOCK_N] fp32, already rounded to the gradient dtype
    offs,  # [BLOCK_M, BLOCK_N] int64 element offsets, shared by W, exp_avg and exp_avg_sq
    mask,
    w_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    lr_wd,
    step_size,
    bc2_sqrt,
    beta1,
    beta2,
    eps,
    INTERPRET: tl.constexpr,
):
    """Load W, exp_avg, exp_avg_sq at ``offs``, apply :func:`_adamw_math` with ``grad``, store all three."""
    p = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p, m, v = _adamw_math(p, grad, m, v, lr_wd, step_size, bc2_sqrt, beta1, beta2, eps, INTERPRET)
    tl.store(w_ptr + offs, _round_to(p, w_ptr.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(exp_avg_ptr + offs, _round_to(m, exp_avg_ptr.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, _round_to(v, exp_avg_sq_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _adamw_kernel(
    # pointers
    w_ptr,  # [numel] fp32/bf16/fp16, read and written
    grad_ptr,  # [numel] gradient dtype, read
    exp_avg_ptr,  # [numel] moments dtype, read and written
    exp_avg_sq_ptr,  # [numel] moments dtype, read and written
    step_ptr,  # [] fp32, read (already incremented)
    # sizes
    numel,
    # hyperparameters (Python floats; rounded to fp32 in the kernel)
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    # meta-parameters
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Standalone AdamW (the split path): W, exp_avg, exp_avg_sq updated in place from grad.

    Grid: (cdiv(numel, BLOCK),).
    Preconditions: the four tensors are dense with identical strides (element i of the storage order is
    the same element in each), so they are walked as flat arrays.
    """
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    lr_wd, step_size, bc2_sqrt = _adamw_scalars(step_ptr, lr, beta1, beta2, weight_decay, INTERPRET)
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _adamw_tile(
        grad, offs, mask, w_ptr, exp_avg_ptr, exp_avg_sq_ptr,
        lr_wd, step_size, bc2_sqrt, beta1, beta2, eps, INTERPRET,
    )  # fmt: skip
