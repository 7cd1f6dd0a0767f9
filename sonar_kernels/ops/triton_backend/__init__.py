"""The "triton" backend: the Triton launchers of the expert MLP's forward, backward and wgrad with its fused
AdamW update, their tile configurations and TMA descriptors, and the standalone update kernels' launchers.

What ``ops/library.py`` calls, under the same names as ``ops/torch_backend``: :func:`moe_mlp_fwd`,
:func:`moe_mlp_bwd_core`, :func:`check_expert_wgrad`, :func:`run_expert_wgrad`, and for the ops' fake
implementations :func:`core_rows` and :func:`magnitudes_numel`.
"""

from __future__ import annotations

from sonar_kernels.ops.triton_backend import wgrad
from sonar_kernels.ops.triton_backend.backward import moe_mlp_bwd_core
from sonar_kernels.ops.triton_backend.forward import moe_mlp_fwd
from sonar_kernels.ops.triton_backend.update_bound import magnitudes_numel
from sonar_kernels.update_state import UpdateState

__all__ = [
    "check_expert_wgrad",
    "core_rows",
    "magnitudes_numel",
    "moe_mlp_bwd_core",
    "moe_mlp_fwd",
    "run_expert_wgrad",
]


def core_rows(S: int) -> int:
    """The rows of dHpre and A for ``S`` routed rows: at least one (the Triton buffers)."""
    return max(S, 1)


def _plan(weight, mode, state, hyper, buffer, buffer_add, grad_dtype, fused_epilogue):
    """(the ``wgrad.AdamWUpdate`` or None, the ``wgrad.GradAccumulator`` or None) of a wgrad in ``mode``."""
    if mode == "update":
        update = wgrad.AdamWUpdate(
            **UpdateState.of(state)._asdict(), hyper=hyper, fused=fused_epilogue, grad_in=buffer,
            grad_dtype=weight.dtype if grad_dtype is None else grad_dtype,
        )  # fmt: skip
        return update, None
    if mode == "accumulate":
        return None, wgrad.GradAccumulator(buffer, buffer_add)
    return None, None


def check_expert_wgrad(
    name, weight, mode, state, hyper, buffer, buffer_add, grad_dtype, fused_epilogue, layout
):
    """Raise TypeError or ValueError when the wgrad's plan cannot apply to ``weight``
    (``wgrad.check_wgrad``)."""
    update, accumulator = _plan(weight, mode, state, hyper, buffer, buffer_add, grad_dtype, fused_epilogue)
    wgrad.check_wgrad(name, weight, update, accumulator, layout)


def run_expert_wgrad(
    name, weight, p, q, top_k_weights, meta, *, mode, state, hyper, layout, magnitudes, buffer, buffer_add,
    grad_dtype, fused_epilogue, foreach, torch_fused, value,
):  # fmt: skip
    """``wgrad.expert_wgrad`` with the plan of ``mode``: the gradient ("grad"), the update in the wgrad
    epilogue or its split path ("update"), or the sum into ``buffer`` ("accumulate"). ``foreach``,
    ``torch_fused`` and ``value`` are the torch backend's (the kernels read ``hyper``)."""
    update, accumulator = _plan(weight, mode, state, hyper, buffer, buffer_add, grad_dtype, fused_epilogue)
    return wgrad.expert_wgrad(
        name, weight, p, q, top_k_weights, meta, layout, magnitudes, update, accumulator
    )
