"""The ``sonar_kernels::`` custom ops (torch.library): the forward, the backward with the in-backward
AdamW update fused into it, and the standalone AdamW update of one expert tensor. Each has a fake
(meta) implementation beside it, so torch.compile traces them as single ops with static shapes; the
forward's autograd formula is registered by ``sonar_kernels.autograd``.

Both backends run behind the same ops ("triton": the Triton launchers; "torch": ``torch_backend``).
An update's tensors travel as one list in the order of :data:`STATE_FIELDS`; an empty list means "no
update".
"""

from __future__ import annotations

import torch
from torch import Tensor

from sonar_kernels.ops import backward as triton_bwd
from sonar_kernels.ops import forward as triton_fwd
from sonar_kernels.ops import torch_backend
from sonar_kernels.ops.adamw import torch_adamw_
from sonar_kernels.specs import RoutingMetadata

# The tensors of an in-backward update, in the order the ops take them.
STATE_FIELDS = ("exp_avg", "exp_avg_sq", "step", "hyper", "grad_norm_sq", "skipped")
# What the backward does with a weight's gradient: return it, apply the update (the state is given),
# or add it to an accumulation buffer.
MODES = ("grad", "update", "accumulate")


@torch.library.custom_op("sonar_kernels::moe_mlp_fwd", mutates_args=())
def moe_mlp_fwd(
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    gate_up_proj_state: list[Tensor],
    down_proj_state: list[Tensor],
    activation: str,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gated expert MLP's forward: (out [T, H], Hpre [S, 2I], then the five tensors of
    :class:`RoutingMetadata`). The update states are inputs only so that the backward receives them."""
    fwd = triton_fwd.moe_mlp_fwd if backend == "triton" else torch_backend.moe_mlp_fwd
    out, hpre, meta = fwd(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)
    return (out, hpre, *meta)


@moe_mlp_fwd.register_fake
def _moe_mlp_fwd_fake(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_proj_state, down_proj_state,
    activation, backend,
):  # fmt: skip
    T, H = hidden_states.shape
    S = T * top_k_index.shape[1]
    E, two_I, _ = gate_up_proj.shape
    index = {"dtype": torch.int32, "device": hidden_states.device}
    return (
        hidden_states.new_empty(T, H),
        hidden_states.new_empty(S, two_I),
        torch.empty(E + 1, **index),
        torch.empty(E + 1, **index),
        torch.empty(S, **index),
        torch.empty(S, **index),
        torch.empty(S, **index),
    )


def _update(state: list[Tensor], grad_dtype, fused: bool, grad_in) -> triton_bwd.AdamWUpdate:
    exp_avg, exp_avg_sq, step, hyper, grad_norm_sq, skipped = state
    return triton_bwd.AdamWUpdate(
        exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=step, hyper=hyper, grad_dtype=grad_dtype, fused=fused,
        grad_in=grad_in, grad_norm_sq=grad_norm_sq, skipped=skipped,
    )  # fmt: skip


@torch.library.custom_op(
    "sonar_kernels::moe_mlp_bwd",
    mutates_args=("gate_up_proj", "down_proj", "gate_up_proj_state", "down_proj_state", "gate_up_proj_buffer",
                  "down_proj_buffer"),
)  # fmt: skip
def moe_mlp_bwd(
    grad_out: Tensor,
    hidden_states: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    hpre: Tensor,
    expert_offsets: Tensor,
    tile_offsets: Tensor,
    row_of_slot: Tensor,
    token_of_row: Tensor,
    slot_of_row: Tensor,
    needs_input_grad: list[bool],
    gate_up_proj_mode: str,
    gate_up_proj_state: list[Tensor],
    gate_up_proj_buffer: Tensor | None,
    gate_up_proj_buffer_add: bool,
    gate_up_proj_grad_dtype: torch.dtype | None,
    down_proj_mode: str,
    down_proj_state: list[Tensor],
    down_proj_buffer: Tensor | None,
    down_proj_buffer_add: bool,
    down_proj_grad_dtype: torch.dtype | None,
    fused_epilogue: bool,
    activation: str,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward: (grad hidden_states, grad top_k_weights, grad gate_up_proj, grad down_proj), each
    an empty tensor where ``needs_input_grad`` (x, weights, gate_up_proj, down_proj) says no or the
    weight's mode is not "grad".

    Per weight, ``mode`` "update": AdamW applied in place to the weight and its state (the Triton wgrad
    epilogue, or its split path with ``fused_epilogue=False``), with ``buffer`` (the gradient of earlier
    micro-batches, or None) added to this backward's gradient first; "accumulate": this backward's
    gradient added to ``buffer`` (``buffer_add``) or written into it. Both only on the Triton backend:
    the torch backend returns the gradient, and the caller applies :func:`expert_adamw_`.
    """
    meta = RoutingMetadata(expert_offsets, tile_offsets, row_of_slot, token_of_row, slot_of_row)
    needs = tuple(needs_input_grad)
    if backend == "triton":
        updates, accumulators = {}, {}
        weights = (
            ("gate_up_proj", gate_up_proj_mode, gate_up_proj_state, gate_up_proj_buffer, gate_up_proj_buffer_add,
             gate_up_proj_grad_dtype),
            ("down_proj", down_proj_mode, down_proj_state, down_proj_buffer, down_proj_buffer_add,
             down_proj_grad_dtype),
        )  # fmt: skip
        for name, mode, state, buffer, add, grad_dtype in weights:
            if mode == "update":
                updates[name] = _update(state, grad_dtype, fused_epilogue, buffer)
            elif mode == "accumulate":
                accumulators[name] = triton_bwd.GradAccumulator(buffer, add)
        grads = triton_bwd.moe_mlp_bwd(
            grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation, needs,
            gate_up_proj_update=updates.get("gate_up_proj"), down_proj_update=updates.get("down_proj"),
            gate_up_proj_accumulator=accumulators.get("gate_up_proj"),
            down_proj_accumulator=accumulators.get("down_proj"),
        )  # fmt: skip
    else:
        grads = torch_backend.moe_mlp_bwd(
            grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation, needs
        )
    empty = hidden_states.new_empty(0)
    return tuple(empty if g is None else g for g in grads)


