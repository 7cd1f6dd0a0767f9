"""The refusal of an expert-parallel experts module that FSDP2 manages: its reduce-scatter would average the
gradients of *different* experts (rank r holds experts [r * E / P, (r + 1) * E / P)), and the update would run
on that mixture (docs/distributed.md, "Expert parallel with the dense layers on FSDP2"). Checked at the
experts' forward (``nn/experts.py``; the transformers experts that ``shard_experts`` made expert-parallel, in
``integrations/transformers_experts.py``) and by :func:`sonar_kernels.nn.fully_shard_dense` before it shards."""

from __future__ import annotations

import weakref

import torch.distributed as dist
from torch import nn

__all__ = ["check_not_fsdp_managed"]


def _fsdp_managed(module: nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``, of ``module`` itself or of a module above it without
    ``ignored_params``) manages one of ``module``'s own parameters."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if isinstance(module, FSDPModule):
        return True
    own = list(module._parameters.values())
    if any(isinstance(p, DTensor) for p in own):
        return True
    from torch.distributed._composable_state import _module_state_mapping

    for state in list(_module_state_mapping.values()):
        state = state() if isinstance(state, weakref.ReferenceType) else state
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()) if group is not None else ():
            info = getattr(fsdp_param, "_module_info", None)
            if info is not None and info.module is module:
                return True
    return False


def check_not_fsdp_managed(module: nn.Module, ep_group) -> None:
    """Refuse an expert-parallel experts module whose parameters FSDP2 manages.

    Raises:
        ValueError: ``fully_shard`` was applied to ``module``, or to a module above it without the expert
            tensors in ``ignored_params``: FSDP2 would reduce-scatter (average) the gradients of different
            experts over the ranks of ``ep_group``.
    """
    if _fsdp_managed(module):
        size = dist.get_world_size(ep_group)
        raise ValueError(
            f"{type(module).__name__} is expert-parallel over {size} ranks (ep_group), and FSDP2 manages its "
            "expert tensors: its reduce-scatter would average the gradients of different experts (each rank "
            "holds its own), and the update would diverge from training. Do not fully_shard the experts "
            "module; fully_shard the dense layers and the root with ignored_params= the expert tensors "
            "(sonar_kernels.nn.fully_shard_dense does it; docs/distributed.md). Nothing was updated."
        )
