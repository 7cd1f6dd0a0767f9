"""Expert clipping on the torch side (docs/design.md, "Expert clipping"): the arithmetic of the Triton
kernels' ``clip_tile`` (``sonar_kernels/kernels/adamw.py``), op for op, for the torch backend's updates and
the gradients that reach ``.grad``.

An update clips its gradient when its hyperparameter tensor has the two clipping entries ([7]:
lr, beta1, beta2, eps, weight_decay, spike_threshold, grad_scale; :data:`sonar_kernels.specs.CLIPPING`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["CLIP_SLICE", "clip_elements", "clip_gradient", "clip_gradient_", "clips"]


def clips(hyper) -> bool:
    """Whether ``hyper`` (the [5] or [7] float64 tensor, or a tuple of the group's values) asks for expert
    clipping."""
    return isinstance(hyper, torch.Tensor) and hyper.numel() == 7


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
    if hyper.device.type == "cpu" and float(scale) == 1.0 and not math.isfinite(float(threshold)):
        return grad, torch.zeros((), dtype=torch.int64, device=grad.device)  # neither rule can change a bit
    g, count = clip_elements(grad.float(), exp_avg_sq.float(), hyper, dtype)
    return g.to(grad.dtype), count


def clip_elements(
    g: torch.Tensor, v: torch.Tensor, hyper: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`clip_gradient`'s two rules on fp32 ``g`` (values of ``dtype``) against the fp32 second moment
    ``v``, both always applied (no host read: what a compiled update runs): returns the clipped gradient
    as fp32 (values of ``dtype``) and the count. A grad_scale of 1 and a spike_threshold of inf change no
    bit, so this gives :func:`clip_gradient`'s bits whatever it skips."""
    threshold, scale = hyper[5], hyper[6]
    g = (g * scale.float()).to(dtype).float()
    limit = v * threshold.float()
    spike = (g * g > limit) & (v > 0.0)
    bound = torch.sqrt(limit.double()).float()  # torch's fp32 sqrt on the CPU is not correctly rounded
    g = torch.where(spike, torch.copysign(bound, g), g).to(dtype).float()
    return g, spike.sum()


# Elements of one pass of :func:`clip_gradient_`: its scratch is two fp32 and two bool slices (640 KiB) and,
# where the rule fires, the indices of the replaced elements of one slice (8 bytes each, at most 512 KiB).
CLIP_SLICE = 1 << 16


def clip_gradient_(grad: torch.Tensor, exp_avg_sq: torch.Tensor, hyper: torch.Tensor) -> torch.Tensor:
    """:func:`clip_gradient` in place on ``grad`` (its own dtype is the gradient dtype), a slice of
    :data:`CLIP_SLICE` elements at a time, so that the scratch stays small whatever the tensor's size (the
    torch backend's chunked update: ``ops/torch_backend/adamw.py``, ``torch_adamw_chunked_``). Returns the count. The same
    bits as :func:`clip_gradient`: the same operations on each element. ``grad`` and ``exp_avg_sq``
    contiguous of one shape, else the out-of-place form is copied back."""
    if not (grad.is_contiguous() and exp_avg_sq.is_contiguous() and grad.shape == exp_avg_sq.shape):
        clipped, count = clip_gradient(grad, exp_avg_sq, hyper)
        grad.copy_(clipped)
        return count
    threshold, scale = hyper[5], hyper[6]
    on_host = hyper.device.type == "cpu"
    scaled = not on_host or float(scale) != 1.0
    scale32 = scale.float()
    if scaled and grad.dtype == torch.float32:
        grad.mul_(scale32)  # the fp32 product; narrower gradients slice by slice below
        scaled = False
    count = torch.zeros((), dtype=torch.int64, device=grad.device)
    spiking = not on_host or math.isfinite(float(threshold))
    if not (scaled or spiking):
        return count
    theta = threshold.float()
    flat_g, flat_v = grad.view(-1), exp_avg_sq.view(-1)
    size = min(CLIP_SLICE, flat_g.numel())
    limit = torch.empty(size, dtype=torch.float32, device=grad.device)
    square = torch.empty(size, dtype=torch.float32, device=grad.device)
    spike = torch.empty(size, dtype=torch.bool, device=grad.device)
    positive = torch.empty(size, dtype=torch.bool, device=grad.device)
    for start in range(0, flat_g.numel(), size):
        g, v = flat_g[start : start + size], flat_v[start : start + size]
        n = g.numel()
        # The product in fp32, rounded once to the gradient's dtype (a CUDA mul_ may round scale first).
        if scaled:
            g.copy_(g.float() * scale32)
        if not spiking:
            continue
        g32 = g.float()
        v32 = v.float()
        torch.mul(v32, theta, out=limit[:n])
        torch.mul(g32, g32, out=square[:n])
        torch.gt(square[:n], limit[:n], out=spike[:n])
        torch.gt(v32, 0.0, out=positive[:n])
        spike[:n].logical_and_(positive[:n])
        if on_host:  # the replaced elements only (a host read of their positions: free on the CPU)
            index = spike[:n].nonzero().squeeze(1)
            if index.numel():
                bound = torch.sqrt(limit[:n][index].double()).float()
                g[index] = torch.copysign(bound, g32[index]).to(g.dtype)
                count += index.numel()
        else:  # on a device: no host read
            bound = torch.sqrt(limit[:n].double()).float()
            g.copy_(torch.where(spike[:n], torch.copysign(bound, g32), g32).to(g.dtype))
            count += spike[:n].sum()
    return count
