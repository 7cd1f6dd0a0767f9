"""SonarAdamW's lagged expert clipping (``expert_clipping="lagged"``; docs/usage.md, "Clipping the experts"
and "Checkpoints and resume"): the coefficient step t's expert updates multiply their gradients by, torch's
min(1, max_grad_norm / (norm + 1e-6)) of step t-1's global norm, computed in ``step()``, saved in
``state_dict()`` and restored by ``load_state_dict()``, so that a resumed run equals the uninterrupted one.

The coefficient is kept in the saved state of each expert tensor (key :data:`COEF_KEY`, a 0-dim float32 CPU
tensor, as ``step``): torch.optim.AdamW loads such a state_dict and ignores the key (its AdamW reads
``step``, ``exp_avg`` and ``exp_avg_sq``), and torch.distributed.checkpoint carries it per parameter as it
carries ``step``. A checkpoint without it (written before it was saved, or by another expert_clipping)
leaves the coefficient as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sonar_kernels import specs

__all__ = ["COEF_KEY", "load_coef", "next_coef", "save_coef"]

COEF_KEY = "expert_clip_coef"


def next_coef(max_grad_norm: float, norm: torch.Tensor, coef: torch.Tensor | None) -> torch.Tensor:
    """The coefficient for the next step's expert updates: torch's min(1, max_grad_norm / (norm + 1e-6)) in
    fp32 (clip_grads_with_norm_), or ``coef`` (None: 1) when ``norm`` is not finite (a skipped update). On
    the norm's device, no host read."""
    new = torch.clamp(max_grad_norm / (norm.float() + 1e-6), max=1.0)
    old = torch.ones_like(new) if coef is None else coef.to(new.device)
    return torch.where(torch.isfinite(norm), new, old)


def save_coef(saved: dict, params: list[torch.Tensor], carries: Callable, coef: torch.Tensor | None) -> dict:
    """``saved`` (a state_dict whose ``param_groups`` ids follow ``params``, in param_groups order) with a
    CPU float32 copy of ``coef`` (None: 1, the coefficient before the first ``step()``) in the state of
    each parameter ``carries`` names that has a state. Reading it syncs with the device (checkpoint time)."""
    value = torch.ones((), dtype=torch.float32) if coef is None else coef.detach().to("cpu", torch.float32)
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    for param_id, p in zip(ids, params, strict=True):
        state = saved["state"].get(param_id)
        if state is not None and carries(p):
            saved["state"][param_id] = {**state, COEF_KEY: value.clone()}
    return saved


def load_coef(owner: str, state_dict: dict) -> torch.Tensor | None:
    """The coefficient saved in ``state_dict`` (a 0-dim float32 CPU tensor), or None when no parameter's
    state holds one. Checked before anything is loaded.

    Raises:
        ValueError: a saved coefficient that is not a one-element tensor or number in [0, 1], or two that
            differ (the state of one checkpoint holds one coefficient).
    """
    found = []
    for param_id, state in state_dict.get("state", {}).items():
        if not isinstance(state, dict) or COEF_KEY not in state:
            continue
        value = state[COEF_KEY]
        number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        if not specs.is_real_number(number) or not (0.0 <= number <= 1.0):
            raise ValueError(
                f"{owner}.load_state_dict: {COEF_KEY} of parameter {param_id} must be a one-element tensor in "
                f"[0, 1] (the lagged clipping coefficient), got {value!r}"
            )
        found.append((param_id, float(number)))
    if not found:
        return None
    if len({number for _, number in found}) > 1:
        raise ValueError(
            f"{owner}.load_state_dict: the saved {COEF_KEY} differs between parameters "
            f"({', '.join(f'{i}: {n!r}' for i, n in found[:4])}); one checkpoint holds one lagged coefficient"
        )
    return torch.tensor(found[0][1], dtype=torch.float32)
