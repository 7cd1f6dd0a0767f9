"""The update of one FSDP2 shard (its local tensors) with 8-bit moments, a bf16 remainder or stochastic
rounding, on the Triton backend: one launch of the split path's standalone update kernel per tensor per step
(``kernels/moments_8bit.py``'s ``adamw_8bit_kernel``; ``kernels/adamw.py``'s ``adamw_kernel`` for exact
moments with stochastic rounding), instead of the torch rules over slices of ``ops/torch_backend/fp64_update.py``'s
``UPDATE_ELEMENTS`` (about 40 ops a slice). The arithmetic is the rules' (``rules/update.py``) bit for bit;
each element's stream counter is its offset in the whole tensor (``index_base``), so a shard computes what
one process computes there (docs/distributed.md, "FSDP2").
"""

from __future__ import annotations

import torch
import triton

from sonar_kernels.kernels.adamw import ADAMW_MASTER_CONFIG, adamw_kernel
from sonar_kernels.ops.common import on_device, triton_interpreting
from sonar_kernels.ops.triton_backend import moments_8bit
from sonar_kernels.rules.adamw import adamw_scalars
from sonar_kernels.rules.moments_8bit import scales_shape

__all__ = ["shard_update_triton_"]


def shard_update_triton_(
    weight: torch.Tensor,
    grad: torch.Tensor,
    moments: tuple,
    state: list[torch.Tensor],
    hyper: torch.Tensor,
    *,
    decided: torch.Tensor,
    remainder: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    index_base: int = 0,
) -> None:
    """AdamW on a shard in place, one Triton launch: ``weight`` (local, contiguous), its ``grad`` (the shard
    of the whole gradient, rounded to the gradient dtype), ``moments`` (exp_avg codes, scales, exp_avg_sq
    codes, scales) with 8-bit moments, else (exp_avg, exp_avg_sq) with a ``seed``; ``state``:
    ``ops/torch_backend/fp64_update.py``'s list (step, grad_norm_sq, skipped, clipped at 2 to 5); ``decided``: the 0-dim
    bool skip decided over the whole gradient (nothing changes where it is set but ``skipped``).
    ``grad_norm_sq`` is the caller's (a norm over the whole tensor).

    Raises:
        ValueError: exact moments without a seed (the exact update has its own path), a tensor that is not
            contiguous, or (8-bit moments) a last dimension that is not a multiple of 32; before anything
            changes.
    """
    step, _norm, skipped, clipped = state[2:6]
    if len(moments) == 2 and seed is None:
        raise ValueError(
            "shard_update_triton_ takes 8-bit moments, or exact moments with a seed (stochastic)"
        )
    # Checked before the step advances: a refusal changes nothing.
    tensors = (weight, grad, *moments, *([] if remainder is None else [remainder]))
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("the shard's update tensors must be contiguous")
    if len(moments) == 4:
        scales_shape(tuple(weight.shape))
    with torch.no_grad():
        step.add_((~decided).float())
        try:
            scalars = adamw_scalars(step, hyper)
            skip = decided.float()
            rng = None if seed is None else torch.stack([seed.reshape(()), step.to(torch.int64)])
            if len(moments) == 4:
                m_codes, m_scales, v_codes, v_scales = moments
                counts = moments_8bit.adamw_8bit_triton_(
                    weight, grad, (m_codes, m_scales), (v_codes, v_scales), scalars, skip, hyper,
                    remainder=remainder, rng=rng, index_base=index_base,
                )  # fmt: skip
            else:
                config = ADAMW_MASTER_CONFIG
                programs = triton.cdiv(weight.numel(), config["BLOCK"])
                clip = hyper.numel() == 7
                counts = torch.zeros(programs, dtype=torch.int32, device=weight.device) if clip else None
                with on_device(weight.device):
                    adamw_kernel[(programs,)](
                        weight.view(torch.int16), grad, *moments, scalars, skip, hyper, hyper, rng,
                        hyper if counts is None else counts, weight.numel(), index_base,
                        BLOCK=config["BLOCK"], ARITHMETIC="fp64", REMAINDER=False, STOCHASTIC=True, CLIP=clip,
                        INTERPRET=triton_interpreting(), num_warps=config["num_warps"], enable_fp_fusion=False,
                    )  # fmt: skip
        except BaseException:
            # A launch refused (a compile error, a bad argument) applied nothing: the step taken back.
            step.sub_((~decided).float())
            raise
        clipped.copy_(counts.sum() if counts is not None else torch.zeros_like(clipped))
        skipped.add_(decided.long())
