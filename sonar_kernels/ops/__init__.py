"""Host launchers and the ``sonar_kernels::`` custom ops.

- ``common``: buffer allocation, device context, layout helpers;
- ``validation``: argument checks (ValueError / TypeError before any kernel runs);
- ``forward``, ``backward``, ``wgrad``: the Triton launchers (routing metadata and forward; the backward's
  core: dHpre, the routing-weight gradient, dX; one expert tensor's wgrad with the fused AdamW epilogue);
- ``adamw``: torch's AdamW on one tensor, and the arithmetic the epilogue follows on each device;
- ``moments_8bit``: the 8-bit moments' scheme (codes, scales, the update) in torch ops;
- ``torch_backend``: the expert MLP on torch's GEMMs, with ``grouped_gemm`` (torch's grouped GEMM or an mm
  per expert), ``expert_gradient`` (the wgrad whole or by chunks of experts) and ``glu`` (the gated
  activations and their derivatives);
- ``library``: the custom ops over both backends.
"""

from sonar_kernels.ops import library
from sonar_kernels.ops.adamw import (
    adamw_arithmetic,
    grad_limit,
    has_torch_fused_adamw,
    overflow_possible,
    torch_adamw_,
    torch_fused_adamw_arithmetic,
)
from sonar_kernels.ops.backward import moe_mlp_bwd
from sonar_kernels.ops.common import is_dense, triton_interpreting, whole
from sonar_kernels.ops.forward import moe_mlp_fwd, routing_block_config, routing_metadata
from sonar_kernels.ops.validation import check_hyperparameters, check_moe_mlp_args
from sonar_kernels.ops.wgrad import AdamWUpdate, GradAccumulator
from sonar_kernels.specs import BACKENDS, MAX_EXPERTS, SUPPORTED_DTYPES

__all__ = [
    "BACKENDS",
    "MAX_EXPERTS",
    "SUPPORTED_DTYPES",
    "AdamWUpdate",
    "GradAccumulator",
    "adamw_arithmetic",
    "check_hyperparameters",
    "check_moe_mlp_args",
    "grad_limit",
    "has_torch_fused_adamw",
    "is_dense",
    "library",
    "moe_mlp_bwd",
    "moe_mlp_fwd",
    "overflow_possible",
    "routing_block_config",
    "routing_metadata",
    "torch_adamw_",
    "torch_fused_adamw_arithmetic",
    "triton_interpreting",
    "whole",
]
