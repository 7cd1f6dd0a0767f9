"""The split path's 8-bit update on the Triton backend: the launcher of
``sonar_kernels/kernels/moments_8bit.py``'s ``adamw_8bit_kernel`` (the scheme: ``rules/moments_8bit.py``).
"""

from __future__ import annotations

import torch

from sonar_kernels.rules.moments_8bit import scales_shape, tables

__all__ = ["adamw_8bit_triton_"]


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
    index_base: int = 0,
    closed_form: bool = False,
) -> torch.Tensor | None:
    """The split path's update on the Triton backend: ``weight`` and both moments' (codes, scales) updated
    in place by :func:`sonar_kernels.kernels.moments_8bit.adamw_8bit_kernel` from ``grad`` (the weight's
    shape, rounded to the gradient dtype), unless ``skip`` (a 0-dim fp32 device flag) is not 0: the
    arithmetic of ``rules.moments_8bit.adamw_8bit_update``, bit for bit. Every tensor contiguous, the last dimension a
    multiple of ``rules.moments_8bit.BLOCK``. A bf16 ``weight`` with its int16 ``remainder`` is updated as its fp32 master
    (docs/design.md, "bf16 master weights"); with ``rng`` ([2] int64: the tensor's seed and the step) it is
    rounded back stochastically, each element's counter its offset in the tensor plus ``index_base`` (the
    offset of a chunk of experts' first element in the whole tensor). A ``hyper`` of [7] clips the
    gradient first (docs/design.md, "Expert clipping"); returns then the per-program int32 counts of the
    elements the spike rule replaced (zeros when skipped), else None. ``closed_form``: the codes found by the
    quantizer's closed form instead of its binary search (``kernels/moments_8bit.py``, ``quantize_tile``: the
    same codes)."""
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
            hyper if counts is None else counts, R, C, index_base,
            BLOCK_R=config["BLOCK_R"], BLOCK_C=config["BLOCK_C"], REMAINDER=remainder is not None,
            STOCHASTIC=rng is not None, CLIP=clip, INTERPRET=triton_interpreting(), CLOSED_FORM=closed_form,
            num_warps=config["num_warps"], enable_fp_fusion=False,
        )  # fmt: skip
    return counts
