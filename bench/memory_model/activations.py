"""The activations term: what each op of a decoder layer saves for its backward (transformers' modeling files,
autograd's rules; the expert MLP's saved tensors from ``sonar_kernels/autograd/formula.py``), and the
forward's outputs outside the layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sonar_kernels.train.data import Preset

from memory_model.inputs import FP32, INT32, INT64, Layout, head_dim

# --- activations --------------------------------------------------------------------------------------


def rms_norm_saved(T: int, width: int, a: int) -> int:
    """Bytes an RMSNorm (OLMoE's and Granite's: x.to(fp32), pow(2).mean, rsqrt, x * rsqrt, weight * .to(x's
    dtype)) saves for its backward, besides its input: the rsqrt [T, 1] fp32 and the normalized [T, W] in
    x's dtype (mul saves it for the weight's gradient); in a 16-bit dtype also x's fp32 copy (saved by pow
    and mul; in fp32 .to is x itself, which the norm then keeps alive)."""
    return T * FP32 + T * width * a + (T * width * FP32 if a != FP32 else 0)


def layer_saved(
    d: Preset, T: int, a: int, layout: Layout, rows: int, mask_length: int = 0
) -> tuple[dict, dict, dict]:
    """What one decoder layer's forward saves for its backward, besides its input, as byte counts by name:
    (kept, moe, combine). ``moe``: the tensors the expert MLP's backward node alone holds (released when
    it has run, before the deferred in-backward updates); ``combine``: expert parallelism's combine, whose
    backward runs before the experts'. T tokens of this rank, ``a`` bytes per element, ``rows`` rows of
    this rank's experts (T * top_k on one rank; under expert parallelism the rows it receives);
    ``mask_length``: the sequence length of a materialized causal mask (``Setup.causal_mask``), 0 without.

    Derived from transformers 5's modeling_olmoe.py / modeling_granitemoe.py / modeling_qwen3_moe.py,
    sonar_kernels/nn/expert_parallel.py and autograd's rules (``a * b`` saves b for a's gradient only when
    b requires grad: rotary's ``q * cos`` keeps cos, not q)."""
    H, I, E, k = d.hidden_size, d.intermediate_size, d.num_experts, d.top_k
    Hq, Hkv, nh = d.num_heads * head_dim(d), d.num_kv_heads * head_dim(d), d.num_heads
    S = T * k
    fp32 = a == FP32
    # k and v as the attention gets them: with a mask, grouped-query k and v repeated to every query head
    # (transformers' sdpa_attention.py: repeat_kv unless use_gqa_in_sdpa, which needs no mask).
    Hk = Hq if mask_length else Hkv
    kept = {
        "input_layernorm": rms_norm_saved(T, H, a) + T * H * a,  # + its output, saved by q/k/v_proj
        # v saved by attention; q and k kept by OLMoE's q_norm/k_norm in fp32 (their input), not in bf16.
        "v": T * Hk * a,
        "q_k_rotated": T * (Hq + Hk) * a,  # saved by attention
        "attention_out_lse": T * Hq * a + T * nh * FP32,  # its output (also o_proj's input) and logsumexp
        # a bool mask becomes an additive [B, 1, S, S] one in a (aten's scaled_dot_product_attention,
        # convert_boolean_attn_mask), which the CPU flash attention saves
        "attention_mask": T * mask_length * a,
        # the residual after attention: post_attention_layernorm's input, kept in fp32 only
        "attention_residual": T * H * a if fp32 else 0,
        "post_attention_layernorm": rms_norm_saved(T, H, a) + T * H * a,  # + its output: router's, experts' X
        "router_top_k_index": T * k * INT64,
        # expert_offsets, tile_offsets [E + 1], row_of_slot, token_of_row, slot_of_row [rows] int32; the
        # deferred updates hold them past the node
        "routing_metadata": 3 * rows * INT32 + 2 * (E // layout.ep + 1) * INT32,
    }
    if d.family in ("olmoe", "qwen3_moe"):
        if d.family == "olmoe":
            kept["q_norm_k_norm"] = rms_norm_saved(T, Hq, a) + rms_norm_saved(T, Hkv, a)
        else:  # Qwen3-MoE's q_norm and k_norm over each head: an rsqrt per token and head
            hd, nkv = Hq // nh, d.num_kv_heads
            kept["q_norm_k_norm"] = rms_norm_saved(T * nh, hd, a) + rms_norm_saved(T * nkv, hd, a)
        kept["q_k"] = T * (Hq + Hkv) * a if fp32 else 0
        # The same router (OlmoeTopKRouter, Qwen3MoeTopKRouter): softmax(logits, dtype=float) saves its output
        kept["router_softmax"] = T * E * FP32
        if d.extra.get("norm_topk_prob"):
            # ``router_top_value /= router_top_value.sum(-1, keepdim=True)``: the in-place division saves the
            # divisor [T, 1] and the dividend as it was [T, k] (autograd's copy of an overwritten self), fp32
            kept["router_norm_topk"] = T * FP32 + T * k * FP32
        moe_weights = T * k * (FP32 if fp32 else a)  # top-k of the fp32 softmax, cast to a: experts only
    else:  # Granite: topk of the fp32 logits, then softmax over the k (saved), cast to a
        kept["router_softmax"] = T * k * FP32
        moe_weights = 0 if fp32 else T * k * a
    moe = {"expert_weights": moe_weights, "hpre": rows * 2 * I * a}
    combine = {}
    if layout.ep > 1:  # the all-to-all dispatch and the fp32 combine
        kept["ep_send_index"] = S * INT64  # the send rows' token ids, saved by index's backward
        moe["expert_weights"] = rows * a  # ones: the rows arrive unweighted (the combine weights them)
        moe["expert_input"] = rows * H * a  # the received rows, the local experts' X
        combine = {
            "slots": S * INT64,  # saved by the combine's index
            "returned_rows_fp32": S * H * FP32,  # y.float(), saved by the weighted sum
            "row_weights_fp32": S * FP32,  # the routing weight per row, saved by the same product
            "weighted_rows": S * H * FP32,  # the product, index_copy's source (its backward saves it)
        }
    return kept, moe, combine


def shared_saved(
    d: Preset, batch_size: int, seq: int, a: int, checkpointing: bool = True, mask: bool = False
) -> int:
    """Tensors every layer shares: rotary cos and sin [1, seq, head_dim] (saved by each layer's rotary
    products); with ``checkpointing`` also the checkpoints' other arguments: the position ids [1, seq] and,
    with ``mask``, the materialized causal mask, bool [batch_size, 1, seq, seq] (``Setup.causal_mask``).
    Without checkpointing no node saves those, and they go when the model's forward returns."""
    held = seq * INT64 + (batch_size * seq * seq if mask else 0)
    return 2 * seq * head_dim(d) * a + (held if checkpointing else 0)


def logits_dtype_bytes(d: Preset, a: int) -> int:
    """The router logits' dtype: OLMoE's and Qwen3-MoE's in a, Granite's cast to fp32 (.float())."""
    return a if d.family in ("olmoe", "qwen3_moe") else FP32


def chunked_loss_moments(d: Preset, T: int, a: int, chunk: int) -> tuple[list[dict], list[dict]]:
    """The chunked loss's own bytes (``sonar_kernels/train/loss.py``, ``ChunkedCausalLMLoss``) at each of its
    candidate moments, as (forward moments, backward moments), each a dict of named byte counts to add to
    what the step holds around the loss. c = min(chunk, T) tokens a chunk, c2 the second chunk's (the lm_head's
    gradient exists from the second chunk on).

    Forward, per chunk (no grad): the logits [c, V] in a (Granite's divided copy beside them), their fp32
    copy (the 16-bit logits released by the rebinding), ``cross_entropy``'s log_softmax output beside it:
    at most 2 [c, V] fp32. Backward, per chunk, beside the whole hidden states' gradient [T, H] in a
    (allocated first): the recomputed log_softmax output, the gradient reaching it and the one it gives
    (3 [c, V] fp32); then that gradient in a (Granite: divided, both alive) and the lm_head's matmul
    backward, which makes the chunk's [c, H] and [V, H] gradients while the [c, V] one is alive, beside the
    accumulated [V, H] gradient."""
    V, H = d.vocab_size, d.hidden_size
    c, c2 = min(chunk, T), min(chunk, max(T - chunk, 0))
    forward = [{"loss_chunk_logits_and_log_softmax": 2 * c * V * FP32}]
    grad_hidden = {"hidden_gradient": T * H * a}
    backward = [{**grad_hidden, "loss_chunk_log_softmax_and_gradients": 3 * c * V * FP32},
                {**grad_hidden, "loss_chunk_logit_gradient": c * V * a, "loss_chunk_hidden_gradient": c * H * a,
                 "loss_chunk_lm_head_gradient": V * H * a}]  # fmt: skip
    if d.family == "granitemoe":
        backward.append({**grad_hidden, "loss_chunk_logit_gradients": 2 * c * V * a})
    if c2:
        accumulated = {**grad_hidden, "lm_head_gradient": V * H * a}
        backward += [{**accumulated, "loss_chunk_log_softmax_and_gradients": 3 * c2 * V * FP32},
                     {**accumulated, "loss_chunk_logit_gradient": c2 * V * a, "loss_chunk_hidden_gradient": c2 * H * a,
                      "loss_chunk_lm_head_gradient": V * H * a}]  # fmt: skip
        if d.family == "granitemoe":
            backward.append({**accumulated, "loss_chunk_logit_gradients": 2 * c2 * V * a})
    return forward, backward
