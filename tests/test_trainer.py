"""transformers.Trainer with SonarAdamW, and experts_implementation "sonar" after ``import sonar_kernels``
(whatever the import order).

References: the same Trainer run with torch.optim.AdamW and dense-only clipping (the experts' gradients
are never clipped: they are consumed in the backward), and an uninterrupted Trainer run for
``resume_from_checkpoint``.
"""

import copy
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from test_transformers_integration import HYPER, _model, _tokens

import sonar_kernels
from sonar_kernels.integrations import transformers as hf
from sonar_kernels.optim import UnownedExpertsWarning

transformers = pytest.importorskip("transformers", minversion="5.13")

EXPERT_NAMES = ("gate_up_proj", "down_proj")


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        tokens = _tokens(i)[0]
        return {"input_ids": tokens, "labels": tokens}


class _DenseClip(transformers.TrainerCallback):
    """The reference's clipping: the dense parameters' gradients to a global norm of 0.5, before each step."""

    def __init__(self, model):
        self.dense = [p for name, p in model.named_parameters() if not name.endswith(EXPERT_NAMES)]

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        torch.nn.utils.clip_grad_norm_(self.dense, 0.5)


def _args(out, **options):
    defaults = {
        "max_steps": 2, "per_device_train_batch_size": 2, "max_grad_norm": 0.5, "report_to": [],
        "save_strategy": "no", "use_cpu": True, "disable_tqdm": True, "seed": 0,
    }  # fmt: skip
    return transformers.TrainingArguments(output_dir=str(out), **{**defaults, **options})


