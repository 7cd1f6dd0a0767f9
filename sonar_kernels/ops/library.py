"""The ``sonar_kernels::`` custom ops (torch.library): the forward, the backward with the in-backward
AdamW update fused into it, and the standalone AdamW update of one expert tensor. Each has a fake
(meta) implementation beside it, so torch.compile traces them as single ops with static shapes; the
forward's autograd formula is registered by ``sonar_kernels.autograd``.

Both backends run behind the same ops ("triton": the Triton launchers; "torch": ``torch_backend``).
An update's mutable tensors travel as one list in the order of :data:`STATE_FIELDS` (an empty list
means "no update"); its hyperparameter tensor, which the update only reads and which every tensor of a
parameter group shares, travels apart, so that an update does not bump its version counter.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from sonar_kernels import specs
from sonar_kernels.ops import backward as triton_bwd
from sonar_kernels.ops import forward as triton_fwd
from sonar_kernels.ops import torch_backend
from sonar_kernels.ops.adamw import torch_adamw_, torch_adamw_chunked_
from sonar_kernels.ops.expert_gradient import ExpertGradient
from sonar_kernels.specs import RoutingMetadata

# The tensors of an in-backward update, in the order the ops take them.
STATE_FIELDS = ("exp_avg", "exp_avg_sq", "step", "grad_norm_sq", "skipped")
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
    gate_up_proj_hyper: Tensor | None,
    down_proj_hyper: Tensor | None,
    gate_up_proj_grad_dtype: torch.dtype | None,
    down_proj_grad_dtype: torch.dtype | None,
    fused_epilogue: bool,
    foreach: bool | None,
    torch_fused: bool | None,
    activation: str,
    backend: str,
    layout: str,
    gate_up_proj_bias: Tensor | None,
    down_proj_bias: Tensor | None,
    up_proj: Tensor | None,
    up_proj_state: list[Tensor],
    up_proj_hyper: Tensor | None,
    up_proj_grad_dtype: torch.dtype | None,
    gate_up_proj_bias_state: list[Tensor],
    down_proj_bias_state: list[Tensor],
    gate_up_proj_bias_hyper: Tensor | None,
    down_proj_bias_hyper: Tensor | None,
    gate_up_proj_bias_grad_dtype: torch.dtype | None,
    down_proj_bias_grad_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gated expert MLP's forward: (out [T, H], Hpre [S, 2I], then the five tensors of
    :class:`RoutingMetadata`). The update states (:data:`STATE_FIELDS`, or empty: no update), their
    hyperparameter tensors and the update options (the gradient dtypes, the fused epilogue or its split path, torch AdamW's foreach and
    fused flags) are inputs only so that the registered backward receives them. ``layout``: the weights'
    (:data:`sonar_kernels.specs.LAYOUTS`); the biases: [E, 2I] and [E, H], or None; ``up_proj`` (with its
    update's state, hyperparameters and gradient dtype): the up tensor of a separate layout, or None; then
    the biases' updates (state, hyperparameters, gradient dtype; empty or None without one)."""
    return moe_mlp_fwd_body(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_proj_state, down_proj_state,
        gate_up_proj_hyper, down_proj_hyper, gate_up_proj_grad_dtype, down_proj_grad_dtype, fused_epilogue,
        foreach, torch_fused, activation, backend, layout, gate_up_proj_bias, down_proj_bias, up_proj,
    )  # fmt: skip


def moe_mlp_fwd_body(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_proj_state, down_proj_state,
    gate_up_proj_hyper, down_proj_hyper, gate_up_proj_grad_dtype, down_proj_grad_dtype, fused_epilogue, foreach,
    torch_fused, activation, backend, layout, gate_up_proj_bias, down_proj_bias, up_proj, *update_inputs,
):  # fmt: skip
    """:func:`moe_mlp_fwd` as a plain function of the op's inputs (the autograd layer's eager path calls it
    without the op's dispatch)."""
    return run_moe_mlp_fwd(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, backend, layout,
        gate_up_proj_bias, down_proj_bias, up_proj,
    )  # fmt: skip


