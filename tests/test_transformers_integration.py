"""experts_implementation="sonar" in transformers models against their own "eager" experts."""

import copy

import pytest
import test_transformers_families as families
import torch
from numerics import assert_close, rel_err

import sonar_kernels
from sonar_kernels.integrations import transformers as hf

transformers = pytest.importorskip("transformers", minversion="5.13")

VOCAB, SEQ, BATCH = 64, 12, 2
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# The references' flags: SonarAdamW's default flags (foreach=None, fused=None) run torch's fused AdamW on
# the CPU.
FUSED = {"fused": True}


@pytest.fixture
def backend(request):
    """The moe_mlp backend of the "sonar" models of this test (set per model with hf.set_backend)."""
    hf.register()
    return request.param


def _config(kind, activation="silu"):
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
        "hidden_act": activation,
        "output_router_logits": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }
    if kind == "olmoe":
        return transformers.OlmoeConfig(num_experts=4, router_aux_loss_coef=0.01, **common)
    return transformers.GraniteMoeConfig(num_local_experts=4, router_aux_loss_coef=0.01, **common)


def _model(kind, activation="silu", implementation="eager", seed=0, backend=None):
    torch.manual_seed(seed)
    cls = transformers.OlmoeForCausalLM if kind == "olmoe" else transformers.GraniteMoeForCausalLM
    config = _config(kind, activation)
    config._experts_implementation = implementation
    model = cls(config)
    with torch.no_grad():  # expert weights are left uninitialised by some configs' init: make them random
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0, p.shape[-1] ** -0.5)
    if backend is not None:
        hf.set_backend(model, backend)
    return model


def _tokens(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)


def _forward_backward(*models):
    """Each model's output on the same tokens (labels = tokens), after its loss's backward."""
    tokens = _tokens()
    outputs = []
    for model in models:
        out = model(tokens, labels=tokens)
        out.loss.backward()
        outputs.append(out)
    return outputs


CASES = [
    ("olmoe", "silu"),
    ("granitemoe", "silu"),
    ("granitemoe", "gelu"),
    ("granitemoe", "gelu_pytorch_tanh"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"], indirect=True)
@pytest.mark.parametrize(("kind", "activation"), CASES, ids=[f"{k}-{a}" for k, a in CASES])
def test_sonar_equals_eager_logits_loss_router_and_dense_gradients(kind, activation, backend):
    eager = _model(kind, activation)
    sonar = copy.deepcopy(eager)
    sonar.set_experts_implementation("sonar")
    hf.set_backend(sonar, backend)
    assert sonar.config._experts_implementation == "sonar"
    ref, got = _forward_backward(eager, sonar)
    assert_close(got.logits, ref.logits, torch.float32, what="logits")
    assert_close(got.loss, ref.loss, torch.float32, what="loss")
    assert_close(got.aux_loss, ref.aux_loss, torch.float32, what="aux loss")
    for layer, (a, b) in enumerate(zip(got.router_logits, ref.router_logits, strict=True)):
        assert_close(a, b, torch.float32, what=f"router logits of layer {layer}")
    for (name, p), q in zip(sonar.named_parameters(), eager.parameters(), strict=True):
        assert_close(p.grad, q.grad, torch.float32, what=f"grad of {name}")


@pytest.mark.skipif(not hasattr(transformers, "Gemma4ForCausalLM"), reason="transformers without Gemma 4")
def test_gemma4_experts_run_the_tanh_gelu():
    # Gemma 4's MoE experts use hidden_activation "gelu_pytorch_tanh": the kernels' "gelu_tanh" (its match
    # with eager on both backends: tests/test_transformers_families.py).
    hf.register()
    model = families.build("gemma4")
    model.set_experts_implementation("sonar")
    experts = [m for m in model.modules() if type(m).__name__ == "Gemma4TextExperts"]
    assert len(experts) == 2 and all(hf.check_experts_module(m) == "gelu_tanh" for m in experts)


def test_every_tanh_gelu_of_transformers_maps_to_gelu_tanh():
    hf.register()
    from transformers.activations import ACT2FN

    experts = _model("olmoe").model.layers[0].mlp.experts
    for name in ("gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new", "gelu_fast"):
        experts.act_fn = ACT2FN[name]
        assert hf.check_experts_module(experts) == "gelu_tanh", name
        # Each is the formula the kernels implement, up to rounding.
        x = torch.linspace(-6, 6, 101, dtype=torch.float64)
        expected = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))
        assert torch.allclose(experts.act_fn(x.float()).double(), expected, rtol=0, atol=1e-6), name
    experts.act_fn = torch.nn.GELU(approximate="tanh")
    assert hf.check_experts_module(experts) == "gelu_tanh"
    for name in ("gelu_10", "quick_gelu", "relu"):
        experts.act_fn = ACT2FN[name]
        with pytest.raises(ValueError, match="act_fn="):
            hf.check_experts_module(experts)


