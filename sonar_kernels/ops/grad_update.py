"""The update of a gradient that reached ``.grad``, with 8-bit moments or stochastic rounding (SonarAdamW's
``.grad`` path, on either backend), an FSDP2 shard included.

A plain tensor goes to the rules' driver (``ops/torch_backend/fp64_update.py``). A DTensor weight (FSDP2's
shard; its gradient a DTensor of the same placements, its codes and scales DTensors sharded like it, along
a dimension other than the last) has its skip and ``grad_norm_sq`` decided over the whole gradient (a
collective over the mesh); then each rank updates its own local tensors, every element and block as one
process would on the whole tensor: on CUDA in one Triton launch per tensor
(``ops/triton_backend/shard_update.py``), elsewhere by the rules' driver (docs/distributed.md, "FSDP2").
"""

from __future__ import annotations

import torch

from sonar_kernels.ops.common import skip_decided, whole
from sonar_kernels.ops.torch_backend import fp64_update
from sonar_kernels.ops.triton_backend.shard_update import shard_update_triton_
from sonar_kernels.rules.adamw import grad_limit
from sonar_kernels.rules.master_weights import shard_index_base
from sonar_kernels.update_state import UpdateState

__all__ = ["adamw_8bit_", "stochastic_adamw_"]


def adamw_8bit_(weight, gradient, grad_in, state, hyper, *, grad_dtype, chunk_bytes) -> None:
    """``fp64_update.adamw_8bit_`` (its arguments and state list), a DTensor ``weight`` as one shard of
    the whole tensor (the module docstring).

    Raises:
        ValueError: a DTensor weight whose gradient is not a DTensor, or with ``grad_in``.
    """
    _update_(fp64_update.adamw_8bit_, weight, gradient, grad_in, state, hyper, grad_dtype, chunk_bytes)


def stochastic_adamw_(weight, gradient, grad_in, state, hyper, *, grad_dtype, chunk_bytes) -> None:
    """``fp64_update.stochastic_adamw_``, a DTensor ``weight`` as one shard (as :func:`adamw_8bit_`)."""
    _update_(fp64_update.stochastic_adamw_, weight, gradient, grad_in, state, hyper, grad_dtype, chunk_bytes)


def _update_(rule, weight, gradient, grad_in, state, hyper, grad_dtype, chunk_bytes) -> None:
    if _is_dtensor(weight):
        _shard_update_(weight, gradient, grad_in, state, hyper, grad_dtype)
    else:
        rule(weight, gradient, grad_in, state, hyper, grad_dtype=grad_dtype, chunk_bytes=chunk_bytes)


def _is_dtensor(t) -> bool:
    return callable(getattr(t, "to_local", None))


def _shard_update_(weight, gradient, grad_in, state, hyper, grad_dtype) -> None:
    """The update of FSDP2's shard ``weight``: the skip and the norm over the whole gradient, then the shard."""
    if not _is_dtensor(gradient) or grad_in is not None:
        raise ValueError("a sharded (DTensor) weight's update takes its whole gradient as a DTensor")
    s = UpdateState.of(state)
    eight_bit = s.kind.moments == "8bit"
    dtype = grad_dtype or weight.dtype
    with torch.no_grad():
        grad = gradient.to(dtype)
        norm = whole(torch.linalg.vector_norm(grad, dtype=torch.float32))
        decided = skip_decided(grad, norm, grad_limit(torch.float32))  # the CPU: from the norm
        norm_sq = norm.square()
        local = [t.to_local() if _is_dtensor(t) else t for t in (weight, grad, *state)]
        base = shard_index_base(weight) if s.seed is not None else 0  # the shard's stream counters
        held = local[2:]
        if local[0].is_cuda:  # one Triton launch per tensor per step
            h = UpdateState.of(held)
            shard_update_triton_(
                local[0], local[1], (h.exp_avg, h.exp_avg_scales, h.exp_avg_sq, h.exp_avg_sq_scales) if eight_bit
                else (h.exp_avg, h.exp_avg_sq), held, hyper, decided=decided, remainder=h.remainder, seed=h.seed,
                index_base=base,
            )  # fmt: skip
        else:  # the CPU: the rules' driver (docs/design.md, "The update rules")
            update = fp64_update.adamw_8bit_ if eight_bit else fp64_update.stochastic_adamw_
            update(
                local[0], local[1], None, held, hyper, grad_dtype=dtype, chunk_bytes=None, found=decided,
                index_base=base,
            )  # fmt: skip
        s.grad_norm_sq.copy_(torch.where(decided, float("inf"), norm_sq))
