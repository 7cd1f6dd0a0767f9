"""The parameters term: every parameter tensor of the transformers models (OLMoE, Granite MoE) with its shape,
and the part one rank holds; gradients and AdamW moments are parameter-shaped, so their terms follow from these."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sonar_kernels.train.data import Preset

from memory_model.inputs import Layout, head_dim

# --- parameters -----------------------------------------------------------------------------------


def parameter_tensors(dims: Preset) -> list[tuple[str, tuple[int, ...], bool]]:
    """Every parameter of the transformers model as (name, shape, is_expert), in registration order
    (the order of ``model.parameters()``, which is torch.optim.AdamW's: the embedding, per layer the
    attention, the router, the experts and the norms as each family's modules declare them, the final
    norm and the untied lm_head; sonar-train builds the models with tie_word_embeddings=False). Qwen3-MoE
    (modeling_qwen3_moe.py): q_norm and k_norm over one head (head_dim), after o_proj; its MoE block
    declares the experts before the router (``gate``)."""
    H, I, E, V = dims.hidden_size, dims.intermediate_size, dims.num_experts, dims.vocab_size
    Hq, Hkv = dims.num_heads * head_dim(dims), dims.num_kv_heads * head_dim(dims)
    tensors = [("embed_tokens", (V, H), False)]
    for layer in range(dims.num_layers):
        p = f"layers.{layer}."
        attention = [(p + "q_proj", (Hq, H), False), (p + "k_proj", (Hkv, H), False),
                     (p + "v_proj", (Hkv, H), False), (p + "o_proj", (H, Hq), False)]  # fmt: skip
        norms = [(p + "input_layernorm", (H,), False), (p + "post_attention_layernorm", (H,), False)]
        moe = [(p + "router", (E, H), False), (p + "gate_up_proj", (E, 2 * I, H), True),
               (p + "down_proj", (E, H, I), True)]  # fmt: skip
        if dims.family == "olmoe":  # OLMoE's q_norm and k_norm over the whole projections; norms last
            tensors += [*attention, (p + "q_norm", (Hq,), False), (p + "k_norm", (Hkv,), False), *moe, *norms]
        elif dims.family == "qwen3_moe":
            head_norms = [(p + "q_norm", (head_dim(dims),), False), (p + "k_norm", (head_dim(dims),), False)]
            tensors += [*attention, *head_norms, *moe[1:], moe[0], *norms]
        else:
            tensors += attention + norms + moe
    tensors += [("norm", (H,), False), ("lm_head", (V, H), False)]
    return tensors


def numel(shape) -> int:
    return math.prod(shape)


def local_shape(shape: tuple[int, ...], is_expert: bool, layout: Layout) -> tuple[int, ...]:
    """The shape one rank holds: experts split E / ep (and then held whole); under FSDP2 every other
    tensor's first dimension padded to a multiple of the ranks and split (FSDP2 keeps the padded shard)."""
    if is_expert and layout.ep > 1:
        return (shape[0] // layout.ep, *shape[1:])
    if layout.fsdp > 1:
        shape = (-(-shape[0] // layout.fsdp), *shape[1:])
    return shape


def layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def optimizer_state_bytes(
    nbytes: dict, is_expert: dict, param_bytes: int, moments: str, master: str | None = None
) -> int:
    """AdamW's state of the tensors ``nbytes`` (name -> this rank's parameter bytes): exp_avg and
    exp_avg_sq in the parameter dtype (``sonar_kernels/optim/expert_state.py``) and an fp32 step each; with
    ``moments`` "8bit" an expert tensor's moments are int8 and uint8 codes and one fp32 scale per 32
    elements of each (``sonar_kernels/rules/moments_8bit.py``): 9 / 4 bytes per element. With bf16 master
    weights (``master``) an expert tensor's exact moments are fp32 (8 bytes per element) and it keeps an
    int16 remainder per element ("remainder") or a 0-dim int64 seed ("stochastic")."""
    total = 4 * len(nbytes)
    for name, size in nbytes.items():
        elements = size // param_bytes
        if moments == "8bit" and is_expert[name]:
            total += elements * 9 // 4
        elif master is not None and is_expert[name]:
            total += 8 * elements
        else:
            total += 2 * size
        if master is not None and is_expert[name]:
            total += 2 * elements if master == "remainder" else 8
    return total
