"""What SonarAdamW's ``state_dict()`` holds beyond InBackwardAdamW's, and what its ``load_state_dict()``
restores from it (docs/usage.md, "Checkpoints and resume"):

- every parameter that requires grad has a state from the start: a dense parameter with none yet the one
  torch.optim.AdamW creates at its first step; an expert tensor not decided yet (several ranks, before its
  module's first forward: ``is_pending``) the one its in-backward update will start from;
- with ``expert_clipping="lagged"`` the coefficient the next step's expert updates use
  (optim/lagged_clipping.py).

The functions work on the optimizer's public tables (its ``managed``, optim/managed.py) and options.
"""

from __future__ import annotations

import torch

from sonar_kernels.optim import dense, lagged_clipping
from sonar_kernels.optim.expert_state import expert_state, with_cpu_steps
from sonar_kernels.optim.param_groups import torch_adamw_flags
from sonar_kernels.rules.master_weights import tensor_seed

__all__ = ["complete", "restore"]


def complete(optimizer, saved: dict) -> dict:
    """``saved`` (InBackwardAdamW.state_dict's result for ``optimizer``) with the initial states and the
    lagged coefficient of the module docstring."""
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    owned = [(p, group) for group in optimizer.param_groups for p in group["params"]]
    pending = 0
    for param_id, (p, group) in zip(ids, owned, strict=True):
        if param_id in saved["state"] or not p.requires_grad or p in optimizer.managed.tensors:
            continue
        if optimizer.is_pending(p):
            # The seed managed.manage would give it when the pending tensors are decided in param_groups order.
            seed = tensor_seed(optimizer.rounding_seed, len(optimizer.managed.seeds) + pending)
            pending += 1
            saved["state"][param_id] = _saved_initial_expert_state(optimizer, p, seed)
        else:
            dense_params = [q for q in group["params"] if q not in optimizer.managed.tensors]
            fused = torch_adamw_flags(group, dense_params)[1]
            saved["state"][param_id] = dense.initial_dense_state(p, {**group, "fused": fused})
    if optimizer.expert_clipping == "lagged":
        coef = optimizer.expert_clip_coef if optimizer.lagged_coef_set else None
        experts = lambda p: p in optimizer.managed.tensors or optimizer.is_pending(p)  # noqa: E731
        saved = lagged_clipping.save_coef(saved, [p for p, _ in owned], experts, coef)
    return saved


def _saved_initial_expert_state(optimizer, p: torch.Tensor, seed: int) -> dict:
    """The state an expert tensor held undecided will start from (``expert_state`` of no state), as
    ``state_dict()`` saves an expert tensor's (``step`` on the CPU, 8-bit moments dequantized beside their
    codes)."""
    state = expert_state(p, {}, optimizer.moments_dtype, master=optimizer.master_weights, seed=seed)
    saved = {"state": {0: state}, "param_groups": [{"params": [0]}]}
    return with_cpu_steps(saved, [{"params": [p]}], lambda q: True)["state"][0]


def restore(optimizer, state_dict: dict, load) -> None:
    """``load(state_dict)`` (InBackwardAdamW.load_state_dict), then, with ``expert_clipping="lagged"``, the
    saved coefficient (none saved: the coefficient is left as it is). The coefficient is checked before
    anything is loaded (ValueError, :func:`lagged_clipping.load_coef`)."""
    coef = lagged_clipping.load_coef(type(optimizer).__name__, state_dict)
    load(state_dict)
    if coef is not None and optimizer.expert_clipping == "lagged":
        device = optimizer.expert_clip_coef.device
        optimizer.expert_clip_coef, optimizer.lagged_coef_set = coef.to(device), True
        optimizer.managed.record.groups.set_clip_coef(optimizer.expert_clip_coef)
