"""Launchers of the small steps around one expert tensor's AdamW update (``kernels/update_steps.py``): what
used to be some ten torch ops and a launch per update, each a CUDA kernel and a trip through the host, in two
launches (docs/design.md, "Backward and the fused update", the fused path). No host sync; the same bits."""

from __future__ import annotations

import torch

from sonar_kernels.kernels.update_steps import update_begin_kernel, update_end_kernel
from sonar_kernels.ops import common

# Flags read per iteration of the begin kernel's one program (a wgrad's grid: up to some 16K programs).
FLAGS_BLOCK = 1024


def begin_update(
    flags: torch.Tensor,
    step: torch.Tensor,
    hyper: torch.Tensor,
    arithmetic: str,
    *,
    scalars: bool,
    interpret: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """After the check pass: the skip decision (the largest of ``flags``, [n] fp32 of 0.0 / 1.0), ``step``
    advanced by 1 - skip in place, and with ``scalars`` the update's [2] fp32 step_size and sqrt(bc2) at the
    advanced step (``kernels/adamw.py``, ``adamw_scalars_of``), in one launch.

    Returns:
        (skip: 0-dim fp32, the scalars or None).
    """
    device = step.device
    skip = common.empty((), torch.float32, device)
    out = common.empty((2,), torch.float32, device) if scalars else skip
    # The "fp32" arithmetic's beta ** step is torch's own pow (kernels/adamw.py), here of the step the update
    # advances to: the scalars are read only when it is not skipped, and then step + 1 is that step.
    fp32_powers = scalars and arithmetic == "fp32"
    powers = torch.pow(hyper[1:3].to(torch.float32), step + 1.0) if fp32_powers else out
    update_begin_kernel[(1,)](
        flags, step, hyper, powers, skip, out, flags.numel(),
        BLOCK=FLAGS_BLOCK, SCALARS=scalars, ARITHMETIC=arithmetic, INTERPRET=interpret, num_warps=1,
        enable_fp_fusion=False,
    )  # fmt: skip
    return skip, out if scalars else None


def end_update(
    skip: torch.Tensor,
    grad_norm_sq: torch.Tensor | None,
    skipped: torch.Tensor | None,
    clipped: torch.Tensor | None,
    clipped_in: torch.Tensor | None,
) -> None:
    """After the update's launches: ``grad_norm_sq`` (holding the sum of squares) set to inf when skipped,
    ``skipped`` + 1 when skipped, ``clipped`` = ``clipped_in`` (an int64 count) or 0; one launch, or none
    when there is nothing to write."""
    if grad_norm_sq is None and skipped is None and clipped is None:
        return
    any_ = skip  # the pointer of an argument that is not read
    update_end_kernel[(1,)](
        skip, any_ if grad_norm_sq is None else grad_norm_sq, any_ if skipped is None else skipped,
        any_ if clipped is None else clipped, any_ if clipped_in is None else clipped_in,
        HAS_NORM=grad_norm_sq is not None, HAS_SKIPPED=skipped is not None, HAS_CLIPPED=clipped is not None,
        HAS_CLIPPED_IN=clipped_in is not None, num_warps=1,
    )  # fmt: skip
