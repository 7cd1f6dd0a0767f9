"""Pure-PyTorch reference of the MoE expert MLP: the test oracle and the CPU fallback.

Everything here is plain PyTorch, written for clarity rather than speed: a loop over experts (the rows of
each gathered once, outputs concatenated, so no [S, H] copy per expert), fp32 (or wider) accumulation, and the rounding points of the Triton kernels (see docs/design.md, "Forward"):

1. Hpre = X @ W1[e]^T, accumulated in fp32, rounded to the activation dtype (it is what backward saves);
2. A = act(Hpre[:, :I]) * Hpre[:, I:], computed in fp32 from the rounded Hpre, rounded to the dtype;
3. Y = A @ W2[e]^T, accumulated in fp32, rounded to the dtype;
4. out[t] = sum_j w[t, j] * Y[slot (t, j)] in fp32, rounded to the dtype at the end.

Weights in the Hugging Face transformers v5 layout: ``gate_up_proj`` [E, 2I, H] with the gate rows
first, ``down_proj`` [E, H, I]. Weights of a wider dtype than ``hidden_states`` (fp32 master weights
under bf16 compute) are cast to the dtype of ``hidden_states`` first, as the kernels do in registers.

Autograd through :func:`moe_mlp` gives the reference gradients of every input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sonar_kernels.specs import ACTIVATIONS, RoutingMetadata, parse_activation

__all__ = ["ACTIVATIONS", "RoutingMetadata", "glu", "moe_mlp", "routing_metadata"]


def routing_metadata(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> RoutingMetadata:
    """Routing metadata by a stable sort (reference; the Triton version is ``ops.routing_metadata``).

    Args:
        top_k_index: [T, top_k] int32/int64 expert ids; ids outside [0, num_experts) are dropped.
        num_experts: E.
        block_m: rows per grouped-GEMM tile, for ``tile_offsets``.
    Returns:
        :class:`RoutingMetadata`; here the unspecified tail of ``token_of_row`` / ``slot_of_row`` is -1.
    """
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1).long()
    kept = (flat >= 0) & (flat < num_experts)
    key = torch.where(kept, flat, num_experts)
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    expert_offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    expert_offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
    tile_offsets = torch.zeros_like(expert_offsets)
    tile_offsets[1:] = torch.cumsum(torch.div(counts + block_m - 1, block_m, rounding_mode="floor"), 0)
    num_rows = int(counts.sum())
    slot_of_row = torch.full_like(flat, -1, dtype=torch.int32)
    slot_of_row[:num_rows] = order[:num_rows].to(torch.int32)
    token_of_row = torch.where(slot_of_row >= 0, torch.div(slot_of_row, top_k, rounding_mode="floor"), -1)
    row_of_slot = torch.full_like(flat, -1, dtype=torch.int32)
    row_of_slot[order[:num_rows]] = torch.arange(num_rows, dtype=torch.int32, device=flat.device)
    return RoutingMetadata(
        expert_offsets, tile_offsets, row_of_slot, token_of_row.to(torch.int32), slot_of_row
    )


def glu(gate: torch.Tensor, up: torch.Tensor | None, activation: str) -> torch.Tensor:
    """Gated linear unit: ``act(gate) * up``; SwiGLU for "silu", GeGLU for "gelu" (exact erf GELU) and
    "gelu_tanh" (the tanh approximation, torch's ``F.gelu(approximate="tanh")``), "relu2" the squared
    ReLU; for a clamped SwiGLU (:func:`sonar_kernels.specs.clamped_swiglu`) transformers' gpt-oss formula,
    written as it is there. ``up`` None (an MLP without a gate): act(gate)."""
    if up is None:
        return glu(gate, torch.ones_like(gate), activation)
    if activation.startswith("clamped_swiglu"):
        _, alpha, limit = parse_activation(activation)
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "relu2":
        return torch.square(F.relu(gate)) * up
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def moe_mlp(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    activation: str = "silu",
    gate_up_proj_bias: torch.Tensor | None = None,
    down_proj_bias: torch.Tensor | None = None,
    gated: bool = True,
) -> torch.Tensor:
    """Gated expert MLP over routed tokens: out[t] = sum_j w[t, j] * down_e(act(gate_e(x)) * up_e(x)).
    With biases: gate_e(x), up_e(x) and down_e(a) add ``gate_up_proj_bias[e]`` ([E, 2I], gate first) and
    ``down_proj_bias[e]`` ([E, H]) before their rounding.

    Args:
        hidden_states: [T, H] floating point (float64 gives a float64 evaluation of the same math).
        top_k_index: [T, top_k] int32/int64 expert ids; ids outside [0, E) are dropped.
        top_k_weights: [T, top_k] routing weights, any floating dtype (used in fp32 or wider).
        gate_up_proj: [E, 2I, H], rows [0, I) gate, rows [I, 2I) up; ``gated=False``: [E, I, H], the
            up projection alone (A = act(x W1^T)).
        down_proj: [E, H, I].
        activation: "silu" (SwiGLU), "gelu" (GeGLU, exact erf GELU), "gelu_tanh" (GeGLU, tanh-approximated
            GELU) or a clamped SwiGLU (:func:`sonar_kernels.specs.clamped_swiglu`).
    Returns:
        [T, H] in the dtype of ``hidden_states``. Differentiable in every floating input.
    """
    dtype = hidden_states.dtype
    acc_dtype = torch.promote_types(dtype, torch.float32)
    T, H = hidden_states.shape
    top_k = top_k_index.shape[1]
    E = gate_up_proj.shape[0]
    I = down_proj.shape[2]
    # Slots grouped by expert (a stable sort, as routing_metadata does); dropped slots last.
    flat_index = top_k_index.reshape(-1).long()
    kept = (flat_index >= 0) & (flat_index < E)
    order = torch.sort(torch.where(kept, flat_index, E), stable=True).indices
    counts = torch.bincount(torch.where(kept, flat_index, E), minlength=E + 1).tolist()  # host sync
    x_sorted = hidden_states[torch.div(order, top_k, rounding_mode="floor")]
    pieces = []
    # unbind: the backward builds each weight's gradient once (stacked), not one zero-padded copy per expert.
    w1s, w2s = gate_up_proj.unbind(0), down_proj.unbind(0)
    for e, x in enumerate(torch.split(x_sorted, counts)):
        if e == E:  # the dropped slots' rows: no expert output
            pieces.append(x.new_zeros(x.shape, dtype=acc_dtype))
            continue
        w1 = w1s[e].to(dtype).to(acc_dtype)
        w2 = w2s[e].to(dtype).to(acc_dtype)
        hpre = x.to(acc_dtype) @ w1.T
        if gate_up_proj_bias is not None:
            hpre = hpre + gate_up_proj_bias[e].to(acc_dtype)
        hpre = hpre.to(dtype).to(acc_dtype)
        a = glu(hpre[:, :I], hpre[:, I:] if gated else None, activation).to(dtype).to(acc_dtype)
        y = a @ w2.T
        if down_proj_bias is not None:
            y = y + down_proj_bias[e].to(acc_dtype)
        pieces.append(y.to(dtype).to(acc_dtype))
    # Back to slot order: the expert output of every slot, zero for dropped slots.
    y_slots = torch.cat(pieces)[torch.argsort(order)]
    # Dropped slots contribute nothing, even where their weight is NaN or Inf.
    weights = torch.where(kept.reshape(T, top_k, 1), top_k_weights.to(acc_dtype).unsqueeze(-1), 0.0)
    return (weights * y_slots.reshape(T, top_k, H)).sum(dim=1).to(dtype)


def spike_clip(grad: torch.Tensor, exp_avg_sq: torch.Tensor, threshold: float) -> tuple[torch.Tensor, int]:
    """SPAM's spike-aware element clipping (Huang et al., ICLR 2025, arXiv 2501.06842), written plainly:
    the test oracle of ``expert_clipping="spike"`` (docs/design.md, "Expert clipping").

    Every element whose squared gradient exceeds ``threshold`` times its ``exp_avg_sq`` (the value before
    this step's update) is replaced by sign(g) * sqrt(threshold * v); nothing where v is 0. The comparison
    and the replacement are computed in fp32 (g and v as fp32, ``threshold`` rounded to fp32), the result
    rounded to ``grad``'s dtype (the square root correctly rounded).

    Args:
        grad: the gradient the update would use, any floating dtype.
        exp_avg_sq: the second moment before the update, ``grad``'s shape (8-bit moments: dequantized).
        threshold: theta > 0.
    Returns:
        (the clipped gradient in ``grad``'s dtype, the number of replaced elements).
    """
    g = grad.float()
    v = exp_avg_sq.float()
    limit = v * torch.tensor(threshold, dtype=torch.float32)
    spike = (g * g > limit) & (v > 0)
    # The square root correctly rounded to fp32 (torch's fp32 sqrt on the CPU is not, always).
    clipped = torch.where(spike, torch.copysign(torch.sqrt(limit.double()).float(), g), g)
    return clipped.to(grad.dtype), int(spike.sum())


def lagged_clip(grad: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """The gradient ``expert_clipping="lagged"`` uses: ``grad * coef`` computed in fp32 and rounded once to
    ``grad``'s dtype (torch's ``grad.mul_(coef)`` with an fp32 0-dim ``coef`` on the CPU; a CUDA ``mul`` may
    round ``coef`` to the gradient's dtype first, so this writes the product out)."""
    return (grad.float() * coef.float().to(grad.device)).to(grad.dtype)


def lagged_clip_coef(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grads_with_norm_'s coefficient, min(1, max_norm / (norm + 1e-6)), in fp32: what
    ``expert_clipping="lagged"`` multiplies the next step's expert gradients by (g * coef in fp32, rounded
    to the gradient's dtype, as torch's ``grad.mul_(coef)``)."""
    return torch.clamp(max_norm / (total_norm.float() + 1e-6), max=1.0)