@moe_mlp_bwd.register_fake
def _moe_mlp_bwd_fake(
    grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, expert_offsets, tile_offsets,
    row_of_slot, token_of_row, slot_of_row, needs_input_grad, gate_up_proj_mode, gate_up_proj_state,
    gate_up_proj_buffer, gate_up_proj_buffer_add, gate_up_proj_grad_dtype, down_proj_mode, down_proj_state,
    down_proj_buffer, down_proj_buffer_add, down_proj_grad_dtype, fused_epilogue, activation, backend,
):  # fmt: skip
    need_x, need_w, need_w1, need_w2 = needs_input_grad
    triton = backend == "triton"
    need_w1 = need_w1 and (gate_up_proj_mode == "grad" or not triton)
    need_w2 = need_w2 and (down_proj_mode == "grad" or not triton)
    empty = hidden_states.new_empty(0)
    return (
        torch.empty_like(hidden_states) if need_x else empty,
        torch.empty_like(top_k_weights) if need_w else empty,
        torch.empty_like(gate_up_proj) if need_w1 else empty,
        torch.empty_like(down_proj) if need_w2 else empty,
    )


@torch.library.custom_op("sonar_kernels::expert_adamw_", mutates_args=("weight", "state"))
def expert_adamw_(
    weight: Tensor,
    grad: Tensor,
    grad_in: Tensor | None,
    state: list[Tensor],
    foreach: bool | None,
    fused: bool | None,
) -> None:
    """torch's AdamW on one expert tensor, in place (weight, exp_avg, exp_avg_sq, step, the gradient's
    squared norm and the skip counter; ``state`` in the order of :data:`STATE_FIELDS`), from ``grad``
    plus ``grad_in`` (earlier micro-batches, or None) summed in grad_in's dtype, as autograd sums them in
    ``.grad``. Skipped as a whole for a non-finite or too large gradient (see
    :func:`sonar_kernels.ops.adamw.torch_adamw_`). The hyperparameters are read from the state's
    ``hyper`` tensor on the host (a sync on a GPU; the Triton backend reads them in its kernels)."""
    exp_avg, exp_avg_sq, step, hyper, grad_norm_sq, skipped = state
    total = grad if grad_in is None else grad_in + grad.to(grad_in.dtype)
    torch_adamw_(
        weight, total, exp_avg, exp_avg_sq, step, tuple(hyper.tolist()), grad_norm_sq, skipped,
        foreach=foreach, fused=fused,
    )  # fmt: skip


@expert_adamw_.register_fake
def _expert_adamw_fake(weight, grad, grad_in, state, foreach, fused):
    return None
