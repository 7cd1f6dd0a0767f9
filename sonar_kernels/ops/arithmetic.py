"""The choices the update's arithmetic follows on each device, shared by both backends: which arithmetic the
in-backward AdamW computes in (that of torch's fused AdamW on NVIDIA CUDA, else "fp64"; docs/design.md,
"Arithmetic"), whether torch has a fused AdamW for a device and dtype, and the cheap bound that spares a
wgrad's exact overflow check.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from sonar_kernels.ops.common import inf_norm


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


def overflow_possible(
    bound: tuple, grad_in: torch.Tensor | None, limit: float, operand_limit: float
) -> torch.Tensor:
    """0.0 (a 0-dim fp32 device tensor) when no entry of the wgrad, rounded, can exceed ``limit`` in
    magnitude and no GEMM operand can overflow ``operand_limit`` when rounded to the GEMM dtype, else
    1.0: the cheap test that spares the exact check pass (the Triton backend's in ``ops/triton_backend/wgrad.py``, the
    torch backend's in :func:`torch_adamw_chunked_`).

    An entry of sum_r P[r]^T Q[r] over at most n rows with |P| <= p, |Q| <= q is at most n * p * q in
    magnitude; the fp32 accumulation adds at most a factor 1 + n * 2**-23 (2 n unit roundoffs), the
    roundings to the GEMM and gradient dtypes (and of the sum with grad_in) under 1.03 together. A NaN
    or inf anywhere makes the bound NaN or inf, so the check pass runs.
    """
    p_max, q_max, most_rows = bound
    total = most_rows * p_max * q_max * (1.0 + most_rows * 2.0**-23)
    if grad_in is not None:
        total = total + inf_norm(grad_in)
    safe = (total * 1.03 <= limit) & (p_max * 1.01 <= operand_limit)
    return (~safe).float()


def has_torch_fused_adamw(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether torch has a fused AdamW (``torch.optim.AdamW(fused=True)``) for tensors of ``device`` and
    ``dtype``, by torch's own rule (``torch.optim.optimizer._device_dtype_check_for_fused``): a floating
    dtype on a device type of ``torch.utils._foreach_utils._get_fused_kernels_supported_devices()`` (CPU and
    CUDA among them; torch 2.13's CPU kernel takes float32, bfloat16, float16 and float64). Never the meta
    device."""
    return dtype.is_floating_point and torch.device(device).type in _fused_adamw_devices()


@functools.cache
def _fused_adamw_devices() -> frozenset[str]:
    """torch's list of device types with a fused AdamW, read once (it is rebuilt at every call)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return frozenset(_get_fused_kernels_supported_devices())
