"""Every transformers family whose experts dispatch through ExpertsInterface (@use_experts_implementation):
experts_implementation "sonar" matches the family's own "eager" experts, or the switch refuses it.

A tiny random model per family (2 layers, hidden 64, 4 experts, top-2, vocab 64) from its config class, on
the "torch" backend; every family runs (about 15 s for all of them on a 2-core CPU).
"""

import copy
import functools
import importlib
import itertools
import pathlib

import pytest
import torch
from numerics import TOLERANCE, assert_close, rel_err

import sonar_kernels
from sonar_kernels.integrations import transformers as hf
from sonar_kernels.integrations import transformers_experts as hf_experts

transformers = pytest.importorskip("transformers", minversion="5.13")

VOCAB, SEQ, BATCH = 64, 12, 2
# Tiny sizes, each set only on configs that have the attribute (names differ per family).
TINY = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "max_position_embeddings": 128,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    # experts, top-k, expert sizes
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "top_k_experts": 2, "moe_k": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "swiglu_limit": 1.0,  # gpt-oss's clamped SwiGLU, its clamps active on part of the tiny activations
    # layer 0 dense where the family has dense layers first, layer 1 MoE
    "first_k_dense_replace": 1, "num_dense_layers": 1, "mlp_only_layers": [],
    # multi-head latent attention, sparse attention indexers, linear attention
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "index_n_heads": 2, "index_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_heads": 4, "linear_head_dim": 16,
}  # fmt: skip
# Per-family settings on top of TINY.
HYBRID = {"layer_types": ["linear_attention", "full_attention"]}  # a hybrid model needs one attention layer
OVERRIDES = {
    "bailing_hybrid": HYBRID, "kimi_linear": HYBRID, "qwen3_5_moe": HYBRID, "qwen3_next": HYBRID,
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 0, "expert_layer_period": 2,
              "expert_layer_offset": 1},
    "nemotron_h": {"layers_block_type": ["full_attention", "moe"]},
    "beam": {"mlp_layer_types": ["dense", "sparse"]},
    "deepseek_ocr2": {"mlp_layer_types": ["dense", "sparse"]},
    "glm5_next": {"qk_rope_head_dim": 0, "mlp_layer_types": ["dense", "sparse"]},  # NoPE latent attention
    "dots1": {"n_shared_experts": 1}, "zaya": {"num_experts_per_tok": 1},  # zaya supports top-1 only
    "mimo_v2_flash": {"num_key_value_heads": 2},  # its sliding-window layers have twice the key-value heads
    "mistral4": {"head_dim": 32},  # qk_nope_head_dim + qk_rope_head_dim
    "kolibri1_1": {"index_num_heads": 1},  # at most the query heads per key head (4 / 4)
    "step3p7": {"mlp_layer_types": ["dense", "sparse"]},  # MoE from layer 3 by default
    # num_hidden_layers is 2 * num_layers; 256 identity ("zero") experts by default beside 4 routed ones
    "longcat_flash": {"num_layers": 1, "zero_expert_num": 2},
    "gemma4": {"enable_moe_block": True, "layer_types": ["sliding_attention", "full_attention"],
               "sliding_window": 8, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
               "per_layer_config": {}},
    # multimodal RoPE sections sized to the tiny heads
    "ernie4_5_vl_moe": {"moe_intermediate_size": [32, 32], "rope_parameters": {
        "rope_theta": 5e5, "rope_type": "default", "mrope_section": [3, 3, 2]}},
    "glm4v_moe": {"rope_parameters": {
        "rope_type": "default", "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}},
    "hy_v4_vl": {"rope_parameters": {"rope_type": "default", "mrope_section": [4, 2, 2]}},
    # Indexed attention first: with the linear-attention layer first, the gradients of its decay
    # parameters (dt_bias, A_log; norm 1e-7, against 1e-2 elsewhere) differ from eager by 1.4e-5 relative,
    # exactly as much with transformers' own batched_mm experts as with sonar: rounding, amplified.
    "qwen4_exp": {"layer_types": ["indexed_attention", "linear_attention"], "indexer_n_heads": 2,
                  "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                  "indexer_compress_ratio": 4},
}  # fmt: skip
# Families expected to match eager (expert counts named num_experts / num_local_experts / n_routed_experts /
# moe_num_experts, dense first layers, shared experts, latent attention, Mamba and linear-attention hybrids,
# transposed experts, biases and a clamped SwiGLU, experts without a gate, base models without a causal LM).
MATCH = [
    "afmoe", "aria", "axk1", "axk2", "cohere2_moe", "deepseek_ocr2", "deepseek_v2",
    "deepseek_v3", "deepseek_v32", "diffusion_gemma", "dots1", "dots3_note", "ergo", "ernie4_5_moe",
    "ernie4_5_vl_moe", "exaone_moe", "flex_olmo", "flint", "gemma4", "glm4_moe", "glm4_moe_lite", "glm4v_moe",
    "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
    "hunyuan_v1_moe", "hy_v3", "inkling", "jamba", "kimi_linear", "kolibri1", "kolibri1_1", "laguna", "lara_mini",
    "lfm2_moe", "longcat_flash", "mellum", "mimo_v2_flash", "minicpm5_moe", "minimax", "minimax_m2", "mistral4", "mistral_large4", "mixtral",
    "nemotron_h", "olmoe", "openai_privacy_filter", "phimoe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe",
    "qwen3_next", "qwen3_omni_moe", "qwen3_vl_moe", "qwen4_exp", "solar_open", "unlimited_ocr", "zaya",
]  # fmt: skip
# (olmoe, granitemoe, gemma4, aria, gpt_oss and nemotron_h also run against eager on both backends in
# test_transformers_integration.py.)
# Families the switch to "sonar" refuses (check_experts_module): a pattern of the ValueError's message.
GATE = "defines its own _apply_gate"
REFUSED = {
    "muse_spark": "has_post_expert_norm=True",  # a norm after each expert
    "bailing_hybrid": GATE, "beam": GATE, "deepseek_v4": GATE, "glm5_next": GATE, "hy_v4": GATE, "hy_v4_vl": GATE, "inkling2": GATE,
    "inkling2_loop": GATE, "minimax_m3_vl": GATE, "step3p7": GATE,
}  # fmt: skip
# Families that cannot be built at tiny size for reasons unrelated to sonar (none in transformers 5.25).
NOT_BUILDABLE: dict[str, str] = {}


class _Probe(torch.nn.Module):
    def forward(self):
        pass


# @use_experts_implementation replaces a class's forward by a closure of one code object: the dispatch.
_DISPATCH = transformers.integrations.moe.use_experts_implementation(_Probe).forward.__code__


def _dispatches(obj) -> bool:
    """Whether the class ``obj`` runs the dispatch: its forward, or a base class's that its own forward calls
    (ergo's ErgoExperts normalizes each route after ErgoExpertProjections' dispatched forward)."""
    return (
        isinstance(obj, type)
        and issubclass(obj, torch.nn.Module)
        and any(getattr(c.__dict__.get("forward"), "__code__", None) is _DISPATCH for c in obj.__mro__)
    )


@functools.cache
def discover() -> dict:
    """family (its transformers.models subpackage) -> its modeling module, for each family defining an experts
    class that dispatches through ExpertsInterface."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    found = {}
    for path in sorted(root.glob("*/modeling_*.py")):
        if "use_experts_implementation" not in path.read_text(encoding="utf-8"):
            continue  # cheap filter: importing all of transformers' modeling modules is slow
        module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        if any(_dispatches(obj) and obj.__module__ == module.__name__ for obj in vars(module).values()):
            found[path.parent.name] = module
    return found


def _model_class(module):
    """The *ForCausalLM class of a family, else its (text) base model, on a config without sub-configs."""
    classes = [
        obj
        for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, transformers.PreTrainedModel)
        and obj.__module__ == module.__name__ and name.endswith(("ForCausalLM", "Model"))
        and not name.endswith("PreTrainedModel") and not getattr(obj.config_class, "sub_configs", None)
    ]  # fmt: skip
    classes.sort(key=lambda c: (not c.__name__.endswith("ForCausalLM"), not c.__name__.endswith("TextModel")))
    return classes[0]


def build(family, seed=0):
    """A tiny random eager model of ``family``; its expert weights normal(0, fan_in**-0.5) (also used by
    tests/test_transformers_integration.py)."""
    cls = _model_class(discover()[family])
    defaults = cls.config_class()
    kwargs = {key: value for key, value in TINY.items() if key in defaults.to_dict()}
    config = cls.config_class(**{**kwargs, **OVERRIDES.get(family, {})})
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # some inits leave the experts empty
        for module in model.modules():
            fan_in = 1 if getattr(module, "is_transposed", False) else 2
            for name, p in module.named_parameters(recurse=False) if _dispatches(type(module)) else ():
                if name in ("gate_up_proj", "up_proj", "down_proj"):
                    p.normal_(0, p.shape[fan_in] ** -0.5)
                elif name.endswith("_bias"):  # gpt-oss's, initialised to zero
                    p.normal_(0, 0.1)
    return model


def _up(experts):
    """The first projection of an experts module: gate_up_proj, or up_proj without a gate (has_gate=False)."""
    return experts.gate_up_proj if experts.has_gate else experts.up_proj


def _forward_backward(model):
    """The model's logits (or last hidden state) on fixed tokens, after the backward of a loss on them."""
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)  # the same draws in both models: phimoe's sparsemixer samples experts in training
    if type(model).__name__.endswith("ForCausalLM"):
        out = model(tokens, labels=tokens)
        out.loss.backward()
        return out.logits
    out = model(tokens).last_hidden_state
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * probe).sum().backward()
    return out


