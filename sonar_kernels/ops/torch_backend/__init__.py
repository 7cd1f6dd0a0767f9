"""The "torch" backend: the expert MLP on torch's GEMMs, and the updates outside the wgrad epilogue (torch's
AdamW on one tensor; 8-bit moments and stochastic rounding in the "fp64" arithmetic, on the CPU in C).

What ``ops/library.py`` calls, under the same names as ``ops/triton_backend``: :func:`moe_mlp_fwd`,
:func:`moe_mlp_bwd_core`, :func:`check_expert_wgrad`, :func:`run_expert_wgrad`, and for the ops' fake
implementations :func:`core_rows` and :func:`magnitudes_numel`.
"""

from __future__ import annotations

from sonar_kernels.ops.torch_backend import mlp, wgrad
from sonar_kernels.ops.torch_backend.mlp import moe_mlp_fwd
from sonar_kernels.ops.torch_backend.update import torch_update
from sonar_kernels.rules.clipping import clips
from sonar_kernels.specs import BackwardCore

__all__ = [
    "check_expert_wgrad",
    "core_rows",
    "magnitudes_numel",
    "moe_mlp_bwd_core",
    "moe_mlp_fwd",
    "run_expert_wgrad",
]


def core_rows(S: int) -> int:
    """The rows of dHpre and A for ``S`` routed rows."""
    return S


def magnitudes_numel(T: int) -> None:
    """None: the torch backend computes no magnitudes (its chunked update bounds each chunk's gradient)."""
    return None


def moe_mlp_bwd_core(
    grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation, needs, *, layout,
    down_proj_bias, up_proj, hpre_writable,
):  # fmt: skip
    """``mlp.moe_mlp_bwd_core`` on the first four of ``needs``, as a :class:`~sonar_kernels.specs.BackwardCore`
    without magnitudes."""
    grads = mlp.moe_mlp_bwd_core(
        grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation, needs[:4],
        layout=layout, down_proj_bias=down_proj_bias, up_proj=up_proj, hpre_writable=hpre_writable,
    )  # fmt: skip
    return BackwardCore(*grads, None)


def check_expert_wgrad(
    name, weight, mode, state, hyper, buffer, buffer_add, grad_dtype, fused_epilogue, layout
):
    """Nothing beyond the checks of ``ops/library.py``'s ``check_expert_wgrad``; "accumulate" is refused
    when it runs (:func:`run_expert_wgrad`)."""


def run_expert_wgrad(
    name, weight, p, q, top_k_weights, meta, *, mode, state, hyper, layout, magnitudes, buffer, buffer_add,
    grad_dtype, fused_epilogue, foreach, torch_fused, value,
):  # fmt: skip
    """The gradient by ``wgrad.expert_gradient``: returned whole ("grad"), or applied by chunks of experts by
    torch's AdamW or the rules (``update.torch_update``; "update"), with ``value`` (the owner's group
    values, or None) in place of ``hyper``'s. ``magnitudes``, ``buffer_add`` and ``fused_epilogue`` are the
    Triton backend's.

    Raises:
        ValueError: ``mode`` "accumulate".
    """
    gradient = wgrad.expert_gradient(name, weight, p, q, top_k_weights, meta, layout)
    if mode == "grad":
        return gradient.full()
    if mode != "update":
        raise ValueError(f"{name}: mode {mode!r} is not supported by the torch backend (grad or update)")
    torch_update(
        weight, state, hyper if value is None else value, buffer, foreach, torch_fused, gradient,
        grad_dtype=grad_dtype, clip=hyper if clips(hyper) else None,
    )  # fmt: skip
    return None