def run_moe_mlp_fwd(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, backend, layout="concatenated",
    gate_up_proj_bias=None, down_proj_bias=None, up_proj=None,
):  # fmt: skip
    """The body of :func:`moe_mlp_fwd`: the launchers of ``backend``."""
    fwd = triton_fwd.moe_mlp_fwd if backend == "triton" else torch_backend.moe_mlp_fwd
    out, hpre, meta = fwd(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, layout, gate_up_proj_bias,
        down_proj_bias, up_proj,
    )  # fmt: skip
    return (out, hpre, *meta)


@moe_mlp_fwd.register_fake
def _moe_mlp_fwd_fake(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_proj_state, down_proj_state,
    gate_up_proj_hyper, down_proj_hyper, gate_up_proj_grad_dtype, down_proj_grad_dtype, fused_epilogue, foreach,
    torch_fused, activation, backend, layout, gate_up_proj_bias, down_proj_bias, up_proj, up_proj_state,
    up_proj_hyper, up_proj_grad_dtype, *bias_updates,
):  # fmt: skip
    T, H = hidden_states.shape
    S = T * top_k_index.shape[1]
    E, I = gate_up_proj.shape[0], specs.down_view(down_proj, layout).shape[2]
    two_I = (2 if specs.is_gated(layout) else 1) * I  # Hpre's width
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


def _update(
    state: list[Tensor], hyper, grad_dtype, fused: bool, grad_in, on_done, defer
) -> triton_bwd.AdamWUpdate:
    exp_avg, exp_avg_sq, step, grad_norm_sq, skipped = state
    return triton_bwd.AdamWUpdate(
        exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=step, hyper=hyper, grad_dtype=grad_dtype, fused=fused,
        grad_in=grad_in, grad_norm_sq=grad_norm_sq, skipped=skipped, on_done=on_done, defer=defer,
    )  # fmt: skip