def _present(families):
    missing = pytest.mark.skip(reason="family not in this transformers")
    return [pytest.param(f, marks=() if f in discover() else missing) for f in families]


def sonar_equals_eager(family, backend):
    """The family's tiny model switched to "sonar" on ``backend``, after checking its output and every
    parameter's gradient against the same model's "eager" experts."""
    eager = build(family)
    sonar = copy.deepcopy(eager)
    sonar.set_experts_implementation("sonar")
    hf.set_backend(sonar, backend)
    ref, got = _forward_backward(eager), _forward_backward(sonar)
    assert_close(got, ref, torch.float32, what=f"{family} output")
    exact = None
    for (name, p), q in zip(sonar.named_parameters(), eager.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), f"{family}: grad of {name}"
        if q.grad is None or rel_err(p.grad, q.grad) <= TOLERANCE[torch.float32]:
            continue
        # Past the fp32 bound against fp32 eager: a gradient made mostly of rounding (linear attention's
        # decay parameters, a norm's weight) differs by more between any two fp32 summation orders, and
        # with the thread count. Then both are held against the same model in float64: sonar's error no
        # more than twice eager's own, or within the fp32 bound (numerics.TOLERANCE, against float64).
        if exact is None:
            exact = dict(_float64_gradients(family))
        sonar_err, eager_err = rel_err(p.grad, exact[name]), rel_err(q.grad, exact[name])
        assert sonar_err <= max(2 * eager_err, TOLERANCE[torch.float32]), (
            f"{family}: grad of {name}: relative error against float64 {sonar_err:.3e}, eager's {eager_err:.3e}"
        )
    # The router logits of every layer (after the first, they see the experts' output), where the family
    # returns them.
    ref, got = _router_logits(eager), _router_logits(sonar)
    assert (ref is None) == (got is None), family
    for layer, (a, b) in enumerate(zip(got or (), ref or (), strict=True)):
        assert_close(a, b, torch.float32, what=f"{family}: router logits of layer {layer}")
    return sonar


