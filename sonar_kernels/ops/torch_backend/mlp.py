"""The "torch" backend: the expert MLP in plain PyTorch on grouped GEMMs, for the CPU and the paper's method.

Not the test oracle (that is ``sonar_kernels/reference.py``): the same math and rounding points as the
Triton kernels (Hpre, A and each expert output rounded to the activation dtype, the combine over top_k
summed in fp32), built from ``torch._grouped_mm`` (one GEMM launch over all experts, as transformers'
"grouped_mm" experts do), without a host sync. Where this torch's grouped GEMM does not take the device,
dtype or strides (it needs 16-byte aligned strides), each expert's rows go through ``torch.mm`` in a loop
over host row offsets (one host read of E + 1 integers per call).

Every function here runs inside a ``sonar_kernels::`` custom op, so torch.compile sees one opaque op
with static shapes whichever path runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sonar_kernels.kernels.expert_mlp_fwd import TILE_M
from sonar_kernels.ops.bias import down_bias_weight_term
from sonar_kernels.ops.torch_backend.expert_gradient import row_weights
from sonar_kernels.ops.torch_backend.glu import glu, glu_bwd
from sonar_kernels.ops.torch_backend.grouped_gemm import grouped_mm
from sonar_kernels.ops.torch_backend.wgrad import expert_gradient
from sonar_kernels.specs import (
    RoutingMetadata,
    down_view,
    gate_up_bias_view,
    gate_up_view,
    is_gated,
)


def routing_metadata(top_k_index: torch.Tensor, num_experts: int) -> RoutingMetadata:
    """The routing metadata by a stable sort, on the device, no host sync (see
    :class:`sonar_kernels.specs.RoutingMetadata`; ``tile_offsets`` for the Triton kernels' TILE_M rows).
    Rows past ``expert_offsets[E]`` hold the dropped slots."""
    T, top_k = top_k_index.shape
    S = T * top_k
    device = top_k_index.device
    flat = top_k_index.reshape(-1)
    kept = (flat >= 0) & (flat < num_experts)
    key = torch.where(kept, flat.long(), num_experts)
    order = torch.sort(key, stable=True).indices
    bounds = torch.arange(num_experts + 1, device=device)
    expert_offsets = torch.searchsorted(key[order], bounds, side="left").to(torch.int32)
    counts = expert_offsets[1:] - expert_offsets[:-1]
    tile_offsets = torch.zeros_like(expert_offsets)
    tile_offsets[1:] = torch.cumsum(torch.div(counts + TILE_M - 1, TILE_M, rounding_mode="floor"), 0)
    slot_of_row = order.to(torch.int32)
    row_of_slot = torch.empty(S, dtype=torch.int32, device=device)
    row_of_slot[order] = torch.arange(S, dtype=torch.int32, device=device)
    row_of_slot = torch.where(kept, row_of_slot, -1)
    token_of_row = torch.div(slot_of_row, top_k, rounding_mode="floor")
    return RoutingMetadata(expert_offsets, tile_offsets, row_of_slot, token_of_row, slot_of_row)


def _expert_blocks(bounds: list[int], rows: int) -> list[tuple[int, int]]:
    """Consecutive ranges of experts (first, last) of at most ``rows`` rows each (at least one expert)."""
    blocks, first, E = [], 0, len(bounds) - 1
    while first < E:
        last = first + 1
        while last < E and bounds[last + 1] - bounds[first] <= rows:
            last += 1
        blocks.append((first, last))
        first = last
    return blocks


def _gathered_blocks(source, index, weight, expert_offsets, row_bytes: int):
    """Yield (start, end, rows): rows[r - start] = source[index[r]] @ weight[e(r)] for the rows ``start``
    to ``end - 1`` ([end - start, N] in ``source``'s dtype; ``source`` [T, K], ``weight`` [E, K, N]).

    On the CPU a block of whole experts at a time, of at most about ``row_bytes`` per row of the wider of
    the gathered rows and the result (at least one expert): the rows are gathered into one small buffer
    and each expert's GEMM is a ``torch.mm`` (what torch's CPU grouped GEMM runs per group: the same bits)
    into another, reused by the next block (read a block before asking for the next). Rows past
    ``expert_offsets[E]`` are in no block. Elsewhere one block of all S rows: the rows gathered whole and
    one grouped GEMM (no host read)."""
    S, K, N = index.shape[0], source.shape[1], weight.shape[2]
    if source.device.type != "cpu":
        yield 0, S, grouped_mm(torch.index_select(source, 0, index), weight, expert_offsets)
        return
    bounds = expert_offsets.tolist()  # host read: the CPU
    blocks = _expert_blocks(bounds, max(1, row_bytes // (4 * max(K, N, 1))))
    most = max(bounds[last] - bounds[first] for first, last in blocks)
    gathered = torch.empty(most, K, dtype=source.dtype, device=source.device)
    out = torch.empty(most, N, dtype=source.dtype, device=source.device)
    for first, last in blocks:
        start, end = bounds[first], bounds[last]
        if end <= start:
            continue
        block = torch.index_select(source, 0, index[start:end], out=gathered[: end - start])
        for e in range(first, last):
            if bounds[e + 1] > bounds[e]:
                rows = slice(bounds[e] - start, bounds[e + 1] - start)
                torch.mm(block[rows], weight[e], out=out[rows])
        yield start, end, out[: end - start]


def _gathered_grouped_mm(source, index, weight, expert_offsets) -> torch.Tensor:
    """out[r] = source[index[r]] @ weight[e(r)] ([S, K] rows of ``source`` [T, K], ``weight`` [E, K, N]
    -> [S, N]); rows past ``expert_offsets[E]`` unspecified. On the CPU by :func:`_gathered_blocks` (the
    gathered [S, K] tensor never exists); elsewhere one grouped GEMM over the rows gathered whole."""
    if source.device.type != "cpu":
        return grouped_mm(torch.index_select(source, 0, index), weight, expert_offsets)
    out = torch.empty(index.shape[0], weight.shape[2], dtype=source.dtype, device=source.device)
    for start, end, rows in _gathered_blocks(source, index, weight, expert_offsets, ROW_BLOCK_BYTES):
        out[start:end].copy_(rows)
    return out


def _grouped_mm_sum_to_tokens(rows, weight, meta: RoutingMetadata, T: int) -> torch.Tensor:
    """out[t] = sum over the kept slots of token t of (rows[r] @ weight[e(r)]) rounded to the rows' dtype,
    summed in fp32 -> [T, N] fp32: dX from dHpre on the CPU, a block of experts at a time (one small
    buffer, no [S, N] tensor), each block added to its tokens by ``index_add_`` (deterministic on the CPU).
    A token's rows are summed in expert order, which for top_k <= 2 is exactly the slot order of
    :func:`_combine` (one addition to 0, then one more: IEEE addition commutes)."""
    N = weight.shape[2]
    out = torch.zeros(T, N, dtype=torch.float32, device=rows.device)
    bounds = meta.expert_offsets.tolist()  # host read: the CPU
    blocks = _expert_blocks(bounds, max(1, ROW_BLOCK_BYTES // (4 * max(N, 1))))
    most = max(bounds[last] - bounds[first] for first, last in blocks)
    buffer = torch.empty(most, N, dtype=rows.dtype, device=rows.device)
    tokens = meta.token_of_row.long()
    for first, last in blocks:
        start, end = bounds[first], bounds[last]
        if end <= start:
            continue
        for e in range(first, last):
            if bounds[e + 1] > bounds[e]:
                torch.mm(
                    rows[bounds[e] : bounds[e + 1]],
                    weight[e],
                    out=buffer[bounds[e] - start : bounds[e + 1] - start],
                )
        out.index_add_(0, tokens[start:end], buffer[: end - start].float())
    return out


def _combine(rows: torch.Tensor, meta: RoutingMetadata, weights: torch.Tensor | None, T: int, top_k: int):
    """out[t] = sum_j w[t, j] rows[row_of_slot(t, j)] in fp32 over the kept slots (w = 1 without weights),
    summed in slot order.

    One slot at a time, each gathered [T, H] and written into (at most two [T, H] tensors beside ``rows``,
    never a [T, top_k, H] one); the mask of dropped slots is applied only where a slot was dropped (read on
    the host on the CPU, where it costs nothing; always on a GPU, without a host sync)."""
    slots = meta.row_of_slot.reshape(T, top_k)
    kept = slots >= 0
    index = slots.clamp(min=0).long()
    masked = kept.device.type != "cpu" or not bool(kept.all())
    out = None
    for j in range(top_k):
        part = torch.index_select(rows, 0, index[:, j]).float()
        if weights is not None:
            part.mul_(weights[:, j : j + 1].float())
        if masked:
            part.masked_fill_(~kept[:, j : j + 1], 0.0)
        out = part if out is None else out.add_(part)
        del part
    if out is None:  # top_k 0: no slot, a zero sum
        out = torch.zeros(T, rows.shape[1], dtype=torch.float32, device=rows.device)
    return out


def _activate(gate: torch.Tensor, up: torch.Tensor | None, activation: str) -> torch.Tensor:
    """:func:`glu` with its last product written into its first temporary (a tensor of its own here, no
    autograd: the ops' bodies), so SwiGLU allocates one [S, I] tensor, not two. The same bits as glu."""
    if activation == "silu" and up is not None:
        return F.silu(gate).mul_(up)
    return glu(gate, up, activation)


# The torch backend's SwiGLU backward runs over blocks of rows of about this many bytes per [rows, I]
# fp32 temporary: its temporaries stay in the cache and small (no fresh, page-faulted [S, I] tensors).
ROW_BLOCK_BYTES = 1 << 18


def _swiglu_bwd(grad_out, tokens, w2, meta, hpre, w_row, dtype, per_row, grad_hpre) -> torch.Tensor:
    """The SwiGLU part of the backward, a block of rows at a time from G = dO[token_r] @ W2[e] (computed
    per block of experts by :func:`_gathered_blocks`, so no [S, I] G exists): returns A = silu(gate) * up
    (the forward's formula, rounded to ``dtype``: the W2 wgrad's operand); fills ``per_row`` (when given)
    with <G_r, A_r> and ``grad_hpre`` (when given; [S, 2I] in ``dtype``: d gate, then d up) with
    :func:`glu_bwd`'s values for dA = w_r G_r, each product in glu_bwd's order, rounded to ``dtype``.
    ``grad_hpre`` may be ``hpre`` itself: each block of Hpre is read before its block of dHpre is written
    over it. The same bits as the whole-tensor formulas, block by block. Rows past ``expert_offsets[E]``
    are left unspecified."""
    S, I = hpre.shape[0], w2.shape[2]
    a = torch.empty(S, I, dtype=dtype, device=hpre.device)
    sub = max(1, ROW_BLOCK_BYTES // (4 * max(I, 1)))  # rows per elementwise block
    for start, end, g_rows in _gathered_blocks(grad_out, tokens, w2, meta.expert_offsets, ROW_BLOCK_BYTES):
        g_rows = g_rows.float()
        for r0 in range(start, end, sub):
            r1 = min(r0 + sub, end)
            g = g_rows[r0 - start : r1 - start]
            gate, up = hpre[r0:r1, :I].float(), hpre[r0:r1, I:].float()
            if dtype == torch.float32:
                block = torch.mul(F.silu(gate), up, out=a[r0:r1])
            else:
                block = a[r0:r1].copy_(F.silu(gate).mul_(up)).float()
            if per_row is not None:
                torch.sum(g * block, dim=1, out=per_row[r0:r1])
            if grad_hpre is None:
                continue
            grad = g.mul_(w_row[r0:r1, None])  # dA = w_r G_r
            sig = torch.sigmoid(gate)
            act_grad = torch.rsub(sig, 1.0).mul_(gate).add_(1.0).mul_(sig)  # sig * (1 + gate * (1 - sig))
            d_gate = torch.mul(grad, up).mul_(act_grad)  # dA * up * act_grad (reads up: before d up)
            d_up = grad_hpre[r0:r1, I:]
            if dtype == torch.float32:
                torch.mul(gate, sig, out=d_up).mul_(grad)  # dA * (gate * sig) (reads gate: before d gate)
            else:
                d_up.copy_(torch.mul(gate, sig).mul_(grad))
            grad_hpre[r0:r1, :I].copy_(d_gate)
    return a


def _glu_bwd_into(gate, up, grad_a, activation, out: torch.Tensor) -> None:
    """:func:`glu_bwd`'s results written into ``out`` ([S, I] or [S, 2I] fp32: d gate, then d up); SwiGLU
    takes :func:`_swiglu_bwd` instead."""
    I = gate.shape[1]
    d_gate, d_up = glu_bwd(gate, up, grad_a, activation)
    out[:, :I].copy_(d_gate)
    if d_up is not None:
        out[:, I:].copy_(d_up)


def concatenated(
    gate_up_proj: torch.Tensor, layout: str, dtype: torch.dtype, up_proj: torch.Tensor | None = None
) -> torch.Tensor:
    """W1 of ``layout`` as [E, 2I, H] (gate rows, then up rows) in ``dtype``: a view where the layout
    allows it, else a temporary copy (the interleaved and separate layouts, ``up_proj`` the latter's up
    tensor; fp32 master weights under 16-bit compute)."""
    w1 = gate_up_view(gate_up_proj, layout)
    if up_proj is not None:
        w1 = torch.cat((w1, gate_up_view(up_proj, layout)), dim=1)
    return w1.reshape(w1.shape[0], w1.shape[1] * w1.shape[2], w1.shape[3]).to(dtype)


def moe_mlp_fwd(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, layout="concatenated",
    gate_up_proj_bias=None, down_proj_bias=None, up_proj=None,
):  # fmt: skip
    """Forward of the gated expert MLP, the weights in ``layout`` (:data:`sonar_kernels.specs.LAYOUTS`;
    ``up_proj`` the up tensor of a separate layout), with optional biases ([E, 2I] in the layout's gate/up order, [E, H]; each added to the rounded GEMM
    output in fp32, then rounded again: one rounding more than the Triton kernels in 16-bit dtypes);
    returns (out [T, H], Hpre [S, 2I], the routing metadata)."""
    T = hidden_states.shape[0]
    top_k = top_k_index.shape[1]
    dtype = hidden_states.dtype
    w1 = concatenated(gate_up_proj, layout, dtype, up_proj)
    w2 = down_view(down_proj, layout).to(dtype)
    E, I = w1.shape[0], w2.shape[2]
    meta = routing_metadata(top_k_index, E)
    tokens = meta.token_of_row.long()
    hpre = grouped_mm(torch.index_select(hidden_states, 0, tokens), w1.transpose(1, 2), meta.expert_offsets)
    experts = None if gate_up_proj_bias is None and down_proj_bias is None else _expert_of_row(meta)
    if gate_up_proj_bias is not None:
        bias = gate_up_bias_view(gate_up_proj_bias, layout).flatten(1, 2)  # [E, 2I], gate first
        hpre = (hpre.float() + bias.float()[experts]).to(dtype)
    up = hpre[:, I:].float() if hpre.shape[1] == 2 * I else None  # None: no gate
    a = _activate(hpre[:, :I].float(), up, activation).to(dtype)
    y = grouped_mm(a, w2.transpose(1, 2), meta.expert_offsets)
    if down_proj_bias is not None:
        y = (y.float() + down_proj_bias.float()[experts]).to(dtype)
    out = _combine(y, meta, top_k_weights, T, top_k).to(dtype)
    return out, hpre, meta


def moe_mlp_bwd(
    grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation, needs_input_grad,
    *, gate_up_proj_update=None, down_proj_update=None, layout="concatenated", gate_up_proj_bias=None,
    down_proj_bias=None, needs_bias_grad=(False, False), up_proj=None, up_proj_update=None,
    gate_up_proj_bias_update=None, down_proj_bias_update=None, hpre_writable=False,
):  # fmt: skip
    """Backward of :func:`moe_mlp_fwd`: (dX, d top_k_weights, d gate_up_proj, d down_proj, d
    gate_up_proj_bias, d down_proj_bias, d up_proj), None where ``needs_input_grad`` (x, weights,
    gate_up_proj, down_proj[, up_proj]) or ``needs_bias_grad`` says no (or there is no bias or up_proj).
    :func:`moe_mlp_bwd_core`, then each expert tensor's gradient (:func:`expert_gradient`): the down
    projection's first (its operand A is released then), the gate/up projection's last.

    ``down_proj_update`` / ``gate_up_proj_update`` / ``up_proj_update`` / the biases' updates: a callable
    that updates the tensor in place, given its :class:`ExpertGradient` (computed whole or by chunks of
    experts when asked); None is returned for that tensor. ``hpre_writable``: as for
    :func:`moe_mlp_bwd_core`."""
    need_x, need_w, need_w1, need_w2, need_w3 = (*needs_input_grad, False)[:5]
    need_w3 = need_w3 and up_proj is not None
    need_b1 = needs_bias_grad[0] and gate_up_proj_bias is not None
    need_b2 = needs_bias_grad[1] and down_proj_bias is not None
    grad_x, grad_w, grad_hpre, a = moe_mlp_bwd_core(
        grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation,
        (need_x, need_w, need_w1 or need_w3 or need_b1, need_w2), layout=layout, down_proj_bias=down_proj_bias,
        up_proj=up_proj, hpre_writable=hpre_writable,
    )  # fmt: skip
    I = down_view(down_proj, layout).shape[2]
    # (name, needed, tensor, update, P, Q): in the order the gradients are computed.
    jobs = (
        ("down_proj_bias", need_b2, down_proj_bias, down_proj_bias_update, grad_out, None),
        ("down_proj", need_w2, down_proj, down_proj_update, grad_out, a),
        ("gate_up_proj_bias", need_b1, gate_up_proj_bias, gate_up_proj_bias_update, grad_hpre, None),
        ("gate_up_proj", need_w1, gate_up_proj, gate_up_proj_update,
         grad_hpre if up_proj is None or grad_hpre is None else grad_hpre[:, :I], hidden_states),
        ("up_proj", need_w3, up_proj, up_proj_update, None if grad_hpre is None else grad_hpre[:, I:], hidden_states),
    )  # fmt: skip
    del a, grad_hpre
    grads = {}
    for name, need, weight, update, p, q in jobs:
        if need:
            gradient = expert_gradient(name, weight, p, q, top_k_weights, meta, layout)
            grads[name] = gradient.full() if update is None else update(gradient)
            del gradient
    jobs = None
    return (
        grad_x, grad_w, grads.get("gate_up_proj"), grads.get("down_proj"), grads.get("gate_up_proj_bias"),
        grads.get("down_proj_bias"), grads.get("up_proj"),
    )  # fmt: skip


def moe_mlp_bwd_core(
    grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, meta, activation, needs, *,
    layout="concatenated", down_proj_bias=None, up_proj=None, hpre_writable=False,
):  # fmt: skip
    """What the backward of :func:`moe_mlp_fwd` computes once per layer: (dX [T, H], d top_k_weights
    [T, top_k], dHpre [S, 2I], A [S, I]), each None where ``needs`` (dX, d top_k_weights, dHpre, A)
    says no. The routing-weight gradient is <dO[t], Y[r]> = <G[r], A[r]> with G = dO[token] @ W2[e];
    dX reads W1 (``gate_up_proj`` and ``up_proj`` in ``layout``). dHpre and A are the operands of the
    expert tensors' gradients (:func:`expert_gradient`).

    ``hpre_writable``: the caller will not read ``hpre`` again (the graph is freed after this backward),
    so SwiGLU's dHpre is written over it instead of into a tensor of its own (one [S, 2I] tensor fewer)."""
    need_x, need_w, need_dhpre, need_a = needs
    T = hidden_states.shape[0]
    top_k = top_k_weights.shape[1]
    halves, I = (2 if is_gated(layout) else 1), down_view(down_proj, layout).shape[2]
    S = T * top_k
    dtype = hidden_states.dtype
    # Rows past expert_offsets[E] (dropped slots) hold whatever the grouped GEMMs left there: no GEMM
    # below reads them (each expert's rows end at its offset) and the combines mask them, so nothing here
    # spends a pass masking them; their routing weight is 0.
    tokens = meta.token_of_row.long()
    w_row = row_weights(top_k_weights, meta)
    grad_x = grad_w = None
    need_g = need_x or need_w or need_dhpre
    need_d = need_x or need_dhpre  # dHpre
    grad_hpre = a = g = None
    if need_g:
        w2 = down_view(down_proj, layout).to(dtype)
        per_row = torch.empty(S, dtype=torch.float32, device=grad_out.device) if need_w else None
        if activation == "silu" and halves == 2:  # SwiGLU: G, A and dHpre by blocks of rows
            if need_d:
                grad_hpre = hpre if hpre_writable else torch.empty_like(hpre)
            a = _swiglu_bwd(grad_out, tokens, w2, meta, hpre, w_row, dtype, per_row, grad_hpre)
        else:
            # G = dO[token_r] @ W2[e]: on the CPU from dO's rows gathered a block at a time.
            g = _gathered_grouped_mm(grad_out, tokens, w2, meta.expert_offsets).float()
            gate, up = hpre[:, :I].float(), (hpre[:, I:].float() if halves == 2 else None)
            a = _activate(gate, up, activation).to(dtype)
            if need_w:
                torch.sum(g * a.float(), dim=1, out=per_row)
            if need_d:
                d_hpre = torch.empty(S, halves * I, dtype=torch.float32, device=g.device)
                _glu_bwd_into(gate, up, g.mul_(w_row[:, None]), activation, d_hpre)  # dA = w_r G_r
                grad_hpre = d_hpre.to(dtype)
                del d_hpre
            del g, gate, up
        del w2
        if need_w:
            kept = meta.row_of_slot >= 0
            per_slot = torch.where(kept, per_row[meta.row_of_slot.clamp(min=0).long()], 0.0)
            if down_proj_bias is not None:
                per_slot = per_slot + down_bias_weight_term(grad_out, down_proj_bias, meta, top_k)
            grad_w = per_slot.reshape(T, top_k).to(top_k_weights.dtype)
        del per_row
    if not need_a:
        a = None
    elif a is None:
        a = _activate(hpre[:, :I].float(), hpre[:, I:].float() if halves == 2 else None, activation).to(dtype)
    if need_x:
        w1 = concatenated(gate_up_proj, layout, dtype, up_proj)
        if grad_hpre.device.type == "cpu":
            grad_x = _grouped_mm_sum_to_tokens(grad_hpre, w1, meta, T).to(dtype)
        else:
            rows = grouped_mm(grad_hpre, w1, meta.expert_offsets)
            grad_x = _combine(rows, meta, None, T, top_k).to(dtype)
            del rows
        del w1
    return grad_x, grad_w, grad_hpre if need_dhpre else None, a


def _expert_of_row(meta: RoutingMetadata) -> torch.Tensor:
    """[S] int64: the expert of each row (rows past expert_offsets[E]: the last expert, to be masked)."""
    E = meta.expert_offsets.shape[0] - 1
    rows = torch.arange(meta.token_of_row.shape[0], device=meta.expert_offsets.device)
    return torch.searchsorted(meta.expert_offsets[1:].long(), rows, right=True).clamp(max=E - 1)


# The expert gradient the torch backend's in-backward update holds at once, in bytes: a chunk of whole
# experts (at least one) whose gradient is computed into one reused buffer and applied by torch's fused
# AdamW before the next chunk (docs/design.md, "Which AdamW runs where"). On this project's 2-core CPUs a
# chunk of 1 MiB or a few experts runs faster than the whole layer's gradient at once (no fresh,
# page-faulted gradient tensor; the chunk is read back from the cache) and keeps the expert gradient
# alive at once below a tenth of a layer's at sonar-train's shapes. ``None``: the whole layer at once.
WGRAD_CHUNK_BYTES: int | None = 1 << 20
