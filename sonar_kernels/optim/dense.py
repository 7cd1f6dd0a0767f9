"""torch's AdamW on SonarAdamW's dense parameters in ``step()``: the state torch creates, the state after a
conversion of the model, GradScaler's unscaling and the skip decision of a non-finite gradient, and the
flags and attributes the step sets around torch's own AdamW (optim/sonar_adamw.py)."""

from __future__ import annotations

import contextlib

import torch
from torch.optim.optimizer import _get_scalar_dtype

from sonar_kernels import ops

__all__ = ["attributes", "follow_conversions", "found_inf", "initial_dense_state", "step_flags", "unscale"]


@torch.compiler.disable  # per-tensor bookkeeping, eager also under torch.compile(optimizer.step)
def follow_conversions(state: dict, params: list[torch.Tensor]) -> None:
    """The dense state of ``params`` after a conversion of the model since their last step
    (``model.to(torch.bfloat16)``, ``model.to(device)`` with the optimizer kept): moments (and amsgrad's
    ``max_exp_avg_sq``) take the parameter's dtype and device, as torch.optim.AdamW creates them and as its
    ``load_state_dict`` casts them, and a ``step`` kept on the old device moves with them (a CPU ``step``
    stays). The expert tensors' state follows at their module's forward, before any update of the step
    (:meth:`InBackwardAdamW.claim`), so the step is applied whole; nothing is copied when nothing changed.
    docs/usage.md, "Casting the model after building the optimizer"."""
    for p in params:
        entries = state.get(p)
        if not entries:
            continue
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor):
                continue
            if key == "step":
                if value.device.type != "cpu" and value.device != p.device:
                    entries[key] = value.to(p.device)
            elif value.is_floating_point() and (value.dtype, value.device) != (p.dtype, p.device):
                entries[key] = value.to(device=p.device, dtype=p.dtype)


def initial_dense_state(p: torch.Tensor, group: dict) -> dict:
    """The state torch.optim.AdamW creates for ``p`` at its first step (torch/optim/adam.py,
    Adam._init_group): ``step`` on the parameter's device when fused or capturable, else on the CPU."""
    on_device = bool(group.get("capturable")) or bool(group.get("fused"))
    state = {
        "step": torch.zeros(
            (), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=p.device if on_device else "cpu"
        ),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


@contextlib.contextmanager
def attributes(obj, **values):
    """Set the attributes ``values`` of ``obj`` for the block, then restore those it had and remove the
    others (the caller's ``found_inf`` and ``grad_scale`` stay theirs: GradScaler deletes them itself)."""
    missing = object()
    saved = {name: getattr(obj, name, missing) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


@contextlib.contextmanager
def step_flags(groups: list[dict], flags: list[tuple[bool | None, bool | None]]):
    """Set each group's ``foreach`` and ``fused`` to ``flags`` for the block (torch.optim.AdamW.step reads
    them there), then give the groups back their own."""
    saved = [(group["foreach"], group["fused"]) for group in groups]
    for group, (foreach, fused) in zip(groups, flags, strict=True):
        group["foreach"], group["fused"] = foreach, fused
    try:
        yield
    finally:
        for group, (foreach, fused) in zip(groups, saved, strict=True):
            group["foreach"], group["fused"] = foreach, fused


def unscale(grads: list[torch.Tensor], grad_scale: torch.Tensor) -> None:
    """Divide ``grads`` by ``grad_scale`` in place exactly as ``torch.amp.GradScaler.unscale_`` does (a
    multiplication by the float32 reciprocal computed in float64)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, device_grads in by_device.items():
        inv_scale = grad_scale.double().reciprocal().float().to(device)
        found = torch.zeros(1, dtype=torch.float32, device=device)  # the caller's found_inf decides
        for dtype in {g.dtype for g in device_grads}:
            torch._amp_foreach_non_finite_check_and_unscale_(
                [g for g in device_grads if g.dtype == dtype], found, inv_scale
            )


def found_inf(
    params: list[torch.Tensor], norm: torch.Tensor | None, grad_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """A 0-dim bool tensor on the first parameter's device: True when a gradient of ``params`` (divided by
    ``grad_scale`` when given) has an entry that is NaN, infinite, or beyond ``ops.grad_limit`` of the
    parameter's dtype (torch.optim.AdamW keeps the moments in it), or when ``norm`` is given and not
    finite."""
    device = params[0].grad.device
    found = torch.zeros((), dtype=torch.bool, device=device)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.grad.device, p.dtype), []).append(p.grad)
    for (_, dtype), grads in groups.items():
        # A DTensor gradient (FSDP2's shard) is reduced over its mesh.
        largest = torch.stack([ops.whole(n).float() for n in torch._foreach_norm(grads, float("inf"))]).amax()
        limit = ops.grad_limit(dtype)
        if grad_scale is not None:
            limit = grad_scale.to(largest.device, torch.float64) * limit
        found |= (~(largest <= limit)).to(device)
    if norm is not None:
        found |= ~torch.isfinite(ops.whole(norm)).to(device)
    return found
