"""Triton launchers of the backward's core, what a layer computes once (docs/design.md, "Backward and the
fused update"): dHpre with A and the routing-weight partial sums, the routing-weight gradient, dX. Each
expert tensor's gradient is a job of its own (``ops/triton_backend/wgrad.py``: the wgrad, with the AdamW update in its
epilogue or its split path); :func:`moe_mlp_bwd` runs the core and then every job of a layer. No host
sync on any path here."""

from __future__ import annotations

import torch
import triton

from sonar_kernels.kernels.expert_mlp_bwd import (
    DWEIGHTS_CONFIG,
    expert_mlp_bwd_dhpre_kernel,
    expert_mlp_bwd_dweights_kernel,
)
from sonar_kernels.kernels.expert_mlp_fwd import (
    COMBINE_CONFIG,
    expert_mlp_combine_kernel,
    expert_mlp_grouped_mm_kernel,
)
from sonar_kernels.ops import common
from sonar_kernels.ops.bias import down_bias_weight_term
from sonar_kernels.ops.common import (
    gate_up_operand,
    input_precision,
    max_row_tiles,
    on_device,
    tile_offsets_for,
    triton_interpreting,
)
from sonar_kernels.ops.triton_backend import configs, tma
from sonar_kernels.ops.triton_backend.update_bound import layer_magnitudes
from sonar_kernels.ops.triton_backend.wgrad import AdamWUpdate, GradAccumulator, check_wgrad, expert_wgrad
from sonar_kernels.specs import BackwardCore, RoutingMetadata, down_view, parse_activation