def _train(model, out, optimizer=None, n=8, callbacks=(), resume=None, **options):
    """A Trainer run on ``model`` (``optimizer``: a SonarAdamW or torch.optim.AdamW, or a (class, kwargs)
    pair for optimizer_cls_and_kwargs, or None for Trainer's default)."""
    given = {}
    if isinstance(optimizer, tuple):
        given["optimizer_cls_and_kwargs"] = optimizer
    elif optimizer is not None:
        given["optimizers"] = (optimizer, None)
    trainer = transformers.Trainer(
        model=model, args=_args(out, **options), train_dataset=_Tokens(n), callbacks=list(callbacks), **given
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _assert_equal(got, expected):
    for (name, p), q in zip(got.named_parameters(), expected.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: {(p - q).abs().max()}"


def _snapshot(state):
    """A deep copy of a state_dict (tensors cloned)."""
    return copy.deepcopy(state)


def _assert_same_state(a, b, where=""):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same_state(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same_state(x, y, f"{where}/{i}")
    else:
        assert a == b, where


# --- Item 2: "sonar" once the package is imported, whatever the import order ---

_BUILD = """
    import importlib.abc, sys, tempfile

    class NoTransformers(importlib.abc.MetaPathFinder):  # transformers absent while sonar_kernels imports
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "transformers":
                raise ModuleNotFoundError(name)

    {imports}
    import torch
    config = transformers.OlmoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
    )
    built = {{"from_config": transformers.AutoModelForCausalLM.from_config(config, experts_implementation="sonar")}}
    with tempfile.TemporaryDirectory() as path:
        transformers.OlmoeForCausalLM(config).save_pretrained(path)
        built["from_pretrained"] = transformers.OlmoeForCausalLM.from_pretrained(path, experts_implementation="sonar")
    config._experts_implementation = "sonar"
    built["config"] = transformers.OlmoeForCausalLM(config)
    for how, model in built.items():
        assert model.config._experts_implementation == "sonar", how
        experts = model.model.layers[0].mlp.experts
        assert sonar_kernels.integrations.transformers.expert_tensors(experts) is not None, how
        tokens = torch.randint(3, 64, (1, 6))
        model(tokens, labels=tokens).loss.backward()
        assert experts.gate_up_proj.grad is not None, how
    print("ok")
"""

_ORDERS = {
    # sonar_kernels first, with transformers not importable meanwhile: nothing of transformers imported.
    "sonar_kernels-first": """
    blocker = NoTransformers()
    sys.meta_path.insert(0, blocker)
    import sonar_kernels
    assert not [m for m in sys.modules if m.split(".")[0] == "transformers"], "sonar_kernels imported transformers"
    sys.meta_path.remove(blocker)
    import transformers
    """,
    "transformers-first": """
    import transformers
    import sonar_kernels
    """,
    "models-imported-first": """
    import transformers
    from transformers import OlmoeForCausalLM, Trainer
    import sonar_kernels
    """,
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", list(_ORDERS))
def test_sonar_is_available_after_import_sonar_kernels_in_any_order(order):
    # A fresh interpreter per order: the registration runs once per process.
    code = textwrap.dedent(_BUILD).format(imports=textwrap.dedent(_ORDERS[order]).strip())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=110
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# --- Item 4: transformers.Trainer ---


@pytest.mark.parametrize("given", ["optimizers", "optimizer_cls_and_kwargs"])
def test_a_gradient_accumulation_other_than_the_optimizers_is_refused_before_any_update(tmp_path, given):
    hf.register()
    model = _model("olmoe", implementation="sonar", backend="torch")
    weights = copy.deepcopy(model.state_dict())
    if given == "optimizers":
        optimizer = sonar_kernels.SonarAdamW(model, **HYPER)  # accumulation_steps=1
        state = _snapshot(optimizer.state_dict())
    else:
        optimizer = (sonar_kernels.SonarAdamW, dict(HYPER))
    pattern = r"SonarAdamW\(accumulation_steps=1\).*gradient_accumulation_steps=2.*accumulation_steps=2"
    with pytest.raises(ValueError, match=pattern):
        _train(model, tmp_path, optimizer, gradient_accumulation_steps=2)
    _assert_same_state(model.state_dict(), weights, "weights")
    assert all(p.grad is None for p in model.parameters())
    if given == "optimizers":
        _assert_same_state(optimizer.state_dict(), state, "optimizer")


def test_matching_gradient_accumulation_equals_torch_adamw_with_dense_clipping_bitwise(tmp_path):
    hf.register()
    model = _model("olmoe", implementation="sonar", backend="torch")
    standard = copy.deepcopy(model)
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, accumulation_steps=2)  # Trainer clips (dense only)
    _train(model, tmp_path / "sonar", optimizer, gradient_accumulation_steps=2)
    for p in optimizer.expert_tensors:
        assert float(optimizer.state[p]["step"]) == 2.0  # once per optimizer step, not per micro-batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnownedExpertsWarning)  # the reference trains the experts as dense
        # Fused: SonarAdamW's default flags run torch's fused AdamW on the CPU.
        reference = torch.optim.AdamW(standard.parameters(), **HYPER, fused=True)
        _train(
            standard, tmp_path / "standard", reference,
            callbacks=[_DenseClip(standard)], gradient_accumulation_steps=2, max_grad_norm=0.0,
        )  # fmt: skip
    _assert_equal(model, standard)


def test_a_sonar_model_loads_its_save_pretrained_checkpoint_with_load_state_dict(tmp_path):
    # What Trainer's resume_from_checkpoint does: model.load_state_dict(safetensors file, strict=False).
    import safetensors.torch

    hf.register()
    saved = _model("olmoe", implementation="sonar", backend="torch", seed=0)
    saved.save_pretrained(tmp_path)
    checkpoint = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in checkpoint  # the hub's per-expert format
    model = _model("olmoe", implementation="sonar", backend="torch", seed=1)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    result = model.load_state_dict(checkpoint, strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    assert model.model.layers[0].mlp.experts.gate_up_proj is experts  # loaded in place
    _assert_equal(model, saved)
    # The model's own format still loads as it is.
    other = _model("olmoe", implementation="sonar", backend="torch", seed=2)
    model.load_state_dict(other.state_dict())
    _assert_equal(model, other)


# SonarAdamW's expert clipping: none; SPAM's spike rule; the lagged coefficient (a max_grad_norm small enough
# that it clips at every step, so that a resume that lost it would differ).
CLIPPING = {
    "none": {},
    "spike": {"expert_clipping": "spike", "spike_threshold": 2.0},
    "lagged": {"expert_clipping": "lagged", "max_grad_norm": 0.01},
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("clipping", list(CLIPPING))
def test_resume_from_checkpoint_continues_like_an_uninterrupted_run_bitwise(tmp_path, clipping):
    hf.register()
    options = {
        "gradient_accumulation_steps": 2, "max_steps": 4, "save_strategy": "steps", "save_steps": 2,
    }  # fmt: skip

    def run(out, seed, resume=None):
        model = _model("olmoe", implementation="sonar", backend="torch", seed=seed)
        optimizer = sonar_kernels.SonarAdamW(model, **HYPER, accumulation_steps=2, **CLIPPING[clipping])
        # 16 samples, 4 optimizer steps per epoch: the checkpoint of step 2 is in the middle of the epoch.
        _train(model, out, optimizer, n=16, resume=resume, **options)
        return model, optimizer

    uninterrupted, optimizer = run(tmp_path / "full", seed=0)
    # Another initialisation: whatever the checkpoint does not restore differs.
    resumed, resumed_optimizer = run(
        tmp_path / "resumed", seed=1, resume=str(tmp_path / "full" / "checkpoint-2")
    )
    _assert_equal(resumed, uninterrupted)
    _assert_same_state(resumed_optimizer.state_dict(), optimizer.state_dict(), "optimizer")
    if clipping == "lagged":
        assert float(optimizer.expert_clip_coef) < 1.0
        assert torch.equal(resumed_optimizer.expert_clip_coef, optimizer.expert_clip_coef)


def test_unmanaged_experts_warning_once_per_trainer_run_and_never_with_sonar_adamw(tmp_path):
    hf.register()
    model = _model("olmoe", implementation="sonar", backend="torch")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # every warning recorded, repeats included
        _train(model, tmp_path / "default", max_steps=3)  # Trainer's own AdamW
    unowned = [w for w in record if issubclass(w.category, UnownedExpertsWarning)]
    assert len(unowned) == 1, [str(w.message) for w in unowned]
    assert "SonarAdamW" in str(unowned[0].message)
    for given in ("optimizers", "optimizer_cls_and_kwargs"):
        model = _model("olmoe", implementation="sonar", backend="torch")
        optimizer = (
            sonar_kernels.SonarAdamW(model, **HYPER)
            if given == "optimizers"
            else (sonar_kernels.SonarAdamW, dict(HYPER))
        )
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            _train(model, tmp_path / given, optimizer, max_steps=3)
        ours = [
            str(w.message)
            for w in record
            if "expert" in str(w.message) or issubclass(w.category, UnownedExpertsWarning)
        ]
        assert not ours, (given, ours)
