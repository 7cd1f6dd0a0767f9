"""AdamW on one element, in torch ops: the "fp64" arithmetic every rule beyond torch's own AdamW follows.

The Triton tile that computes the same thing operation for operation is ``_adamw_math`` in
``sonar_kernels/kernels/adamw.py`` (its ``ARITHMETIC == "fp64"`` form); with exact moments and no master
weights the torch backend runs torch's own AdamW instead (``sonar_kernels/ops/torch_backend/adamw.py``).
"""

from __future__ import annotations

import math

import torch

__all__ = ["adamw_fp64", "adamw_scalars", "grad_limit"]


def grad_limit(moments_dtype: torch.dtype) -> float:
    """The largest gradient magnitude an in-backward AdamW update takes with exp_avg_sq in
    ``moments_dtype``: the largest power of two whose square that dtype holds (2**63 for float32 and
    bfloat16, 2**7 for float16). exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g then stays
    finite for every beta2."""
    return 2.0 ** (math.floor(math.log2(torch.finfo(moments_dtype).max)) // 2)


def adamw_scalars(step: torch.Tensor, hyper: torch.Tensor) -> torch.Tensor:
    """The [2] fp32 bias-corrected scalars of an update in the "fp64" arithmetic, on ``step``'s device, no
    host read: ``step_size = fp32(lr / fp32(1 - beta1 ** step))`` and ``bc2_sqrt = sqrt(fp32(1 - beta2 **
    step))``, the powers and the quotient in fp64, the square root correctly rounded to fp32. ``step``: the
    0-dim fp32 step count, already incremented; ``hyper``: the [5] fp64 (lr, beta1, beta2, eps,
    weight_decay). Both backends read this tensor, so its last bits are the same for both."""
    step64 = step.to(torch.float64)
    bc1 = (1.0 - torch.pow(hyper[1], step64)).to(torch.float32)
    bc2 = (1.0 - torch.pow(hyper[2], step64)).to(torch.float32)
    step_size = (hyper[0] / bc1.to(torch.float64)).to(torch.float32)
    return torch.stack([step_size, torch.sqrt(bc2.to(torch.float64)).to(torch.float32)])


def adamw_fp64(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    scalars: torch.Tensor,
    hyper: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step in the "fp64" arithmetic, out of place: returns the new fp32 (p, m, v). Each line
    is one rounding to fp32 at its end:

        p = fp32(p - lr * weight_decay * p)                 (fp64; p unchanged when weight_decay == 0)
        m = fp32(beta1 * m + (1 - beta1) * g)               (fp64)
        v = fp32(beta2 * v + (1 - beta2) * g * g)           (fp64)
        denom = fp32(fp32(sqrt(v) / bc2_sqrt) + eps)        (sqrt correctly rounded; the sum in fp64)
        p = p - (step_size * m) / denom                     (fp32)

    ``p``: any float dtype, read as fp32; ``g``, ``m``, ``v``: fp32; ``scalars``: :func:`adamw_scalars`;
    ``hyper``: [5] (or [7]) fp64, (lr, beta1, beta2, eps, weight_decay) first. What the Triton kernels
    compute op for op, so both backends give the same bits from the same operands."""
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
