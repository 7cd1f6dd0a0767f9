"""Host launchers and the ``sonar_kernels::`` custom ops, in two backend rooms over shared helpers.

- ``library``: the custom ops, each running the backend a layer names (its room's functions of the same
  names); ``grad_update``: the update of a gradient that reached ``.grad`` with 8-bit moments or
  stochastic rounding, FSDP2 shards included;
- ``triton_backend/``: the Triton launchers and their tile configurations (``forward``, ``backward``: the
  forward and the backward's core; ``wgrad`` with ``wgrad_launch`` and ``wgrad_update``: one expert
  tensor's wgrad with the fused AdamW epilogue or its split path; ``configs``, ``tma``; ``update_bound``,
  ``update_steps``; ``moments_8bit`` and ``shard_update``: the standalone update kernels' launchers);
- ``torch_backend/``: the expert MLP on torch's GEMMs (``mlp``, with ``grouped_gemm``, ``glu`` and
  ``expert_gradient`` and ``wgrad``: the wgrad whole or by chunks of experts) and the updates outside the wgrad
  epilogue (``update``: the torch backend's in-backward update; ``adamw``: torch's AdamW on one tensor;
  ``fp64_update`` with ``cpu_update``: 8-bit moments and stochastic rounding in the "fp64" arithmetic);
- shared by both rooms, which import nothing of each other (an import-linter contract): ``validation``
  (argument checks: ValueError / TypeError before any kernel runs), ``arithmetic`` (the arithmetic the
  update follows on each device), ``bias`` (the expert biases' share of the backward) and ``common``
  (buffers, the device context, layouts).

``sonar_kernels.ops.configs`` is the Triton room's tile configurations and their tuner
(``configs.pin``, ``configs.timings``), named here as before the rooms.
"""

from sonar_kernels.ops import library
from sonar_kernels.ops.arithmetic import (
    adamw_arithmetic,
    has_torch_fused_adamw,
    overflow_possible,
    torch_fused_adamw_arithmetic,
)
from sonar_kernels.ops.common import is_dense, triton_interpreting, whole
from sonar_kernels.ops.torch_backend.adamw import torch_adamw_
from sonar_kernels.ops.triton_backend import configs
from sonar_kernels.ops.triton_backend.backward import moe_mlp_bwd
from sonar_kernels.ops.triton_backend.forward import moe_mlp_fwd, routing_block_config, routing_metadata
from sonar_kernels.ops.triton_backend.wgrad import AdamWUpdate, GradAccumulator
from sonar_kernels.ops.validation import check_hyperparameters, check_moe_mlp_args
from sonar_kernels.rules.adamw import grad_limit
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
    "configs",
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