def test_save_pretrained_from_pretrained_round_trip_is_bitwise(tmp_path):
    hf.register()
    model = _model("olmoe", implementation="sonar", backend="torch")
    model.save_pretrained(tmp_path)
    loaded = transformers.OlmoeForCausalLM.from_pretrained(tmp_path, experts_implementation="sonar")
    assert loaded.config._experts_implementation == "sonar"
    names = [name for name, _ in model.named_parameters()]
    assert names == [name for name, _ in loaded.named_parameters()]
    for (name, p), q in zip(model.named_parameters(), loaded.parameters(), strict=True):
        assert p.shape == q.shape and torch.equal(p, q), name
    # The eager implementation reads the same checkpoint.
    eager = transformers.OlmoeForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    tokens = _tokens()
    with torch.no_grad():
        assert_close(loaded(tokens).logits, eager(tokens).logits, torch.float32)


@pytest.mark.skipif(not hasattr(transformers, "GptOssForCausalLM"), reason="transformers without gpt-oss")
def test_gpt_oss_experts_run_in_their_own_layout_and_activation():
    # Transposed experts, gate and up interleaved, biases, the clamped SwiGLU of its _apply_gate, read from
    # the module (its match with eager on both backends: tests/test_transformers_families.py).
    hf.register()
    model = families.build("gpt_oss")
    model.set_experts_implementation("sonar")
    experts = [m for m in model.modules() if type(m).__name__ == "GptOssExperts"]
    assert len(experts) == 2
    for module in experts:
        assert hf.check_experts_module(module) == sonar_kernels.clamped_swiglu(module.alpha, module.limit)
        assert hf.layout_of(module) == {"transposed": True, "interleaved": True, "gated": True}
        assert [t.shape for t in hf.expert_tensors(module)] == [
            module.gate_up_proj.shape, module.down_proj.shape, module.gate_up_proj_bias.shape,
            module.down_proj_bias.shape,
        ]  # fmt: skip


def test_a_gpt_oss_gate_that_computes_something_else_is_refused():
    hf.register()
    model = families.build("gpt_oss")
    experts = model.model.layers[0].mlp.experts
    experts.limit = "7"  # not a number: the gate cannot be the kernels' formula
    with pytest.raises(ValueError, match=r"GptOssExperts\._apply_gate"):
        model.set_experts_implementation("sonar")
    assert model.config._experts_implementation == "eager"


