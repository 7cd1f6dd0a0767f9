"""Triton launchers of the forward: routing metadata, up-projection + GLU, down-projection, combine."""

from __future__ import annotations

import torch
import triton

from sonar_kernels.kernels.expert_mlp_fwd import (
    COMBINE_CONFIG,
    TILE_M,
    expert_mlp_combine_kernel,
    expert_mlp_fwd_up_kernel,
    expert_mlp_grouped_mm_kernel,
)
from sonar_kernels.kernels.expert_mlp_tma import expert_mlp_fwd_up_tma_kernel
from sonar_kernels.kernels.routing import (
    routing_histogram_kernel,
    routing_scan_kernel,
    routing_scatter_kernel,
)
from sonar_kernels.ops import common
from sonar_kernels.ops.common import (
    gate_up_operand,
    input_precision,
    max_row_tiles,
    on_device,
    tile_offsets_for,
    triton_interpreting,
)
from sonar_kernels.ops.triton_backend import configs, tma
from sonar_kernels.specs import RoutingMetadata, down_view, gate_up_bias_view, parse_activation


def routing_block_config(num_experts: int) -> dict:
    """BLOCK_E covers all experts; the [BLOCK_S, BLOCK_E] one-hot tile of the histogram and scatter holds
    8192 elements, the scan's [BLOCK_B, BLOCK_E] tile 2048 (its cumsum over the blocks spills beyond)."""
    block_e = max(16, triton.next_power_of_2(num_experts))
    return {
        "BLOCK_E": block_e,
        "BLOCK_S": max(8, 8192 // block_e),
        "BLOCK_B": max(8, 2048 // block_e),
        "num_warps": 4,
    }


def routing_metadata(top_k_index: torch.Tensor, num_experts: int) -> RoutingMetadata:
    """Routing metadata on the device in three launches (see :class:`sonar_kernels.specs.RoutingMetadata`).

    A histogram per block of slots, a scan over the blocks, a scatter per block; the same stable
    (expert, slot) order as :func:`sonar_kernels.reference.routing_metadata`.

    Args:
        top_k_index: [T, top_k] int32/int64 expert ids, any strides; ids outside [0, E) are dropped.
        num_experts: E, 1 <= E <= 1024.
    Returns:
        RoutingMetadata with ``tile_offsets`` for row tiles of ``TILE_M`` rows. The tails of
        ``token_of_row`` and ``slot_of_row`` (rows >= expert_offsets[E]) are left unwritten.
    """
    T, top_k = top_k_index.shape
    S = T * top_k
    E = num_experts
    device = top_k_index.device
    meta = RoutingMetadata(
        expert_offsets=common.empty((E + 1,), torch.int32, device),
        tile_offsets=common.empty((E + 1,), torch.int32, device),
        row_of_slot=common.empty((S,), torch.int32, device),
        token_of_row=common.empty((S,), torch.int32, device),
        slot_of_row=common.empty((S,), torch.int32, device),
    )
    cfg = routing_block_config(E)
    num_blocks = max(1, triton.cdiv(S, cfg["BLOCK_S"]))
    block_rows = common.empty((num_blocks, E), torch.int32, device)  # the scan's workspace
    index = {"top_k_index_ptr": top_k_index, "S": S, "E": E, "top_k": top_k,
             "stride_index_t": top_k_index.stride(0), "stride_index_j": top_k_index.stride(1)}  # fmt: skip
    blocks = {"BLOCK_S": cfg["BLOCK_S"], "BLOCK_E": cfg["BLOCK_E"], "num_warps": cfg["num_warps"]}
    with on_device(device):
        routing_histogram_kernel[(num_blocks,)](block_rows_ptr=block_rows, **index, **blocks)
        routing_scan_kernel[(1,)](
            block_rows_ptr=block_rows, expert_offsets_ptr=meta.expert_offsets, tile_offsets_ptr=meta.tile_offsets,
            num_blocks=num_blocks, E=E, TILE_M=TILE_M, BLOCK_B=cfg["BLOCK_B"], BLOCK_E=cfg["BLOCK_E"],
            num_warps=cfg["num_warps"],
        )  # fmt: skip
        routing_scatter_kernel[(num_blocks,)](
            block_rows_ptr=block_rows, row_of_slot_ptr=meta.row_of_slot, token_of_row_ptr=meta.token_of_row,
            slot_of_row_ptr=meta.slot_of_row, **index, **blocks,
        )  # fmt: skip
    return meta


def moe_mlp_fwd(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
    layout: str = "concatenated",
    gate_up_proj_bias: torch.Tensor | None = None,
    down_proj_bias: torch.Tensor | None = None,
    up_proj: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, RoutingMetadata]:
    """Triton forward of the gated expert MLP; arguments as checked by :func:`check_moe_mlp_args`, the
    weights in ``layout`` (:data:`sonar_kernels.specs.LAYOUTS`; ``up_proj`` the up tensor of a separate
    layout), read in place; the optional biases ([E, 2I] in the layout's gate/up order, [E, H]) are added
    in fp32 before Hpre's and Y's rounding.

    Six launches: routing metadata (histogram, scan, scatter), up-projection + GLU, down-projection,
    combine. Any strides.
    Returns:
        (out [T, H] in the dtype of hidden_states, Hpre [S, 2I] in that dtype (rows past
        expert_offsets[E] unwritten), the routing metadata).
    """
    with on_device(hidden_states.device):
        return _launch_fwd(
            hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, layout,
            gate_up_proj_bias, down_proj_bias, up_proj,
        )  # fmt: skip


def _launch_fwd(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, layout, gate_up_proj_bias,
    down_proj_bias, up_proj,
):  # fmt: skip
    T, H = hidden_states.shape
    top_k = top_k_index.shape[1]
    w1 = gate_up_operand(gate_up_proj, layout, up_proj)  # [E, 2, I, H] ([E, 1, I, H] ungated)
    w2 = down_view(down_proj, layout)  # [E, H, I]
    E, halves, I = w1.base.shape[0], w1.halves, w1.I
    two_I = halves * I  # Hpre's width
    S = T * top_k
    dtype = hidden_states.dtype
    device = hidden_states.device
    interpret = triton_interpreting()
    out = common.empty((T, H), dtype, device)
    meta = routing_metadata(top_k_index, E)
    hpre = common.empty((S, two_I), dtype, device)
    if S == 0:
        return out.zero_(), hpre, meta

    precision = input_precision(dtype)
    a = common.empty((S, I), dtype, device)
    kind, alpha, limit = parse_activation(activation)
    # Without a bias the kernels get the weight's pointer and strides, never read.
    b1 = w1.base[:, :, :, 0] if gate_up_proj_bias is None else gate_up_bias_view(gate_up_proj_bias, layout)
    b2 = w2[:, :, 0] if down_proj_bias is None else down_proj_bias
    # The tile configuration of each GEMM: tuned per layer shape on a GPU (ops/triton_backend/configs.py), never per
    # token count; the routing tile offsets for the BLOCK_M it uses.
    key = (E, H, I, layout, str(w2.dtype), kind, gate_up_proj_bias is not None, down_proj_bias is not None)

    def up(cfg):
        # A TMA candidate where W1's layout allows it (else, pinned or tuned at another call, the pointer
        # kernel at its tile).
        w1_desc = (
            tma.up_descriptor(w1, H, cfg.BLOCK_N, cfg.BLOCK_K)
            if cfg.TMA and tma.tma_supported(device)
            else None
        )
        kernel = expert_mlp_fwd_up_kernel if w1_desc is None else expert_mlp_fwd_up_tma_kernel
        w1_args = (w1.base,) if w1_desc is None else (w1_desc,)
        w1_strides = w1.strides if w1_desc is None else ()
        kernel[(max_row_tiles(S, E, cfg.BLOCK_M) * triton.cdiv(I, cfg.BLOCK_N),)](
            hidden_states, *w1_args, b1, meta.token_of_row, meta.expert_offsets, tile_offsets_for(meta, cfg.BLOCK_M),
            hpre, a,
            E, H, I,
            hidden_states.stride(0), hidden_states.stride(1),
            *w1_strides,
            hpre.stride(0), hpre.stride(1), a.stride(0), a.stride(1), b1.stride(0), b1.stride(1), b1.stride(2),
            alpha, limit,
            ACTIVATION=kind, GATED=halves == 2, HAS_BIAS=gate_up_proj_bias is not None, **cfg.blocks(),
            INPUT_PRECISION=precision, INTERPRET=interpret, **cfg.launch(),
        )  # fmt: skip

    def up_offered():  # the TMA candidates where W1's layout allows them (host time: only when tuning)
        return configs.candidates("up", dtype, device, tma=tma.up_usable(w1, H))

    up(configs.choose("up", key, dtype, device, up, up_offered))

    y = common.empty((S, H), dtype, device)

    # W2[e] seen as [K = I, N = H]: (expert, half, k, n) strides for the TMA candidates (ops/triton_backend/tma.py).
    w2_strides = (w2.stride(0), 0, w2.stride(2), w2.stride(1))
    bias2 = (down_proj_bias, (b2.stride(0), b2.stride(1))) if down_proj_bias is not None else (None, (0, 0))

    def down(cfg):
        if cfg.TMA and tma.launch_grouped_mm(
            cfg, a, w2, w2_strides, 1, *bias2, meta, y, E, H, I, precision, interpret
        ):  # fmt: skip
            return
        expert_mlp_grouped_mm_kernel[(max_row_tiles(S, E, cfg.BLOCK_M) * triton.cdiv(H, cfg.BLOCK_N),)](
            a, w2, b2, meta.expert_offsets, tile_offsets_for(meta, cfg.BLOCK_M), y,
            E, H, I,
            a.stride(0), a.stride(1),
            w2.stride(0), w2.stride(1), w2.stride(2), 0,
            y.stride(0), y.stride(1), b2.stride(0), b2.stride(1),
            HALVES=1, HAS_BIAS=down_proj_bias is not None, **cfg.blocks(),
            INPUT_PRECISION=precision, INTERPRET=interpret, **cfg.launch(),
        )  # fmt: skip

    def offered():  # the TMA candidates where the layout allows them (host time: only when tuning)
        return configs.candidates("grouped_mm", dtype, device, tma=tma.usable(a, w2, w2_strides, 1, H))

    down(configs.choose("grouped_mm", (*key, "fwd"), dtype, device, down, offered))
    a = None  # freed before the combine (the closures above hold its cell, not the tensor)

    cc = COMBINE_CONFIG
    expert_mlp_combine_kernel[(triton.cdiv(T, cc["BLOCK_M"]), triton.cdiv(H, cc["BLOCK_N"]))](
        y, meta.row_of_slot, top_k_weights, out,
        T, H, top_k,
        y.stride(0), y.stride(1), top_k_weights.stride(0), top_k_weights.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=cc["BLOCK_M"], BLOCK_N=cc["BLOCK_N"], HAS_WEIGHTS=True, INTERPRET=interpret,
        num_warps=cc["num_warps"],
    )  # fmt: skip
    return out, hpre, meta
