"""Expert parallelism for :class:`sonar_kernels.SonarExperts`: each rank of a process group holds E / P
experts; tokens travel to the rank of their expert and back with ``all_to_all_single`` (torch.distributed's
differentiable functional collective), and the local experts run the same custom op as on one process,
with their AdamW update fused in the backward: every token routed to a local expert reaches its rank, so
the rank's gradient is complete and no gradient collective is needed.

Gradient convention (DDP's): each rank's loss is a mean over its own tokens and the objective is the mean
of the ranks' losses. The backward of the dispatch sums the gradients that come back from the P ranks, so
the expert gradient is scaled by 1 / P (exact for a power-of-two P) to be the gradient of that mean,
the gradient that single-process training on the concatenated batch gives; the gradient to the tokens is
not scaled.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from sonar_kernels.autograd.moe_mlp import moe_mlp
from sonar_kernels.optim.distributed import resolve_group

__all__ = ["expert_parallel_moe_mlp", "resolve_ep_group"]


def resolve_ep_group(ep_group) -> dist.ProcessGroup:
    """The process group of ``ep_group`` (a ProcessGroup or a 1-D DeviceMesh, e.g. ``mesh["ep"]``).

    Raises:
        ValueError: torch.distributed not initialized, or a DeviceMesh of more than one dimension.
        TypeError: anything else.
    """
    return resolve_group(ep_group, "ep_group", "ep")


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def exchange_counts(dest: torch.Tensor, group) -> tuple[list[int], list[int]]:
    """The split sizes of the dispatch: ``dest`` [S] int64, the destination rank of each of this rank's
    slots (P, the size of ``group``, for a dropped one); the rows this rank sends to each rank, counted,
    exchanged with ``all_to_all_single`` and read on the host (the one sync per layer). Returns (rows sent
    to each rank, rows received from each rank), P each.

    A seam: a memory trace under fake tensors, which have no values to count or read, replaces it with
    known counts (bench/memory_real.py's balanced routing; docs/distributed.md, "Traced at full size")."""
    size = dist.get_world_size(group)
    counts = torch.bincount(dest, minlength=size + 1)[:size]
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return counts.tolist(), received.tolist()


def _all_to_all(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows exchanged with ``all_to_all_single``, differentiable (the backward is the reverse exchange):
    torch's functional collective, waited for here."""
    out = all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, group)
    return out.wait() if hasattr(out, "wait") else out


def expert_parallel_moe_mlp(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    num_experts: int,
    activation: str,
    backend: str,
    transposed: bool = False,
    interleaved: bool = False,
    gated: bool = True,
    gate_up_proj_bias: torch.Tensor | None = None,
    down_proj_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`sonar_kernels.moe_mlp` over experts spread across ``group``: rank r holds experts
    [r * E / P, (r + 1) * E / P) as ``gate_up_proj`` [E / P, 2I, H] and ``down_proj`` [E / P, H, I]
    (or another layout of :func:`sonar_kernels.moe_mlp`: ``transposed``, ``interleaved``, ``gated``), and their
    biases' rows of those experts, if any.

    Args:
        hidden_states: [T_r, H], this rank's tokens.
        top_k_index: [T_r, top_k] global expert ids in [0, num_experts); others are dropped.
        top_k_weights: [T_r, top_k] routing weights, applied on this rank (the combine).
    Returns:
        [T_r, H], dtype of hidden_states: out[t] = sum_j w[t, j] * expert_{id[t, j]}(x_t), the combine in
        fp32 in ``j`` order, rounded once.

    The token counts per rank are exchanged first and read on the host (one sync per layer, in the
    forward, as the split sizes of ``all_to_all_single`` require; the backward reuses them).
    """
    size = dist.get_world_size(group)
    local = num_experts // size
    T, top_k = top_k_index.shape
    H = hidden_states.shape[-1]
    flat = top_k_index.reshape(-1)
    kept = (flat >= 0) & (flat < num_experts)
    # Destination rank of each slot (size for a dropped one); slots sorted by it, stable.
    dest = torch.where(kept, flat.div(local, rounding_mode="floor"), size)
    order = torch.sort(dest, stable=True).indices
    send_splits, recv_splits = exchange_counts(dest, group)
    slots = order[: sum(send_splits)]
    tokens = slots.div(top_k, rounding_mode="floor")
    # The local expert id travels with each row; the routing weight stays here for the combine.
    ids = (flat[slots] - dest[slots] * local).to(torch.int32)
    recv_ids = ids.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv_ids, ids, recv_splits, send_splits, group=group)
    x_recv = _all_to_all(hidden_states[tokens], recv_splits, send_splits, group)
    # The expert gradient is the gradient of the mean of the ranks' losses (module docstring): dY scaled
    # by 1 / size before the experts' backward, dX scaled back by size after it.
    x_recv = _ScaleGrad.apply(x_recv, float(size))
    y_recv = moe_mlp(
        x_recv,
        recv_ids[:, None],
        torch.ones(recv_ids.shape[0], 1, dtype=hidden_states.dtype, device=hidden_states.device),
        gate_up_proj,
        down_proj,
        activation=activation,
        backend=backend,
        transposed=transposed,
        interleaved=interleaved,
        gated=gated,
        gate_up_proj_bias=gate_up_proj_bias,
        down_proj_bias=down_proj_bias,
    )
    y_recv = _ScaleGrad.apply(y_recv, 1.0 / size)
    y = _all_to_all(y_recv, send_splits, recv_splits, group)
    # The combine as on one process: in fp32, over j in order, no atomics (a dropped slot adds 0).
    weighted = y.float() * top_k_weights.reshape(-1)[slots].float()[:, None]
    per_slot = weighted.new_zeros(T * top_k, H).index_copy(0, slots, weighted).view(T, top_k, H)
    out = per_slot[:, 0]
    for j in range(1, top_k):
        out = out + per_slot[:, j]
    return out.to(hidden_states.dtype)
