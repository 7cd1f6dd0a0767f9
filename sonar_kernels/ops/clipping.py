"""Expert clipping on the torch side (docs/design.md, "Expert clipping"): the arithmetic of the Triton
kernels' ``clip_tile`` (kernels/adamw.py), op for op, for the torch backend's updates and the gradients
that reach ``.grad``.

An update clips its gradient when its hyperparameter tensor has the two clipping entries ([7]:
lr, beta1, beta2, eps, weight_decay, spike_threshold, grad_scale; :data:`sonar_kernels.specs.CLIPPING`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["clip_gradient", "clips", "no_clipping_values"]


def clips(hyper) -> bool:
    """Whether ``hyper`` (the [5] or [7] float64 tensor, or a tuple of the group's values) asks for expert
    clipping."""
    return isinstance(hyper, torch.Tensor) and hyper.numel() == 7


def no_clipping_values() -> tuple[float, float]:
    """(spike_threshold, grad_scale) that leave every gradient as it is: (inf, 1.0)."""
    return (math.inf, 1.0)


def clip_gradient(
    grad: torch.Tensor, exp_avg_sq: torch.Tensor, hyper: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient an update with expert clipping uses, out of place, and the number of entries the spike
    rule replaced (a 0-dim int64 tensor on the gradient's device).

    1. g = round(g * grad_scale): the product in fp32, rounded to ``dtype`` (torch's ``grad.mul_(coef)``
       of clip_grads_with_norm_);
    2. SPAM's rule (Huang et al., ICLR 2025, arXiv 2501.06842): where g * g > theta * v and v > 0, all in
       fp32 (theta = fp32(spike_threshold), v = ``exp_avg_sq`` as fp32: the value before this step's
       update, dequantized for 8-bit moments), g = sign(g) * sqrt(theta * v) (the square root correctly
       rounded), rounded to ``dtype``.

    Args:
        grad: the gradient the update would use (any floating dtype; its values are ``dtype``'s).
        exp_avg_sq: its second moment before the update, ``grad``'s shape.
        hyper: [7] float64 (:func:`clips`). On the CPU an entry that leaves the gradient as it is (grad_scale
            1, spike_threshold inf) skips its pass; on a GPU both run (reading them would sync).
        dtype: the gradient dtype the values are rounded to (None: ``grad``'s).
    Returns:
        (the clipped gradient in ``grad``'s dtype, the count). A DTensor ``grad`` (FSDP2's shard, with
        ``exp_avg_sq`` sharded alike) is clipped shard by shard (the rule reads each element alone) and
        returned as a DTensor of its placements; the count is this rank's.
    """
    if callable(getattr(grad, "to_local", None)):
        from torch.distributed.tensor import DTensor

        local, count = clip_gradient(grad.to_local(), exp_avg_sq.to_local(), hyper, dtype)
        clipped = DTensor.from_local(
            local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride()
        )
        return clipped, count
    dtype = dtype or grad.dtype
    threshold, scale = hyper[5], hyper[6]
    on_host = hyper.device.type == "cpu"
    g = grad.float()
    if not on_host or float(scale) != 1.0:
        g = (g * scale.float()).to(dtype).float()
    count = torch.zeros((), dtype=torch.int64, device=grad.device)
    if not on_host or math.isfinite(float(threshold)):
        v = exp_avg_sq.float()
        limit = v * threshold.float()
        spike = (g * g > limit) & (v > 0.0)
        bound = torch.sqrt(limit.double()).float()  # torch's fp32 sqrt on the CPU is not correctly rounded
        g = torch.where(spike, torch.copysign(bound, g), g).to(dtype)
        count = spike.sum()
    return g.to(grad.dtype), count
