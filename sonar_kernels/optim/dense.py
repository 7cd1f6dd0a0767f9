"""torch's AdamW on SonarAdamW's dense parameters in ``step()`` (:func:`step`): the state torch creates, the
state after a conversion of the model, GradScaler's unscaling, the clipping, the skip decision of a
non-finite gradient, and the flags and attributes the step sets around torch's own AdamW
(optim/sonar_adamw.py; docs/usage.md, "SonarAdamW")."""

from __future__ import annotations

import contextlib

import torch
from torch.optim.optimizer import _get_scalar_dtype

from sonar_kernels import ops

__all__ = [
    "attributes",
    "follow_conversions",
    "found_inf",
    "initial_dense_state",
    "step",
    "step_flags",
    "unscale",
]


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


def step(
    optimizer, dense: list[torch.Tensor], stepped: list[list[torch.Tensor]], flags: list, set_lagged_coef
) -> None:
    """SonarAdamW.step's dense half, after the expert tensors' step ended: ``dense`` (the dense parameters
    with a gradient) clipped by ``optimizer.max_grad_norm`` (with ``clip_norm_includes_experts`` or
    ``expert_clipping="lagged"``, by the norm over the dense and the expert gradients, which
    ``set_lagged_coef(norm)`` gets for "lagged"), then torch.optim.AdamW's own step on them, skipped as a
    whole when a gradient or the norm is not finite (counted in ``optimizer.dense_skipped_steps``).
    ``stepped``: each group's dense parameters with a gradient; ``flags``: each group's (foreach, fused)
    for torch's AdamW (``torch_adamw_flags``; the groups keep showing their own, None: chosen at each step,
    as torch chooses). GradScaler's ``grad_scale`` and ``found_inf`` attributes are honoured where torch's
    fused AdamW runs (docs/usage.md, "SonarAdamW")."""
    follow_conversions(optimizer.state, dense)
    # Set by torch.amp.GradScaler.step for a fused optimizer (its _step_supports_amp_scaling contract):
    # the dense gradients are still multiplied by grad_scale, found_inf is 1 when they overflowed.
    grad_scale = getattr(optimizer, "grad_scale", None)
    caller_found_inf = getattr(optimizer, "found_inf", None)
    if grad_scale is not None and optimizer.max_grad_norm is not None and dense:
        unscale([p.grad for p in dense], grad_scale)  # clipping needs the true gradients
        grad_scale = None
    norm = None
    if optimizer.max_grad_norm is not None:
        if optimizer.clip_norm_includes_experts or optimizer.expert_clipping == "lagged":
            dense_norm = torch.nn.utils.get_total_norm([p.grad for p in dense])
            expert_norm = optimizer.expert_grad_norm().to(dense_norm.device)
            norm = torch.sqrt(dense_norm.square() + expert_norm.square())
            if dense:
                torch.nn.utils.clip_grads_with_norm_(dense, optimizer.max_grad_norm, norm)
            optimizer.last_dense_grad_norm, optimizer.last_grad_norm = dense_norm, norm
            if optimizer.expert_clipping == "lagged":
                set_lagged_coef(norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(dense, optimizer.max_grad_norm)
            optimizer.last_dense_grad_norm = norm
    if not dense:
        return
    found = found_inf(dense, norm, grad_scale).to(optimizer.dense_skipped_steps.device)
    # torch.optim.AdamW's own step without the hooks Optimizer wraps it in (they already ran around this
    # step()); its own wrapper, which sets the grad mode for differentiable, stays.
    adamw_step = torch.optim.AdamW.step
    if getattr(adamw_step, "hooked", False):
        adamw_step = adamw_step.__wrapped__
    if all(fused for params, (_, fused) in zip(stepped, flags, strict=True) if params):
        # torch's fused AdamW skips every parameter (step included) when found_inf is 1: the caller's
        # value, or 1 when this optimizer found a non-finite gradient. torch's step calls its AdamW for
        # every group, also one with nothing to step (expert tensors only), where only the fused one
        # takes found_inf (it returns at once): that one for them.
        flags = [flag if params else (False, True) for params, flag in zip(stepped, flags, strict=True)]
        combined = found.float()
        if caller_found_inf is not None:
            combined = torch.where(found.to(caller_found_inf.device), 1.0, caller_found_inf)
        with (
            attributes(optimizer, found_inf=combined, grad_scale=grad_scale),
            step_flags(optimizer.param_groups, flags),
        ):
            adamw_step(optimizer)
        skipped = (combined == 1).to(found.device)
    else:
        if not bool(found):  # torch's other AdamW paths take no found_inf: a host sync
            with step_flags(optimizer.param_groups, flags):
                adamw_step(optimizer)
        skipped = found
    optimizer.dense_skipped_steps += skipped.long()
