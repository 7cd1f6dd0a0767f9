"""The expert biases' share of the backward, on both backends, on the device, no host sync, no atomics.

- ``gate_up_proj_bias`` b1: Hpre[r] = X[t_r] W1[e]^T + b1[e], so db1[e] = sum of dHpre[r] over the rows of
  e: the wgrad of W1 with a column of ones for X;
- ``down_proj_bias`` b2: Y[r] = A[r] W2[e]^T + b2[e] and out[t] = sum_j w[t, j] Y[r(t, j)], so
  db2[e] = sum over the rows of e of w_r dO[t_r] (the wgrad of W2 with ones for A), and the routing-weight
  gradient of each slot gains <dO[t], b2[e]> (:func:`down_bias_weight_term`).

A bias is an expert tensor like the weights: with an owner, its AdamW update runs in that wgrad launch's
epilogue (docs/design.md, "Biases and the clamped SwiGLU").
"""

from __future__ import annotations

import torch

from sonar_kernels.specs import RoutingMetadata

# The ones that stand for X or A in a bias's wgrad: this many columns (16 bytes of bf16, so that torch's
# grouped GEMM takes them), of which the first is kept.
ONES_COLUMNS = 8


def ones_rows(num_rows: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[num_rows, ONES_COLUMNS] ones, without memory per row (stride 0 along the rows)."""
    return torch.ones(1, ONES_COLUMNS, dtype=dtype, device=device).expand(max(num_rows, 1), ONES_COLUMNS)


def down_bias_weight_term(grad_out, down_proj_bias, meta: RoutingMetadata, top_k: int) -> torch.Tensor:
    """<dO[t], b2[e(t, j)]> per slot, [S] fp32, 0 for a dropped slot: the down bias's part of the
    routing-weight gradient."""
    E = down_proj_bias.shape[0]
    S = meta.row_of_slot.shape[0]
    kept = meta.row_of_slot >= 0
    rows = torch.arange(S, device=meta.row_of_slot.device)
    expert_of_row = torch.searchsorted(meta.expert_offsets[1:].long(), rows, right=True).clamp(max=E - 1)
    experts = expert_of_row[meta.row_of_slot.clamp(min=0).long()].view(-1, top_k)
    scores = grad_out.float() @ down_proj_bias.float().t()  # [T, E]
    return torch.where(kept, scores.gather(1, experts).reshape(-1), 0.0)
