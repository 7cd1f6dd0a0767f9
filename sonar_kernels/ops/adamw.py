"""The AdamW update outside the wgrad epilogue, and the choices the epilogue's arithmetic follows.

``torch_adamw_`` applies torch's own AdamW (``torch.optim.adamw.adamw``, with torch.optim.AdamW's foreach
and fused flags) to one tensor, skipping the update as a whole for a non-finite or too large gradient as
the Triton kernels do: the update of the torch backend, and of a gradient that reached ``.grad``.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import torch
from torch.optim.adamw import adamw as torch_adamw

from sonar_kernels.ops.common import inf_norm, whole


def grad_limit(moments_dtype: torch.dtype) -> float:
    """The largest gradient magnitude an in-backward AdamW update takes with exp_avg_sq in
    ``moments_dtype``: the largest power of two whose square that dtype holds (2**63 for float32 and
    bfloat16, 2**7 for float16). exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g then stays
    finite for every beta2."""
    return 2.0 ** (math.floor(math.log2(torch.finfo(moments_dtype).max)) // 2)


@functools.cache
def torch_fused_adamw_arithmetic() -> str:
    """How the installed torch's fused CUDA AdamW computes, read from the ATen header its wheel ships.

    Returns:
        "fp32" when its same-dtype kernel rounds the hyperparameters to fp32 and uses fma (torch 2.13),
        "fp64" otherwise (hyperparameters as C++ doubles, docs/design.md's account; also when the header is
        missing, with a warning).
    """
    header = Path(torch.__file__).parent / "include" / "ATen" / "native" / "cuda" / "fused_adam_utils.cuh"
    try:
        source = "".join(header.read_text().split())
    except OSError:
        warnings.warn(
            f"{header} not found: the in-backward AdamW uses the fp64 arithmetic, which may differ from "
            "torch.optim.AdamW(fused=True) in the last bits",
            stacklevel=2,
        )
        return "fp64"
    markers = ("std::fma(-beta1,grad,grad)", "beta1_opmath=static_cast<opmath_t>(beta1)")
    return "fp32" if all(m in source for m in markers) else "fp64"


def adamw_arithmetic(device: torch.device) -> str:
    """The arithmetic of the in-backward AdamW on ``device`` (see sonar_kernels/kernels/adamw.py): on
    NVIDIA CUDA that of torch's fused AdamW there (the bit-exact target); elsewhere (CPU, ROCm) "fp64",
    within a few ulps of torch's AdamW."""
    if device.type == "cuda" and torch.version.hip is None:
        return torch_fused_adamw_arithmetic()
    return "fp64"


def torch_adamw_(
    weight: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyperparameters: tuple[float | torch.Tensor, ...],
    grad_norm_sq: torch.Tensor,
    skipped: torch.Tensor,
    *,
    foreach: bool | None,
    fused: bool | None,
) -> None:
    """torch's AdamW on one tensor, in place: ``weight``, ``exp_avg``, ``exp_avg_sq`` and ``step``.

    Skipped as the Triton update is (weight, moments and step unchanged, ``skipped`` + 1, norm inf) when
    ``grad`` has an entry that is NaN, infinite or beyond :func:`grad_limit` of the moments' dtype: with
    ``fused=True`` through torch's ``found_inf`` (no host sync); torch's other AdamW paths take no such
    input, so the decision is read on the host there (a sync on a GPU). ``grad_norm_sq`` receives the
    gradient's squared L2 norm.

    Args:
        hyperparameters: (lr, beta1, beta2, eps, weight_decay), each a Python float or a one-element
            tensor, as a torch.optim.AdamW parameter group holds them: passed to torch's AdamW unchanged,
            so that a tensor lr or tensor betas get torch's arithmetic for tensor values (bias corrections
            and step size computed in the tensor's dtype) as in torch.optim.AdamW.step.
        foreach, fused: torch.optim.AdamW's flags.
    """
    lr, beta1, beta2, eps, weight_decay = hyperparameters
    with torch.no_grad():
        found = whole(~(inf_norm(grad) <= grad_limit(exp_avg_sq.dtype)))
        step_before = step.clone()
        # Weight, gradient and moments of one dtype: torch's AdamW on them as they are (standard training's
        # bits). Mixed dtypes (moments_dtype, grad_dtype): the rule of the Triton epilogue (docs/design.md,
        # "Arithmetic"): all four as fp32, the arithmetic in fp32, each stored once in its own dtype.
        tensors = (weight, grad, exp_avg, exp_avg_sq)
        mixed = len({t.dtype for t in tensors}) > 1
        p, g, m, v = (t.float() for t in tensors) if mixed else tensors
        try:
            if fused or not bool(found):
                torch_adamw(
                    [p], [g], [m], [v], [], [step],
                    foreach=foreach, fused=fused, capturable=False, amsgrad=False, beta1=beta1, beta2=beta2,
                    lr=lr, weight_decay=weight_decay, eps=eps, maximize=False,
                    found_inf=found.float() if fused else None,
                )  # fmt: skip
                for stored, computed in ((weight, p), (exp_avg, m), (exp_avg_sq, v)):
                    if computed is not stored:
                        stored.copy_(computed)
        except BaseException:
            # A refused update (e.g. a dtype the chosen torch kernel rejects) changes nothing.
            step.copy_(step_before)
            raise
        norm_sq = whole(torch.linalg.vector_norm(grad, dtype=torch.float32)).square()
        grad_norm_sq.copy_(torch.where(found, float("inf"), norm_sq))
        skipped.add_(found.long())