def _float64_gradients(family):
    """(name, gradient) of every parameter of the family's tiny model evaluated in float64 with its eager
    experts, on the same tokens."""
    model = build(family).double()
    _forward_backward(model)
    return [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]


def _router_logits(model):
    """The router logits of every MoE layer on the fixed tokens, or None where the family has none to
    return (no ``output_router_logits`` in its config, or none in its output)."""
    if not hasattr(model.config, "output_router_logits"):
        return None
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    with torch.no_grad():
        out = model(tokens, output_router_logits=True)
    logits = getattr(out, "router_logits", None)
    return None if not logits else tuple(logits)


@pytest.mark.parametrize("family", _present(MATCH))
def test_family_withsonar_equals_eager(family, monkeypatch):
    hf.register()
    ran, moe_mlp = set(), hf_experts.moe_mlp

    def recording_moe_mlp(hidden_states, top_k_index, top_k_weights, gate_up_proj, *args, **kwargs):
        ran.add(id(gate_up_proj))  # up_proj for experts without a gate
        return moe_mlp(hidden_states, top_k_index, top_k_weights, gate_up_proj, *args, **kwargs)

    monkeypatch.setattr(hf_experts, "moe_mlp", recording_moe_mlp)
    sonar = sonar_equals_eager(family, "torch")
    # Every experts module that took part ran sonar, and the experts change the output.
    used = [m for m in sonar.modules() if _dispatches(type(m)) and _up(m).grad is not None]
    assert used and {id(_up(m)) for m in used} <= ran, f"{family}: experts not run by sonar"
    assert all(_up(m).grad.norm() > 0 and m.down_proj.grad.norm() > 0 for m in used)