def test_unsupported_activation_and_layout_are_refused_by_name():
    hf.register()
    # Refused when chosen: at construction (the config selects "sonar") and at the switch, which leaves
    # the model as it was.
    refused = r"cannot run (model\.)?layers\.0\.block_sparse_moe\.experts: GraniteMoeExperts: act_fn=ClippedGELUActivation"
    with pytest.raises(ValueError, match=refused):
        _model("granitemoe", activation="gelu_10", implementation="sonar")
    model = _model("granitemoe", activation="gelu_10")
    with pytest.raises(ValueError, match=refused):
        model.set_experts_implementation("sonar")
    assert model.config._experts_implementation == "eager"
    model(_tokens())  # still runs its own implementation
    # A module changed after the switch is refused by name at the forward.
    model = _model("olmoe", implementation="sonar")
    experts = model.model.layers[0].mlp.experts
    experts.has_post_expert_norm = True
    with pytest.raises(ValueError, match="has_post_expert_norm=True"):
        model(_tokens())
    experts.has_post_expert_norm = False
    # Biases and experts without a gate run, but this module has neither: the missing tensor is named.
    for flag, value, missing in (("has_bias", True, "gate_up_proj_bias"), ("has_gate", False, "up_proj")):
        setattr(experts, flag, value)
        with pytest.raises(ValueError, match=f"OlmoeExperts has no {missing} tensor"):
            model(_tokens())
        setattr(experts, flag, not value)

    class CustomGate(type(experts)):
        def _apply_gate(self, gate_up_out):
            return gate_up_out[..., : gate_up_out.shape[-1] // 2]

    experts.__class__ = CustomGate
    with pytest.raises(ValueError, match=r"_apply_gate \(.*CustomGate\._apply_gate\)"):
        model(_tokens())


def test_too_old_or_missing_transformers_is_refused(monkeypatch):
    monkeypatch.setattr(hf.metadata, "version", lambda name: "5.12.3")
    with pytest.raises(ImportError, match=r"transformers >= 5.13.*5.12.3"):
        hf.register()

    def missing(name):
        raise hf.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(hf.metadata, "version", missing)
    with pytest.raises(ImportError, match="pip install"):
        hf.register()


def test_the_backend_is_chosen_per_model():
    hf.register()
    a, b = _model("olmoe", implementation="sonar"), _model("olmoe", implementation="sonar")
    hf.set_backend(a, "torch")
    experts_a, experts_b = a.model.layers[0].mlp.experts, b.model.layers[0].mlp.experts
    assert experts_a.sonar_backend == "torch" and not hasattr(experts_b, "sonar_backend")
    with pytest.raises(ValueError, match="backend"):
        hf.set_backend(a, "cuda")
    with pytest.raises(ValueError, match="no transformers experts module"):
        hf.set_backend(torch.nn.Linear(2, 2), "torch")
    with pytest.raises(ValueError, match="needs a model"):
        hf.apply_sonar_kernel_to_olmoe(backend="torch")


def test_apply_functions_switch_a_model_or_the_default(monkeypatch):
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoePreTrainedModel

    monkeypatch.setattr(
        GraniteMoePreTrainedModel,
        "get_correct_experts_implementation",
        GraniteMoePreTrainedModel.get_correct_experts_implementation,
    )
    model = _model("olmoe")
    assert (
        sonar_kernels.integrations.transformers.apply_sonar_kernel_to_olmoe(model, backend="torch") is model
    )
    assert model.config._experts_implementation == "sonar"
    with pytest.raises(ValueError, match="expected a granitemoe model"):
        hf.apply_sonar_kernel_to_granitemoe(model)
    assert model.model.layers[0].mlp.experts.sonar_backend == "torch"
    hf.apply_sonar_kernel_to_granitemoe()
    assert _model("granitemoe", implementation=None).config._experts_implementation == "sonar"
    assert _model("granitemoe", implementation="eager").config._experts_implementation == "eager"
    assert _model("olmoe", implementation=None).config._experts_implementation != "sonar"


EXPERT_NAMES = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


def _train(model, optimizer, steps, sonar):
    dense = [p for name, p in model.named_parameters() if not name.endswith(EXPERT_NAMES)]
    for step in range(steps):
        tokens = _tokens(step)
        model(tokens, labels=tokens).loss.backward()
        if not sonar:
            torch.nn.utils.clip_grad_norm_(dense, 0.5)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_sonar_adamw_finds_the_experts_and_equals_dense_clip_training_bitwise(backend):
    standard = _model("olmoe", implementation="sonar", backend=backend)
    sonar = copy.deepcopy(standard)
    optimizer = sonar_kernels.SonarAdamW(sonar, **HYPER, max_grad_norm=0.5)
    experts = [p for name, p in sonar.named_parameters() if name.endswith(("gate_up_proj", "down_proj"))]
    assert len(experts) == 4 and all(any(q is p for q in optimizer.expert_tensors) for p in experts)
    # Built before the switch to "sonar", the optimizer warns that it treats the experts as dense.
    with pytest.warns(UserWarning, match='experts_implementation \\[.eager.\\], not "sonar"'):
        sonar_kernels.SonarAdamW(_model("olmoe"), **HYPER)
    _train(standard, torch.optim.AdamW(standard.parameters(), **HYPER, **FUSED), 3, sonar=False)
    _train(sonar, optimizer, 3, sonar=True)
    for (name, p), q in zip(sonar.named_parameters(), standard.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_transformers_gradient_checkpointing_updates_each_expert_tensor_once(use_reentrant, backend):
    # Reference: standard training (torch.optim.AdamW(fused=True), dense-only clipping) under the same
    # checkpointing (transformers' reentrant mode does not carry the aux loss's gradient into the
    # checkpointed layers, so it differs from no checkpointing with either optimizer).
    standard = _model("olmoe", implementation="sonar", backend=backend)
    sonar = copy.deepcopy(standard)
    for model in (standard, sonar):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model.train()
    optimizer = sonar_kernels.SonarAdamW(sonar, **HYPER, max_grad_norm=0.5)
    _train(standard, torch.optim.AdamW(standard.parameters(), **HYPER, **FUSED), 2, sonar=False)
    _train(sonar, optimizer, 2, sonar=True)
    assert len(optimizer.expert_tensors) == 4
    for p in optimizer.expert_tensors:
        assert float(optimizer.state[p]["step"]) == 2.0  # once per step, recomputation included
    for (name, p), q in zip(sonar.named_parameters(), standard.parameters(), strict=True):
        if backend == "torch":
            assert torch.equal(p, q), name
        else:  # the Triton update's arithmetic against torch's CPU AdamW: a few ulps
            assert rel_err(p, q) <= 1e-6, name


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        tokens = _tokens(i)[0]
        return {"input_ids": tokens, "labels": tokens}


class _GradNorms(transformers.TrainerCallback):
    """The grad_norm of every Trainer log."""

    def __init__(self):
        self.values = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "grad_norm" in logs:
            self.values.append(logs["grad_norm"])


def test_hf_trainer_with_sonar_adamw_equals_dense_clip_training_bitwise(tmp_path):
    """The README's Trainer quick start: SonarAdamW through ``optimizers=(optimizer, scheduler)``, Trainer's own
    clipping (it sees the dense gradients only: the experts were updated in the backward) and its logged
    grad_norm (the dense parameters' norm), against torch.optim.AdamW(fused=True) with dense-only clipping on
    the same batches."""
    hf.register()
    model = _model("olmoe", implementation="sonar", backend="torch")
    standard = copy.deepcopy(model)
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER)  # no max_grad_norm: Trainer clips
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    batches = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: batches.append(kwargs["input_ids"]), with_kwargs=True
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, max_grad_norm=0.5, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    norms = _GradNorms()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_Tokens(), optimizers=(optimizer, scheduler), callbacks=[norms]
    )
    trainer.train()
    logs = norms.values
    assert len(batches) == 2 and len(logs) == 2
    reference = torch.optim.AdamW(standard.parameters(), **HYPER, **FUSED)
    reference_scheduler = torch.optim.lr_scheduler.LambdaLR(reference, lambda step: 1.0 / (1 + step))
    dense = [p for name, p in standard.named_parameters() if not name.endswith(("gate_up_proj", "down_proj"))]
    for tokens, logged in zip(batches, logs, strict=True):
        standard(tokens, labels=tokens).loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(dense, 0.5)
        assert logged == pytest.approx(float(norm), rel=1e-6)
        reference.step()
        reference_scheduler.step()
        reference.zero_grad()
    for (name, p), q in zip(model.named_parameters(), standard.parameters(), strict=True):
        assert torch.equal(p, q), name
