"""The torch backend's in-backward update of one expert tensor, the body of the ``sonar_kernels::`` ops that
apply it (``ops/library.py``): torch's AdamW on exact moments (by chunks of experts with its fused AdamW),
or the rules in the "fp64" arithmetic (8-bit moments, stochastic rounding: ``ops/torch_backend/fp64_update.py``).
"""

from __future__ import annotations

import torch

from sonar_kernels.ops.torch_backend import mlp
from sonar_kernels.ops.torch_backend.adamw import remainder_adamw_, torch_adamw_, torch_adamw_chunked_
from sonar_kernels.ops.torch_backend.expert_gradient import ExpertGradient
from sonar_kernels.ops.torch_backend.fp64_update import adamw_8bit_, stochastic_adamw_
from sonar_kernels.ops.validation import check_master_state
from sonar_kernels.rules.clipping import clips
from sonar_kernels.specs import Hyperparameters
from sonar_kernels.update_state import UpdateState

__all__ = ["torch_update"]


def torch_update(weight, state, hyper, grad_in, foreach, fused, grad, grad_dtype=None, clip=None) -> None:
    """The body of ``sonar_kernels::expert_adamw_`` (``grad`` a tensor) and of the torch backend's in-backward update
    (``grad`` an ``expert_gradient.ExpertGradient``, applied by chunks of experts of at most
    ``mlp.WGRAD_CHUNK_BYTES`` with torch's fused AdamW: :func:`torch_adamw_chunked_`).
    ``hyper``: the [5] float64 tensor, or the group's (lr, beta1, beta2, eps,
    weight_decay) as it holds them (see ``ops/library.py``'s ``run_expert_wgrad``). ``grad_dtype``: the gradient is rounded
    to it first (the update's grad_dtype, as the Triton epilogue rounds its accumulator); the sum with
    ``grad_in`` (already in that dtype) is rounded once more. ``clip``: None, or the [7] float64 tensor of
    an update with expert clipping (docs/design.md, "Expert clipping"; taken from ``hyper`` when that is one):
    the gradient is clipped first, as the Triton kernels clip it (``rules/clipping.py``)."""
    check_master_state("weight", weight, state)
    decoded = UpdateState.of(state)
    if clip is None and clips(hyper):
        clip = hyper
    if decoded.kind.moments == "8bit" or decoded.kind.master == "stochastic":
        # 8-bit moments (the scheme's arithmetic) or stochastic rounding: the "fp64" arithmetic, the Triton
        # kernels' bits
        if clip is not None:  # the group's values and the clipping entries, as the kernels read them
            hyper = clip
        elif isinstance(hyper, tuple):  # the group's values: the [5] float64 tensor the kernels read
            hyper = torch.tensor([float(h) for h in hyper], dtype=torch.float64, device=weight.device)
        rule = adamw_8bit_ if decoded.kind.moments == "8bit" else stochastic_adamw_
        rule(
            weight, grad, grad_in, state, hyper, grad_dtype=grad_dtype,
            chunk_bytes=mlp.WGRAD_CHUNK_BYTES if isinstance(grad, ExpertGradient) else None,
        )  # fmt: skip
        return
    remainder = decoded.remainder
    exp_avg, exp_avg_sq, step = decoded.exp_avg, decoded.exp_avg_sq, decoded.step
    grad_norm_sq, skipped, clipped = decoded.grad_norm_sq, decoded.skipped, decoded.clipped
    hyperparameters = hyper if isinstance(hyper, tuple) else Hyperparameters(*hyper[:5].tolist())
    clipping = {"clip": clip, "clipped": clipped}
    if isinstance(grad, ExpertGradient):
        torch_adamw_chunked_(
            weight, grad, grad_in, exp_avg, exp_avg_sq, step, hyperparameters, grad_norm_sq, skipped,
            grad_dtype=grad_dtype, foreach=foreach, fused=fused, chunk_bytes=mlp.WGRAD_CHUNK_BYTES,
            remainder=remainder, **clipping,
        )  # fmt: skip
    else:
        if grad_dtype is not None:
            grad = grad.to(grad_dtype)
        total = grad if grad_in is None else grad_in + grad.to(grad_in.dtype)
        if remainder is not None:
            remainder_adamw_(
                weight, remainder, total, exp_avg, exp_avg_sq, step, hyperparameters, grad_norm_sq, skipped,
                foreach=foreach, fused=fused, **clipping,
            )  # fmt: skip
        else:
            torch_adamw_(
                weight, total, exp_avg, exp_avg_sq, step, hyperparameters, grad_norm_sq, skipped,
                foreach=foreach, fused=fused, **clipping,
            )  # fmt: skip