@torch.library.custom_op(
    "sonar_kernels::moe_mlp_bwd",
    mutates_args=("gate_up_proj", "down_proj", "gate_up_proj_state", "down_proj_state", "gate_up_proj_buffer",
                  "down_proj_buffer", "up_proj", "up_proj_state", "up_proj_buffer", "gate_up_proj_bias",
                  "gate_up_proj_bias_state", "gate_up_proj_bias_buffer", "down_proj_bias", "down_proj_bias_state",
                  "down_proj_bias_buffer"),
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
    gate_up_proj_hyper: Tensor | None,
    gate_up_proj_buffer: Tensor | None,
    gate_up_proj_buffer_add: bool,
    gate_up_proj_grad_dtype: torch.dtype | None,
    down_proj_mode: str,
    down_proj_state: list[Tensor],
    down_proj_hyper: Tensor | None,
    down_proj_buffer: Tensor | None,
    down_proj_buffer_add: bool,
    down_proj_grad_dtype: torch.dtype | None,
    fused_epilogue: bool,
    foreach: bool | None,
    torch_fused: bool | None,
    activation: str,
    backend: str,
    layout: str,
    gate_up_proj_bias: Tensor | None,
    down_proj_bias: Tensor | None,
    up_proj: Tensor | None,
    up_proj_mode: str,
    up_proj_state: list[Tensor],
    up_proj_hyper: Tensor | None,
    up_proj_buffer: Tensor | None,
    up_proj_buffer_add: bool,
    up_proj_grad_dtype: torch.dtype | None,
    gate_up_proj_bias_mode: str,
    gate_up_proj_bias_state: list[Tensor],
    gate_up_proj_bias_hyper: Tensor | None,
    gate_up_proj_bias_buffer: Tensor | None,
    gate_up_proj_bias_buffer_add: bool,
    gate_up_proj_bias_grad_dtype: torch.dtype | None,
    down_proj_bias_mode: str,
    down_proj_bias_state: list[Tensor],
    down_proj_bias_hyper: Tensor | None,
    down_proj_bias_buffer: Tensor | None,
    down_proj_bias_buffer_add: bool,
    down_proj_bias_grad_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward: (grad hidden_states, grad top_k_weights, grad gate_up_proj, grad down_proj, grad
    gate_up_proj_bias, grad down_proj_bias, grad up_proj), each an empty tensor where
    ``needs_input_grad`` (x, weights, gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias,
    up_proj) says no, the weight's mode is not "grad", or there is no bias or up_proj (the up tensor of a
    separate layout). The biases (``ops/bias.py``) are expert tensors as the weights are, with a mode of
    their own.

    Per weight, ``mode`` "update": AdamW applied in place to the weight and its state, with ``buffer``
    (the gradient of earlier micro-batches, or None) added to this backward's gradient first: on the
    Triton backend in the wgrad epilogue (or its split path with ``fused_epilogue=False``); on the torch
    backend by torch's AdamW (``foreach``, ``torch_fused``: its flags; the body of
    :func:`expert_adamw_`) right after that weight's wgrad, whose gradient is then released before the
    next one is computed (one expert gradient alive at a time). "accumulate" (Triton backend only): this
    backward's gradient added to ``buffer`` (``buffer_add``) or written into it.
    """
    return run_moe_mlp_bwd(
        grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, expert_offsets, tile_offsets,
        row_of_slot, token_of_row, slot_of_row, needs_input_grad, gate_up_proj_mode, gate_up_proj_state,
        gate_up_proj_hyper, gate_up_proj_buffer, gate_up_proj_buffer_add, gate_up_proj_grad_dtype, down_proj_mode,
        down_proj_state, down_proj_hyper, down_proj_buffer, down_proj_buffer_add, down_proj_grad_dtype, fused_epilogue,
        foreach, torch_fused, activation, backend, layout, gate_up_proj_bias, down_proj_bias, up_proj, up_proj_mode,
        up_proj_state, up_proj_hyper, up_proj_buffer, up_proj_buffer_add, up_proj_grad_dtype, gate_up_proj_bias_mode,
        gate_up_proj_bias_state, gate_up_proj_bias_hyper, gate_up_proj_bias_buffer, gate_up_proj_bias_buffer_add,
        gate_up_proj_bias_grad_dtype, down_proj_bias_mode, down_proj_bias_state, down_proj_bias_hyper,
        down_proj_bias_buffer, down_proj_bias_buffer_add, down_proj_bias_grad_dtype,
    )  # fmt: skip


def run_moe_mlp_bwd(
    grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, expert_offsets, tile_offsets,
    row_of_slot, token_of_row, slot_of_row, needs_input_grad, gate_up_proj_mode, gate_up_proj_state,
    gate_up_proj_hyper, gate_up_proj_buffer, gate_up_proj_buffer_add, gate_up_proj_grad_dtype, down_proj_mode,
    down_proj_state, down_proj_hyper, down_proj_buffer, down_proj_buffer_add, down_proj_grad_dtype, fused_epilogue,
    foreach, torch_fused, activation, backend, layout="concatenated", gate_up_proj_bias=None, down_proj_bias=None,
    up_proj=None, up_proj_mode="grad", up_proj_state=(), up_proj_hyper=None, up_proj_buffer=None,
    up_proj_buffer_add=False, up_proj_grad_dtype=None, gate_up_proj_bias_mode="grad", gate_up_proj_bias_state=(),
    gate_up_proj_bias_hyper=None, gate_up_proj_bias_buffer=None, gate_up_proj_bias_buffer_add=False,
    gate_up_proj_bias_grad_dtype=None, down_proj_bias_mode="grad", down_proj_bias_state=(),
    down_proj_bias_hyper=None, down_proj_bias_buffer=None, down_proj_bias_buffer_add=False,
    down_proj_bias_grad_dtype=None, on_done=(None,) * 5, defer=(None,) * 5, values=(None,) * 5,
    hpre_writable=False,
):  # fmt: skip
    """The body of :func:`moe_mlp_bwd`, callable in eager mode with ``on_done``: per weight, a callable
    run right after the launch that updated it or added to its buffer (before any later launch, so that a
    failure further on cannot leave an applied update unrecorded); and ``defer``: per weight in mode
    "update", None (the update runs in this backward) or a callable given ``run``, a function of the
    gradient of earlier micro-batches (``grad_in``, or None) that computes the weight's gradient and
    applies the update when it is called, later (see ``ops.AdamWUpdate.defer``); and ``values``: per
    weight, None or its hyperparameters as its owner's parameter group holds them
    (``specs.ExpertUpdate.hyperparameters``), which the torch backend's AdamW then takes in place of the
    values of its ``hyper`` tensor (torch's arithmetic for tensor lr and betas); and ``hpre_writable``:
    the torch backend may write dHpre over ``hpre`` (the caller frees the graph after this backward;
    ``torch_backend.moe_mlp_bwd``). Mutated tensors'
    version counters are the caller's to bump here (the op bumps them)."""
    meta = RoutingMetadata(expert_offsets, tile_offsets, row_of_slot, token_of_row, slot_of_row)
    # needs_input_grad: x, routing weights, gate_up_proj, down_proj, the two biases, up_proj.
    flags = (*needs_input_grad, False, False, False)[:7]
    needs = (*flags[:4], flags[6])
    biases = {
        "gate_up_proj_bias": gate_up_proj_bias, "down_proj_bias": down_proj_bias, "needs_bias_grad": flags[4:6],
    }  # fmt: skip
    # Per weight: (name, tensor, mode, state, hyperparameters, buffer, buffer_add, grad dtype, on_done, defer).
    weights = (
        ("gate_up_proj", gate_up_proj, gate_up_proj_mode, gate_up_proj_state, gate_up_proj_hyper, gate_up_proj_buffer,
         gate_up_proj_buffer_add, gate_up_proj_grad_dtype, on_done[0], defer[0]),
        ("down_proj", down_proj, down_proj_mode, down_proj_state, down_proj_hyper, down_proj_buffer,
         down_proj_buffer_add, down_proj_grad_dtype, on_done[1], defer[1]),
        ("up_proj", up_proj, up_proj_mode, up_proj_state, up_proj_hyper, up_proj_buffer, up_proj_buffer_add,
         up_proj_grad_dtype, on_done[2], defer[2]),
        ("gate_up_proj_bias", gate_up_proj_bias, gate_up_proj_bias_mode, gate_up_proj_bias_state,
         gate_up_proj_bias_hyper, gate_up_proj_bias_buffer, gate_up_proj_bias_buffer_add, gate_up_proj_bias_grad_dtype,
         on_done[3], defer[3]),
        ("down_proj_bias", down_proj_bias, down_proj_bias_mode, down_proj_bias_state, down_proj_bias_hyper,
         down_proj_bias_buffer, down_proj_bias_buffer_add, down_proj_bias_grad_dtype, on_done[4], defer[4]),
    )  # fmt: skip
    if backend == "triton":
        updates, accumulators = {}, {}
        for name, _, mode, state, hyper, buffer, add, grad_dtype, done, later in weights:
            if mode == "update":
                updates[name] = _update(state, hyper, grad_dtype, fused_epilogue, buffer, done, later)
            elif mode == "accumulate":
                accumulators[name] = triton_bwd.GradAccumulator(buffer, add, done)
        grads = triton_bwd.moe_mlp_bwd(
            grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation, needs,
            gate_up_proj_update=updates.get("gate_up_proj"), down_proj_update=updates.get("down_proj"),
            gate_up_proj_accumulator=accumulators.get("gate_up_proj"),
            down_proj_accumulator=accumulators.get("down_proj"), layout=layout, up_proj=up_proj,
            up_proj_update=updates.get("up_proj"), up_proj_accumulator=accumulators.get("up_proj"),
            gate_up_proj_bias_update=updates.get("gate_up_proj_bias"),
            down_proj_bias_update=updates.get("down_proj_bias"),
            gate_up_proj_bias_accumulator=accumulators.get("gate_up_proj_bias"),
            down_proj_bias_accumulator=accumulators.get("down_proj_bias"), **biases,
        )  # fmt: skip
    else:
        apply = [
            functools.partial(
                _torch_update_of, weight, state, hyper if value is None else value, buffer, foreach, torch_fused,
                done, grad_dtype, later,
            )
            if mode == "update" else None
            for (_, weight, mode, state, hyper, buffer, _, grad_dtype, done, later), value in zip(
                weights, values, strict=True
            )
        ]  # fmt: skip
        grads = torch_backend.moe_mlp_bwd(
            grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation, needs,
            gate_up_proj_update=apply[0], down_proj_update=apply[1], layout=layout, up_proj=up_proj,
            up_proj_update=apply[2], gate_up_proj_bias_update=apply[3], down_proj_bias_update=apply[4], **biases,
            hpre_writable=hpre_writable,
        )  # fmt: skip
    # A distinct empty tensor per missing gradient: a custom op's outputs may not alias each other.
    return tuple(hidden_states.new_empty(0) if g is None else g for g in grads)


@moe_mlp_bwd.register_fake
def _moe_mlp_bwd_fake(
    grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, expert_offsets, tile_offsets,
    row_of_slot, token_of_row, slot_of_row, needs_input_grad, gate_up_proj_mode, gate_up_proj_state,
    gate_up_proj_hyper, gate_up_proj_buffer, gate_up_proj_buffer_add, gate_up_proj_grad_dtype, down_proj_mode,
    down_proj_state, down_proj_hyper, down_proj_buffer, down_proj_buffer_add, down_proj_grad_dtype, fused_epilogue,
    foreach, torch_fused, activation, backend, layout, gate_up_proj_bias, down_proj_bias, up_proj, up_proj_mode,
    up_proj_state, up_proj_hyper, up_proj_buffer, up_proj_buffer_add, up_proj_grad_dtype, gate_up_proj_bias_mode,
    gate_up_proj_bias_state, gate_up_proj_bias_hyper, gate_up_proj_bias_buffer, gate_up_proj_bias_buffer_add,
    gate_up_proj_bias_grad_dtype, down_proj_bias_mode, *down_proj_bias_update,
):  # fmt: skip
    need_x, need_w, need_w1, need_w2, need_b1, need_b2, need_w3 = (*needs_input_grad, False, False, False)[:7]
    need_w1 = need_w1 and gate_up_proj_mode == "grad"
    need_w2 = need_w2 and down_proj_mode == "grad"
    need_b1 = need_b1 and gate_up_proj_bias is not None and gate_up_proj_bias_mode == "grad"
    need_b2 = need_b2 and down_proj_bias is not None and down_proj_bias_mode == "grad"
    need_w3 = need_w3 and up_proj is not None and up_proj_mode == "grad"
    # A distinct empty tensor per missing gradient, as the real op returns (outputs may not alias).
    return tuple(
        torch.empty_like(t) if need else hidden_states.new_empty(0)
        for t, need in (
            (hidden_states, need_x), (top_k_weights, need_w), (gate_up_proj, need_w1), (down_proj, need_w2),
            (gate_up_proj_bias, need_b1), (down_proj_bias, need_b2), (up_proj, need_w3),
        )
    )  # fmt: skip


@torch.library.custom_op("sonar_kernels::moe_mlp_bwd_grads", mutates_args=())
def moe_mlp_bwd_grads(
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
    activation: str,
    backend: str,
    layout: str,
    gate_up_proj_bias: Tensor | None,
    down_proj_bias: Tensor | None,
    up_proj: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward with ordinary gradients only (no weight updated or accumulated): as
    :func:`moe_mlp_bwd` with both modes "grad", but it mutates nothing, so the weights' version counters
    stay as they are and another saved use of a weight (a penalty computed before the MLP) still runs
    after this backward."""
    return run_moe_mlp_bwd(*_with_plain_gradients(
        grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, expert_offsets, tile_offsets,
        row_of_slot, token_of_row, slot_of_row, needs_input_grad, activation, backend, layout, gate_up_proj_bias,
        down_proj_bias, up_proj,
    ))  # fmt: skip


def run_moe_mlp_bwd_grads(*args, hpre_writable: bool = False) -> tuple:
    """The body of :func:`moe_mlp_bwd_grads` (the same arguments), callable without the op's dispatch in
    eager mode; ``hpre_writable`` as for :func:`run_moe_mlp_bwd`."""
    return run_moe_mlp_bwd(*_with_plain_gradients(*args), hpre_writable=hpre_writable)


@moe_mlp_bwd_grads.register_fake
def _moe_mlp_bwd_grads_fake(*args):
    return _moe_mlp_bwd_fake(*_with_plain_gradients(*args))


def _with_plain_gradients(*args) -> tuple:
    """The arguments of :func:`moe_mlp_bwd_grads` as :func:`moe_mlp_bwd` takes them: every weight in mode
    "grad" (no state, no buffer)."""
    *tensors, activation, backend, layout, gate_up_proj_bias, down_proj_bias, up_proj = args
    plain = ("grad", [], None, None, False, None)
    return (
        *tensors, *plain, *plain, True, None, None, activation, backend, layout, gate_up_proj_bias, down_proj_bias,
        up_proj, *plain, *plain, *plain,
    )  # fmt: skip


@torch.library.custom_op("sonar_kernels::expert_adamw_", mutates_args=("weight", "state"))
def expert_adamw_(
    weight: Tensor,
    grad: Tensor,
    grad_in: Tensor | None,
    state: list[Tensor],
    hyper: Tensor,
    foreach: bool | None,
    fused: bool | None,
) -> None:
    """torch's AdamW on one expert tensor, in place (weight, exp_avg, exp_avg_sq, step, the gradient's
    squared norm and the skip counter; ``state`` in the order of :data:`STATE_FIELDS`), from ``grad``
    plus ``grad_in`` (earlier micro-batches, or None) summed in grad_in's dtype, as autograd sums them in
    ``.grad``. Skipped as a whole for a non-finite or too large gradient (see
    :func:`sonar_kernels.ops.adamw.torch_adamw_`). The hyperparameters are read from ``hyper``
    ([5] float64, :data:`sonar_kernels.specs.HYPERPARAMETERS`) on the host (a sync on a GPU; the Triton
    backend reads them in its kernels)."""
    _torch_update(weight, state, hyper, grad_in, foreach, fused, None, grad)


def _torch_update_of(
    weight, state, hyper, grad_in, foreach, fused, done, grad_dtype, defer, gradient
) -> None:
    """The torch backend's update of one weight, given its ``expert_gradient.ExpertGradient``: now, or
    through ``defer`` (see :func:`run_moe_mlp_bwd`)."""
    if defer is None:
        _torch_update(weight, state, hyper, grad_in, foreach, fused, done, gradient, grad_dtype=grad_dtype)
    else:
        defer(
            lambda later: _torch_update(
                weight, state, hyper, later, foreach, fused, done, gradient, grad_dtype=grad_dtype
            )
        )


def _torch_update(weight, state, hyper, grad_in, foreach, fused, done, grad, grad_dtype=None) -> None:
    """The body of :func:`expert_adamw_` (``grad`` a tensor) and of the torch backend's in-backward update
    (``grad`` an ``expert_gradient.ExpertGradient``, applied by chunks of experts of at most
    ``torch_backend.WGRAD_CHUNK_BYTES`` with torch's fused AdamW: :func:`torch_adamw_chunked_`); then
    ``done()`` when given. ``hyper``: the [5] float64 tensor, or the group's (lr, beta1, beta2, eps,
    weight_decay) as it holds them (see :func:`run_moe_mlp_bwd`). ``grad_dtype``: the gradient is rounded
    to it first (the update's grad_dtype, as the Triton epilogue rounds its accumulator); the sum with
    ``grad_in`` (already in that dtype) is rounded once more."""
    exp_avg, exp_avg_sq, step, grad_norm_sq, skipped = state
    hyperparameters = hyper if isinstance(hyper, tuple) else tuple(hyper.tolist())
    if isinstance(grad, ExpertGradient):
        torch_adamw_chunked_(
            weight, grad, grad_in, exp_avg, exp_avg_sq, step, hyperparameters, grad_norm_sq, skipped,
            grad_dtype=grad_dtype, foreach=foreach, fused=fused, chunk_bytes=torch_backend.WGRAD_CHUNK_BYTES,
        )  # fmt: skip
    else:
        if grad_dtype is not None:
            grad = grad.to(grad_dtype)
        total = grad if grad_in is None else grad_in + grad.to(grad_in.dtype)
        torch_adamw_(
            weight, total, exp_avg, exp_avg_sq, step, hyperparameters, grad_norm_sq, skipped,
            foreach=foreach, fused=fused,
        )  # fmt: skip
    if done is not None:
        done()


@expert_adamw_.register_fake
def _expert_adamw_fake(weight, grad, grad_in, state, hyper, foreach, fused):
    return None


def gradient_request(node, weight: Tensor) -> tuple[object, str]:
    """What the running backward does with the gradient of the leaf ``weight``, read from the engine at
    ``node`` (the backward node running now): (its AccumulateGrad node among ``node``'s next functions,
    or None when there is none, e.g. the weight is not a leaf; and one of "accumulate" (the gradient
    reaches .grad), "capture" (``torch.autograd.grad`` returns it to the caller and nothing is
    accumulated), "none" (the backward does not compute it: ``autograd.grad`` or ``backward(inputs=)``
    without it)). "accumulate" when there is no AccumulateGrad node: the gradient flows on."""
    for fn, _ in node.next_functions:
        variable = getattr(fn, "variable", None)
        if variable is not None and _same_tensor(variable, weight):
            try:
                return fn, ("accumulate" if torch._C._will_engine_execute_node(fn) else "none")
            except RuntimeError:
                # The engine refuses the question for a leaf whose gradient torch.autograd.grad captures.
                return fn, "capture"
    return None, "accumulate"


@torch.library.custom_op("sonar_kernels::check_update_requested", mutates_args=("step",))
def check_update_requested(weight: Tensor, step: Tensor, name: str) -> None:
    """Raise RuntimeError when the running backward does not accumulate the gradient of ``weight``, or of
    any other expert tensor with an in-backward update among the inputs of the compiled graph it runs in
    (``torch.autograd.grad`` or ``backward(inputs=...)`` without it, or ``torch.autograd.grad`` that
    returns it), which an in-backward update inside a compiled backward would otherwise consume. Checking
    every such input at the first check of the backward refuses a backward that asks for some layers'
    weights and not others before any layer's update.
    Then records the update with the owner of ``weight`` (``specs.ExpertUpdate.compiled_update``), which
    raises first when the tensor was already updated since the last ``step()``.
    Runs in Python inside the compiled backward, before the update (it is declared to mutate the
    update's ``step`` so that the graph keeps it there, ahead of the backward op that updates it; it
    writes no tensor). Eager backwards check this without the op (``sonar_kernels.autograd``)."""
    node = torch._C._current_autograd_node()
    if node is not None:  # None outside the engine's run of a node (compiled autograd): nothing to read
        _check_requested(node, weight, name)
    # Recorded with the owner (its norm and step bookkeeping): a second update before step(), or a
    # gradient that reaches .grad after this update (another use of the tensor outside the compiled
    # graph), then raises.
    update = specs.update_of(weight)
    if update is not None:
        update.compiled_update()


def _check_requested(node, weight: Tensor, name: str) -> None:
    checked = [(weight, name)] + [
        (fn.variable, "an expert tensor of this compiled graph")
        for fn, _ in node.next_functions
        if _updated_in_backward(getattr(fn, "variable", None))
    ]
    for tensor, what in checked:
        _, request = gradient_request(node, tensor)
        if request != "accumulate":
            verb = (
                "returns to its caller the gradient of"
                if request == "capture"
                else "does not compute the gradient of"
            )
            raise RuntimeError(
                f"{what}: this backward {verb} the expert tensor of shape {tuple(tensor.shape)}, and the compiled "
                "backward would update it in place; nothing was updated. Under torch.compile, run backward() "
                "over the expert weights, or run this backward without torch.compile"
            )


def _updated_in_backward(t) -> bool:
    update = None if t is None else specs.update_of(t)
    return update is not None and not update.reduce_first


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    return a is b or (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


@check_update_requested.register_fake
def _check_update_requested_fake(weight, step, name):
    return None