def moe_mlp_bwd(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    hpre: torch.Tensor,
    meta: RoutingMetadata,
    activation: str,
    needs_input_grad: tuple[bool, ...],
    gate_up_proj_update: AdamWUpdate | None = None,
    down_proj_update: AdamWUpdate | None = None,
    gate_up_proj_accumulator: GradAccumulator | None = None,
    down_proj_accumulator: GradAccumulator | None = None,
    layout: str = "concatenated",
    gate_up_proj_bias: torch.Tensor | None = None,
    down_proj_bias: torch.Tensor | None = None,
    needs_bias_grad: tuple[bool, bool] = (False, False),
    up_proj: torch.Tensor | None = None,
    up_proj_update: AdamWUpdate | None = None,
    up_proj_accumulator: GradAccumulator | None = None,
    gate_up_proj_bias_update: AdamWUpdate | None = None,
    down_proj_bias_update: AdamWUpdate | None = None,
    gate_up_proj_bias_accumulator: GradAccumulator | None = None,
    down_proj_bias_accumulator: GradAccumulator | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Triton backward of the gated expert MLP, with the optional AdamW update of the expert weights.

    :func:`moe_mlp_bwd_core` (dHpre, A and the routing-weight gradient, which read W2; dX, which reads W1),
    then one :func:`expert_wgrad` launch per expert tensor, covering every expert: dW2 (updates W2 when
    ``down_proj_update`` is given), dW1 (updates W1 when ``gate_up_proj_update`` is given; in a separate
    layout the gate tensor's and the up tensor's wgrad, each with its own update), then the biases'
    (db1, db2, each with its update when given) (docs/design.md). Every update and accumulator is validated before the first launch. No
    host sync; no atomics.

    Args:
        grad_out: [T, H] dtype of hidden_states; any strides, 0 included.
        hidden_states, top_k_weights, gate_up_proj, down_proj, layout, up_proj: the forward's inputs
            (the weights, their moments and gradients in ``layout``, :data:`sonar_kernels.specs.LAYOUTS`;
            ``up_proj`` the up tensor of a separate layout, else None).
        hpre, meta: saved by :func:`moe_mlp_fwd`.
        needs_input_grad: (hidden_states, top_k_weights, gate_up_proj, down_proj[, up_proj]).
        gate_up_proj_update, down_proj_update, up_proj_update, gate_up_proj_bias_update,
            down_proj_bias_update: apply AdamW to that expert tensor in place instead of returning its
            gradient (validated before any launch; ``step`` advances unless the update is skipped for a
            non-finite or too large gradient, see :class:`AdamWUpdate`).
        gate_up_proj_accumulator, down_proj_accumulator, up_proj_accumulator,
            gate_up_proj_bias_accumulator, down_proj_bias_accumulator: add that tensor's gradient to a
            buffer instead of returning it.
        gate_up_proj_bias, down_proj_bias, needs_bias_grad: the forward's biases (or None) and whether
            their gradients are needed (``ops/bias.py``).
    Returns:
        (grad hidden_states, grad top_k_weights, grad gate_up_proj, grad down_proj, grad
        gate_up_proj_bias, grad down_proj_bias, grad up_proj); None where not needed, where the weight
        was updated in place, or where its gradient went to an accumulator.
    Raises:
        TypeError, ValueError: see :func:`check_update`; an accumulator whose buffer does not have
            the weight's shape, strides and device or a supported dtype, or a weight with both an
            update and an accumulator.
    """
    jobs = (
        ("down_proj", down_proj, down_proj_update, down_proj_accumulator),
        ("gate_up_proj", gate_up_proj, gate_up_proj_update, gate_up_proj_accumulator),
        ("up_proj", up_proj, up_proj_update, up_proj_accumulator),
        ("gate_up_proj_bias", gate_up_proj_bias, gate_up_proj_bias_update, gate_up_proj_bias_accumulator),
        ("down_proj_bias", down_proj_bias, down_proj_bias_update, down_proj_bias_accumulator),
    )
    for name, weight, update, accumulator in jobs:
        check_wgrad(name, weight, update, accumulator)
    need_x, need_w, need_w1, need_w2, need_w3 = (*needs_input_grad, False)[:5]
    needs = {
        "gate_up_proj": need_w1,
        "down_proj": need_w2,
        "up_proj": need_w3 and up_proj is not None,
        "gate_up_proj_bias": needs_bias_grad[0] and gate_up_proj_bias is not None,
        "down_proj_bias": needs_bias_grad[1] and down_proj_bias is not None,
    }
    has_update = any(update is not None for _, _, update, _ in jobs)
    need_dhpre = needs["gate_up_proj"] or needs["up_proj"] or needs["gate_up_proj_bias"]
    grad_x, grad_w, grad_hpre, a, largest = moe_mlp_bwd_core(
        grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation,
        (need_x, need_w, need_dhpre, needs["down_proj"], has_update), layout, down_proj_bias, up_proj,
    )  # fmt: skip
    I = a.shape[1] if a is not None else down_view(down_proj, layout).shape[2]
    operands = {
        "down_proj": (grad_out, a),
        "gate_up_proj": (
            grad_hpre if up_proj is None or grad_hpre is None else grad_hpre[:, :I],
            hidden_states,
        ),
        "up_proj": (None if grad_hpre is None else grad_hpre[:, I:], hidden_states),
        "gate_up_proj_bias": (grad_hpre, None),
        "down_proj_bias": (grad_out, None),
    }
    del a, grad_hpre
    grads = {}
    for name, weight, update, accumulator in jobs:
        if needs[name]:
            p, q = operands.pop(name)
            grads[name] = expert_wgrad(
                name, weight, p, q, top_k_weights, meta, layout, largest, update, accumulator, checked=True
            )
            del p, q
        else:
            operands.pop(name)
    return (
        grad_x, grad_w, grads.get("gate_up_proj"), grads.get("down_proj"), grads.get("gate_up_proj_bias"),
        grads.get("down_proj_bias"), grads.get("up_proj"),
    )  # fmt: skip


def moe_mlp_bwd_core(
    grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation, needs,
    layout="concatenated", down_proj_bias=None, up_proj=None, hpre_writable=False,
):  # fmt: skip
    """What the backward computes once per layer, before the expert tensors' wgrads: (dX [T, H], d
    top_k_weights [T, top_k], dHpre [S, 2I], A [S, I], the magnitudes that bound the updated tensors'
    gradients and the flags they give ([n] float32, ``ops/triton_backend/update_bound.py``'s ``layer_magnitudes``)), each
    None where ``needs`` (the same five) says no.

    Launch order: dHpre with A, the routing-weight partial sums and the largest |A| and |dHpre| (reads W2),
    the magnitudes pass and its flags, the routing-weight reduction, dX rows and their sum over top_k (reads
    W1: ``gate_up_proj`` and ``up_proj`` in ``layout``). dHpre and A have max(S, 1) rows (the rows past the
    kept ones are never written or read). ``hpre_writable`` is the torch backend's (Hpre is never written
    here). No host sync; no atomics."""
    with on_device(hidden_states.device):
        return _launch_core(
            grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation, needs,
            layout, down_proj_bias, up_proj,
        )  # fmt: skip


def _launch_core(
    grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation, needs, layout,
    down_proj_bias, up_proj,
):  # fmt: skip
    need_x, need_w, need_dhpre, need_a, need_magnitudes = needs
    T, H = hidden_states.shape
    top_k = top_k_weights.shape[1]
    # The kernels read the weights through these views: W1 [E, 2, I, H] (a separate layout's gate or up
    # tensor: [E, 1, I, H]), W2 [E, H, I], whatever the layout.
    w2 = down_view(down_proj, layout)
    w1 = gate_up_operand(gate_up_proj, layout, up_proj)
    E, halves, I = w1.base.shape[0], w1.halves, w1.I
    two_I = halves * I  # Hpre's width (I without a gate)
    S = T * top_k
    dtype = hidden_states.dtype
    device = hidden_states.device
    interpret = triton_interpreting()
    precision = input_precision(dtype)
    # Buffers have S rows (the kept rows are fewer; the tail is never written nor read); at least one
    # row so that no kernel gets a null pointer.
    num_rows = max(S, 1)

    need_grad_hpre = need_x or need_dhpre
    grad_hpre = common.empty((num_rows, two_I), dtype, device) if need_grad_hpre else None
    a = common.empty((num_rows, I), dtype, device) if need_a else None
    kind, alpha, limit = parse_activation(activation)
    run_dhpre = S > 0 and (need_grad_hpre or need_w or need_a)

    def dhpre(cfg):
        """dHpre (and A, the routing-weight partial sums, the magnitudes) with tile configuration ``cfg``;
        returns (the partial sums [cdiv(I, BLOCK_N) * EPILOGUE_SPLIT, rows] or None, the magnitudes or
        None)."""
        num_pid_n = triton.cdiv(I, cfg.BLOCK_N)
        # One row of partial sums per column slice of each column tile (the kernel's EPILOGUE_SPLIT).
        num_partials = num_pid_n * cfg.EPILOGUE_SPLIT
        dw_partial = common.empty((num_partials, num_rows), torch.float32, device) if need_w else None
        if not run_dhpre:
            return dw_partial, None
        num_row_tiles = max_row_tiles(S, E, cfg.BLOCK_M)
        absmax = (
            common.empty((num_row_tiles * num_pid_n, 2), torch.float32, device) if need_magnitudes else None
        )
        any_buffer = next(t for t in (grad_hpre, a, dw_partial) if t is not None)
        grad_hpre_arg = grad_hpre if grad_hpre is not None else any_buffer
        a_arg = a if a is not None else any_buffer
        dw_partial_arg = dw_partial if dw_partial is not None else any_buffer
        expert_mlp_bwd_dhpre_kernel[(num_row_tiles * num_pid_n,)](
            grad_out, w2, hpre, top_k_weights, meta.token_of_row, meta.slot_of_row,
            meta.expert_offsets, tile_offsets_for(meta, cfg.BLOCK_M), grad_hpre_arg, a_arg, dw_partial_arg,
            any_buffer if absmax is None else absmax,
            E, H, I, top_k,
            grad_out.stride(0), grad_out.stride(1),
            w2.stride(0), w2.stride(1), w2.stride(2),
            hpre.stride(0), hpre.stride(1), top_k_weights.stride(0), top_k_weights.stride(1),
            grad_hpre_arg.stride(0), grad_hpre_arg.stride(1), a_arg.stride(0), a_arg.stride(1),
            dw_partial_arg.stride(0), alpha, limit,
            ACTIVATION=kind, GATED=halves == 2, **cfg.blocks(), EPILOGUE_SPLIT=cfg.EPILOGUE_SPLIT,
            STORE_GRAD_HPRE=need_grad_hpre, STORE_A=need_a, COMPUTE_DW=need_w, HAS_ABSMAX=absmax is not None,
            INPUT_PRECISION=precision, INTERPRET=interpret, **cfg.launch(),
        )  # fmt: skip
        return dw_partial, absmax

    # The tile configuration: tuned per layer shape on a GPU (ops/triton_backend/configs.py), never per token count.
    key = (E, H, I, layout, str(w2.dtype), kind, need_w, need_a, need_grad_hpre)
    dw_partial, absmax = dhpre(configs.choose("dhpre", key, dtype, device, dhpre if run_dhpre else None))
    # The magnitudes that bound the updated tensors' gradients and their flags (ops/triton_backend/update_bound.py).
    largest = None
    if need_magnitudes:
        largest = layer_magnitudes(hidden_states, grad_out, top_k_weights, absmax, meta.expert_offsets)
    del absmax

    grad_w = None
    if need_w:
        grad_w = common.empty((T, top_k), top_k_weights.dtype, device)
        if S > 0:
            dc = DWEIGHTS_CONFIG
            # The down bias's part of each slot's gradient, <dO[t], b2[e]>, summed in the same fp32.
            extra = (
                None
                if down_proj_bias is None
                else down_bias_weight_term(grad_out, down_proj_bias, meta, top_k)
            )
            expert_mlp_bwd_dweights_kernel[(triton.cdiv(S, dc["BLOCK"]),)](
                dw_partial, dw_partial if extra is None else extra, meta.row_of_slot, grad_w,
                S, dw_partial.shape[0], dw_partial.stride(0),
                BLOCK=dc["BLOCK"], HAS_EXTRA=extra is not None, INTERPRET=interpret, num_warps=dc["num_warps"],
            )  # fmt: skip
    del dw_partial

    grad_x = None
    if need_x:
        grad_x = common.empty((T, H), dtype, device)
        if S == 0:
            grad_x.zero_()
        else:
            grad_x = _dx(grad_hpre, w1, meta, grad_x, top_k, dtype, interpret, key[:5])
    return BackwardCore(grad_x, grad_w, grad_hpre if need_dhpre else None, a, largest)


def _dx(grad_hpre, w1, meta, grad_x, top_k, dtype, interpret, key):
    """dX[t] = sum_j dHpre[row(t, j)] @ W1[e]: the forward's grouped GEMM over W1's two halves (``w1`` as
    :func:`sonar_kernels.ops.common.gate_up_operand` gives it, each half read as [H, I]), then its
    combine without weights. ``key``: the layer's tuning key (ops/triton_backend/configs.py)."""
    T, H = grad_x.shape
    S = T * top_k
    E, halves, I = w1.base.shape[0], w1.halves, w1.I
    stride_e, stride_half, stride_i, stride_h = w1.strides
    dx_rows = common.empty((S, H), dtype, grad_x.device)

    # W1[e, half] seen as [K = I, N = H]: (expert, half, k, n) strides for the TMA candidates (ops/triton_backend/tma.py).
    w1_strides = (stride_e, stride_half, stride_i, stride_h)

    def rows(cfg):
        if cfg.TMA and tma.launch_grouped_mm(
            cfg, grad_hpre, w1.base, w1_strides, halves, None, (0, 0), meta, dx_rows, E, H, I,
            input_precision(dtype), interpret,
        ):  # fmt: skip
            return
        expert_mlp_grouped_mm_kernel[(max_row_tiles(S, E, cfg.BLOCK_M) * triton.cdiv(H, cfg.BLOCK_N),)](
            grad_hpre, w1.base, w1.base, meta.expert_offsets, tile_offsets_for(meta, cfg.BLOCK_M), dx_rows,
            E, H, I,
            grad_hpre.stride(0), grad_hpre.stride(1),
            stride_e, stride_h, stride_i, stride_half,
            dx_rows.stride(0), dx_rows.stride(1), 0, 0,
            HALVES=halves, HAS_BIAS=False, **cfg.blocks(),
            INPUT_PRECISION=input_precision(dtype), INTERPRET=interpret, **cfg.launch(),
        )  # fmt: skip

    def offered():  # the TMA candidates where the layout allows them (host time: only when tuning)
        usable = tma.usable(grad_hpre, w1.base, w1_strides, halves, H)
        return configs.candidates("grouped_mm", dtype, grad_x.device, tma=usable)

    rows(configs.choose("grouped_mm", (*key, "dX"), dtype, grad_x.device, rows, offered))
    cc = COMBINE_CONFIG
    expert_mlp_combine_kernel[(triton.cdiv(T, cc["BLOCK_M"]), triton.cdiv(H, cc["BLOCK_N"]))](
        dx_rows, meta.row_of_slot, dx_rows, grad_x,
        T, H, top_k,
        dx_rows.stride(0), dx_rows.stride(1), 0, 0, grad_x.stride(0), grad_x.stride(1),
        BLOCK_M=cc["BLOCK_M"], BLOCK_N=cc["BLOCK_N"], HAS_WEIGHTS=False, INTERPRET=interpret,
        num_warps=cc["num_warps"],
    )  # fmt: skip
    return grad_x
