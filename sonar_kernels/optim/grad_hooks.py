"""The hooks an optimizer with in-backward updates puts on its tensors, and the check that no hook of the
user's would be bypassed: a gradient that reaches a managed tensor's ``.grad`` (a weight passed to the MLP
as a cast or another copy, a penalty on the weights, FSDP2's reduced shard) is applied by the optimizer's
post-accumulate-grad hook, built here."""

from __future__ import annotations

import weakref

import torch

from sonar_kernels.optim import distributed

__all__ = ["accumulated_grad_hook", "check_no_user_hooks", "weak_call"]

# Modules whose hooks on an expert tensor are known not to need its gradient: this library's, and torch's
# memory trackers (MemTracker).
KNOWN_HOOK_MODULES = (__name__, "torch.distributed._tools.")


def weak_call(obj, method: str, *bound):
    """A callable that calls ``obj.<method>(*bound, *args)`` while ``obj`` lives, holding it weakly."""
    ref = weakref.ref(obj)

    def call(*args):
        target = ref()
        if target is not None:
            getattr(target, method)(*bound, *args)

    return call


def accumulated_grad_hook(optimizer, target, method: str):
    """A post-accumulate-grad hook of ``optimizer``'s that calls ``target.<method>(p)`` when ``p.grad``
    holds a gradient, holding both weakly. The hook outlives the tensor's attributes
    (torch.utils.swap_tensors swaps them away, not the hooks):
    :func:`sonar_kernels.optim.ownership.owner_of` finds the owner through its ``sonar_optimizer``
    attribute (a weak reference to ``optimizer``)."""
    optimizer_ref = weakref.ref(optimizer)
    call = weak_call(target, method)

    def hook(p: torch.Tensor) -> None:
        if p.grad is not None:
            call(p)

    hook.sonar_optimizer = optimizer_ref
    return hook


def check_no_user_hooks(owner: str, p: torch.Tensor) -> None:
    """Raise RuntimeError when a hook of the user's is registered on ``p``: a gradient hook
    (``register_hook``) or a post-accumulate-grad hook would never see the gradient the in-backward update
    uses. This library's own hooks and torch's memory trackers' (``torch.distributed._tools``, which only
    read sizes) are not the user's."""
    hooks = [
        *(getattr(p, "_backward_hooks", None) or {}).values(),
        *(getattr(p, "_post_accumulate_grad_hooks", None) or {}).values(),
    ]
    if any(not getattr(hook, "__module__", "").startswith(KNOWN_HOOK_MODULES) for hook in hooks):
        raise RuntimeError(
            f"{owner}: the expert tensor of shape {tuple(p.shape)} has a gradient hook of its own "
            "(register_hook or register_post_accumulate_grad_hook), which the in-backward update would bypass: "
            "its gradient never reaches a tensor or .grad; nothing was updated. Remove the hook, or give the "
            f"tensor to torch.optim.AdamW.{distributed.deepspeed_note()}"
        )
