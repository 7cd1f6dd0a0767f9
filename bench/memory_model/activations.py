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


def layer_saved(d: Preset, T: int, a: int, layout: Layout, rows: int) -> tuple[dict, dict, dict]:
    """What one decoder layer's forward saves for its backward, besides its input, as byte counts by name:
    (kept, moe, combine). ``moe``: the tensors the expert MLP's backward node alone holds (released when
    it has run, before the deferred in-backward updates); ``combine``: expert parallelism's combine, whose
    backward runs before the experts'. T tokens of this rank, ``a`` bytes per element, ``rows`` rows of
    this rank's experts (T * top_k on one rank; under expert parallelism the rows it receives).

    Derived from transformers 5's modeling_olmoe.py / modeling_granitemoe.py, sonar_kernels/nn/
    expert_parallel.py and autograd's rules (``a * b`` saves b for a's gradient only when b requires
    grad: rotary's ``q * cos`` keeps cos, not q)."""
    H, I, E, k = d.hidden_size, d.intermediate_size, d.num_experts, d.top_k
    Hq, Hkv, nh = d.num_heads * head_dim(d), d.num_kv_heads * head_dim(d), d.num_heads
    S = T * k
    fp32 = a == FP32
    kept = {
        "input_layernorm": rms_norm_saved(T, H, a) + T * H * a,  # + its output, saved by q/k/v_proj
        # v saved by attention; q and k kept by OLMoE's q_norm/k_norm in fp32 (their input), not in bf16.
        "v": T * Hkv * a,
        "q_k_rotated": T * (Hq + Hkv) * a,  # saved by attention
        "attention_out_lse": T * Hq * a + T * nh * FP32,  # its output (also o_proj's input) and logsumexp
        # the residual after attention: post_attention_layernorm's input, kept in fp32 only
        "attention_residual": T * H * a if fp32 else 0,
        "post_attention_layernorm": rms_norm_saved(T, H, a) + T * H * a,  # + its output: router's, experts' X
        "router_top_k_index": T * k * INT64,
        # expert_offsets, tile_offsets [E + 1], row_of_slot, token_of_row, slot_of_row [rows] int32; the
        # deferred updates hold them past the node
        "routing_metadata": 3 * rows * INT32 + 2 * (E // layout.ep + 1) * INT32,
    }
    if d.family == "olmoe":
        kept["q_norm_k_norm"] = rms_norm_saved(T, Hq, a) + rms_norm_saved(T, Hkv, a)
        kept["q_k"] = T * (Hq + Hkv) * a if fp32 else 0
        kept["router_softmax"] = T * E * FP32  # softmax(logits, dtype=float) saves its output
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


def shared_saved(d: Preset, batch_size: int, seq: int, a: int) -> int:
    """Tensors every layer shares: rotary cos and sin [1, seq, head_dim] and the position ids."""
    return 2 * seq * head_dim(d) * a + seq * INT64


def logits_dtype_bytes(d: Preset, a: int) -> int:
    """The router logits' dtype: OLMoE's in a, Granite's cast to fp32 (.float())."""
    return a if d.family == "olmoe" else FP32
