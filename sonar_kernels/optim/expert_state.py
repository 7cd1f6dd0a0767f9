"""The AdamW state of a tensor updated in the backward: created, converted, saved and loaded.

torch.optim.AdamW's layout (``step``, ``exp_avg``, ``exp_avg_sq``), with what the kernels read: ``step`` a
0-dim float32 tensor on the tensor's device, the moments on that device in ``moments_dtype`` (or a dtype the
kernels take). A checkpoint holds ``step`` on the CPU, as torch.optim.AdamW keeps it outside its fused and
capturable modes, so that it loads into torch.optim.AdamW and back (docs/usage.md, "Checkpoints").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sonar_kernels import ops
from sonar_kernels.optim.param_groups import check_group_options

__all__ = ["check_loadable", "expert_state", "load_expert_state", "with_cpu_steps"]

MOMENTS = ("exp_avg", "exp_avg_sq")


def expert_state(
    p: torch.Tensor, state: dict, moments_dtype: torch.dtype | None, follows: torch.dtype | None = None
) -> dict:
    """The state of ``p`` for its in-backward update: ``state`` (torch.optim.AdamW's keys: from dense steps
    taken before ``p`` was known as an expert tensor, or its own before a conversion of ``p``) converted
    (``step`` a 0-dim float32 tensor on ``p``'s device, the moments on that device in ``moments_dtype``,
    else their own dtype, else, for a dtype the kernels do not take or the dtype ``follows`` (the
    parameter's before a conversion), ``p``'s), or new zeros when it has none."""
    moments = moments_dtype or p.dtype
    if not all(isinstance(state.get(key), torch.Tensor) for key in MOMENTS):
        return {
            "step": torch.zeros((), dtype=torch.float32, device=p.device),
            "exp_avg": torch.zeros_like(p, dtype=moments, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, dtype=moments, memory_format=torch.preserve_format),
        }
    step = state.get("step", 0.0)
    converted = {"step": torch.as_tensor(step, dtype=torch.float32).to(p.device).reshape(()).clone()}
    for key in MOMENTS:
        value = state[key]
        kept = value.dtype in ops.SUPPORTED_DTYPES and value.dtype != follows
        dtype = moments_dtype or (value.dtype if kept else p.dtype)
        converted[key] = torch.empty_like(p, dtype=dtype).copy_(value)
    return converted


def _pairs(saved_groups: list[dict], param_groups: list[dict]) -> list[tuple[int, torch.Tensor]]:
    ids = [i for group in saved_groups for i in group["params"]]
    params = [p for group in param_groups for p in group["params"]]
    if len(ids) != len(params):
        raise ValueError(f"the state_dict holds {len(ids)} parameters, this optimizer {len(params)}")
    return list(zip(ids, params, strict=True))


def with_cpu_steps(saved: dict, param_groups: list[dict], managed: Callable[[torch.Tensor], bool]) -> dict:
    """``saved`` (torch.optim.Optimizer.state_dict's result) with the ``step`` of each tensor ``managed``
    names as a CPU copy (the live one stays on the device). Reading it syncs with the device."""
    for param_id, p in _pairs(saved["param_groups"], param_groups):
        state = saved["state"].get(param_id)
        if managed(p) and state is not None and isinstance(state.get("step"), torch.Tensor):
            saved["state"][param_id] = {**state, "step": state["step"].to("cpu", copy=True)}
    return saved


def check_loadable(
    owner: str, state_dict: dict, param_groups: list[dict], managed: Callable[[torch.Tensor], bool]
) -> list[tuple[int, torch.Tensor]]:
    """Check, before anything is loaded, what the in-backward update needs of ``state_dict``: a group that
    holds managed tensors only with the options and hyperparameter ranges the update implements (any other
    group loads as into torch.optim.AdamW); as many groups and parameters as ``param_groups``; each managed
    tensor's moments tensors of its shape, or no state. Returns the (saved id, tensor) pairs.

    Raises:
        ValueError: what does not hold, naming the option, the parameter and the key.
    """
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")  # torch's words
    for group, own in zip(saved_groups, param_groups, strict=True):
        if any(managed(p) for p in own["params"]):
            check_group_options(f"{owner}.load_state_dict", group, True)
            ops.check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    pairs = _pairs(saved_groups, param_groups)
    for param_id, p in pairs:
        saved = state_dict["state"].get(param_id, {})
        if not managed(p):
            continue
        for key in MOMENTS:
            value = saved.get(key)
            if saved and not isinstance(value, torch.Tensor):
                raise ValueError(f"the state of parameter {param_id} has no {key} tensor")
            if isinstance(value, torch.Tensor) and value.shape != p.shape:
                raise ValueError(
                    f"{key} of parameter {param_id} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}"
                )
    return pairs


def load_expert_state(p: torch.Tensor, state: dict, saved: dict, moments_dtype: torch.dtype | None) -> None:
    """Rewrite ``state`` (``p``'s, after torch.optim.Optimizer.load_state_dict) from ``saved`` (its saved
    state, possibly empty) as the kernels read it: the moments in the dtype they were saved with when the
    kernels take it (torch casts them to the parameter's dtype), else ``p``'s, or ``moments_dtype`` when
    given; fresh zero moments and ``step`` 0 for a parameter saved without state; ``step`` a float32
    tensor on ``p``'s device; no other key."""
    for key in MOMENTS:
        value = saved.get(key)
        if isinstance(value, torch.Tensor):
            kept = value.dtype if value.dtype in ops.SUPPORTED_DTYPES else p.dtype
            state[key] = torch.empty_like(p, dtype=moments_dtype or kept).copy_(value)
        else:
            state[key] = torch.zeros_like(p, dtype=moments_dtype or p.dtype)
    step = saved.get("step")
    state["step"] = (
        torch.as_tensor(0.0 if step is None else step, dtype=torch.float32).to(p.device).reshape(())
    )
    for key in list(state):
        if key not in ("step", *MOMENTS):
            del state[key]