@pytest.mark.parametrize("family", _present(sorted(REFUSED)))
def test_family_refused_at_the_switch(family):
    hf.register()
    model = build(family)
    with pytest.raises(ValueError, match=REFUSED[family]):
        model.set_experts_implementation("sonar")
    assert model.config._experts_implementation == "eager"
    assert all(m.config._experts_implementation == "eager" for m in model.modules() if _dispatches(type(m)))


def test_every_discovered_family_is_matched_refused_or_not_buildable():
    families = set(discover())
    assert {"olmoe", "granitemoe", "mixtral", "gpt_oss"} <= families
    lists = {"MATCH": set(MATCH), "REFUSED": set(REFUSED), "NOT_BUILDABLE": set(NOT_BUILDABLE)}
    for a, b in itertools.combinations(lists, 2):
        assert not lists[a] & lists[b], f"in both {a} and {b}: {sorted(lists[a] & lists[b])}"
    unclassified = families - set().union(*lists.values())
    assert not unclassified, f"families not in MATCH, REFUSED or NOT_BUILDABLE: {sorted(unclassified)}"


# The families the kernels refused before their layouts and activations were added: transposed experts
# (aria), gate and up interleaved with biases and a clamped SwiGLU (gpt_oss; openai_privacy_filter on
# concatenated halves), the tanh GELU (gemma4, diffusion_gemma), no gate (nemotron_h). Each also runs on the
# Triton backend, trains like torch.optim.AdamW with dense-only clipping and survives a checkpoint.
ADDED = ["aria", "diffusion_gemma", "gemma4", "gpt_oss", "nemotron_h", "openai_privacy_filter"]
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


@pytest.mark.parametrize("family", _present(ADDED))
def test_added_family_on_the_triton_backend_equals_eager(family):
    hf.register()
    sonar_equals_eager(family, "triton")


def _train(model, optimizer, steps, clip_dense):
    """``steps`` steps on fixed token batches; ``clip_dense``: clip_grad_norm_(0.5) over the parameters
    that are not expert tensors (what SonarAdamW does with max_grad_norm=0.5)."""
    experts = {id(t) for m in model.modules() if _dispatches(type(m)) for t in hf.expert_tensors(m) or ()}
    dense = [p for p in model.parameters() if id(p) not in experts]
    for step in range(steps):
        tokens = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        torch.manual_seed(step)
        if type(model).__name__.endswith("ForCausalLM"):
            model(tokens, labels=tokens).loss.backward()
        else:
            model(tokens).last_hidden_state.square().mean().backward()
        if clip_dense:
            torch.nn.utils.clip_grad_norm_(dense, 0.5)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("family", _present(ADDED))
def test_added_family_trains_like_dense_clip_adamw_bitwise_and_round_trips(family, tmp_path):
    hf.register()
    standard = build(family)
    standard.set_experts_implementation("sonar")
    hf.set_backend(standard, "torch")
    sonar = copy.deepcopy(standard)
    optimizer = sonar_kernels.SonarAdamW(sonar, **HYPER, max_grad_norm=0.5)
    assert optimizer.expert_tensors
    # Fused: SonarAdamW's default flags run torch's fused AdamW on the CPU.
    _train(standard, torch.optim.AdamW(standard.parameters(), **HYPER, fused=True), 3, clip_dense=True)
    _train(sonar, optimizer, 3, clip_dense=False)
    for (name, p), q in zip(sonar.named_parameters(), standard.parameters(), strict=True):
        assert torch.equal(p, q), f"{family}: {name}"
    sonar.save_pretrained(tmp_path)
    loaded = type(sonar).from_pretrained(tmp_path, experts_implementation="sonar")
    for (name, p), (loaded_name, q) in zip(sonar.named_parameters(), loaded.named_parameters(), strict=True):
        assert name == loaded_name and torch.equal(p, q), f"{family}: {name}"
