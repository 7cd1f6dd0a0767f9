"""The torch backend's expert weight gradients: which operands each expert tensor's gradient takes from the
backward's core (``mlp.moe_mlp_bwd_core``), as an :class:`~sonar_kernels.ops.torch_backend.expert_gradient.ExpertGradient`
that computes it whole or by chunks of experts."""

from __future__ import annotations

import functools

import torch

from sonar_kernels.ops.bias import ONES_COLUMNS
from sonar_kernels.ops.torch_backend.expert_gradient import ExpertGradient, Gathered, row_weights, valid_rows
from sonar_kernels.ops.torch_backend.grouped_gemm import grouped_wgrad
from sonar_kernels.specs import down_view, gate_up_bias_view, gate_up_view, is_gated

__all__ = ["expert_gradient"]


def expert_gradient(name, weight, p, q, top_k_weights, meta, layout) -> ExpertGradient:
    """The gradient of the expert tensor ``name`` (``weight``; one of :data:`sonar_kernels.specs.EXPERT_TENSORS`)
    as an :class:`ExpertGradient`, computed whole or by chunks of experts when asked, from the operands
    ``mlp.moe_mlp_bwd_core`` gave: ``p`` dO [T, H] (the down projection and its bias; its rows gathered
    by token and scaled by the routing weight) or dHpre [S, 2I] (the gate/up projection and its bias; a
    separate layout's gate or up half [S, I]); ``q`` A [S, I] (the down projection), X [T, H] (the
    gate/up projection; rows gathered by token), or None (a bias: a column of ones)."""
    dtype = p.dtype
    if name in ("down_proj", "down_proj_bias"):
        w_row = row_weights(top_k_weights, meta)
        tokens = meta.token_of_row.long()
        if name == "down_proj":
            return _down_gradient(w_row, p, tokens, q, meta, dtype, weight, layout)
        # db2[e] = sum_r w_r dO[token_r]: dW2's sum with ones for A
        valid = valid_rows(meta, top_k_weights.numel())
        rows = torch.where(valid, w_row[:, None] * torch.index_select(p, 0, tokens).float(), 0.0).to(dtype)
        ones = torch.ones(rows.shape[0], ONES_COLUMNS, dtype=dtype, device=p.device)
        whole = functools.partial(_grad_b2, rows, ones, meta, weight)
        return ExpertGradient(weight, None, meta.expert_offsets, whole=whole)
    if name == "gate_up_proj_bias":  # db1[e] = sum_r dHpre[r]: dW1's sum with ones for X
        halves = 2 if is_gated(layout) else 1
        ones = torch.ones(p.shape[0], ONES_COLUMNS, dtype=dtype, device=p.device)
        whole = functools.partial(_grad_b1, p, ones, meta, weight, layout, halves, weight.shape[1] // halves)
        return ExpertGradient(weight, None, meta.expert_offsets, whole=whole)
    return _gate_up_gradient(p, q, meta.token_of_row.long(), meta, weight, layout)


def _grad_b2(p, ones, meta, bias):
    """db2[e] = sum_r w_r dO[token_r] (``p``) in the bias's dtype."""
    return grouped_wgrad(p, ones, meta.expert_offsets)[..., 0].to(bias.dtype)


def _grad_b1(grad_hpre, ones, meta, bias, layout, halves, I):
    """db1[e] = sum_r dHpre[r] in the bias's dtype and layout (gate/up order)."""
    sums = grouped_wgrad(grad_hpre, ones, meta.expert_offsets)[..., 0]  # [E, 2I]
    grad = torch.empty_like(bias)
    gate_up_bias_view(grad, layout).copy_(sums.unflatten(1, (halves, I)))
    return grad


def _down_gradient(w_row, grad_out, tokens, a, meta, dtype, weight, layout) -> ExpertGradient:
    """dW2[e] = sum_r (w_r dO[token_r])^T A_r in the weight's dtype, shape and strides (the rows
    w_r dO[token_r] gathered per expert)."""

    def operands():
        return [(Gathered(grad_out, tokens, dtype, scale=w_row), a, lambda t: down_view(t, layout))]

    return ExpertGradient(weight, operands, meta.expert_offsets)


def _gate_up_gradient(grad_hpre, hidden_states, tokens, meta, weight, layout) -> ExpertGradient:
    """dW1[e] = sum_r dHpre_r^T X[token_r] in the weight's dtype, shape and strides: one GEMM per expert
    where the layout holds the gate and up rows of an expert as one [2I, H] matrix (or [I, H]), one per
    half where it interleaves them."""

    def operands():
        x = Gathered(hidden_states, tokens, hidden_states.dtype)  # X[token_r], gathered per expert
        if layout.startswith("interleaved"):
            I = grad_hpre.shape[1] // 2
            return [
                (grad_hpre[:, :I], x, lambda t: gate_up_view(t, layout)[:, 0]),
                (grad_hpre[:, I:], x, lambda t: gate_up_view(t, layout)[:, 1]),
            ]

        def rows(t):
            view = gate_up_view(t, layout)
            return view.view(view.shape[0], -1, view.shape[-1])  # a view, never a copy (else it raises)

        return [(grad_hpre, x, rows)]

    return ExpertGradient(weight, operands, meta.expert_offsets)
