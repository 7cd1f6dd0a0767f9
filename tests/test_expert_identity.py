"""No silent standard training: the experts reach their in-backward update however the optimizer and the
model were built (docs/usage.md, "Ownership"), or an error or the documented warning says why not.

References: SonarAdamW(model) on the same model built the plain way (the documented path, itself tested
against torch.optim.AdamW(fused=True) with dense-only clipping in test_sonar_adamw.py), or
torch.optim.AdamW(fused=True) (what SonarAdamW's default flags run on the CPU) with the same parameter
groups and dense-only clipping.
"""

import copy
import warnings

import pytest
import torch
from numerics import rel_err
from test_ownership import Tiny

import sonar_kernels
from sonar_kernels import specs

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
BACKENDS = ["torch", "triton"]
EXPERT_NAMES = ("gate_up_proj", "down_proj")


def _batch(step, dtype=torch.float32):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 16, generator=generator).to(dtype)


def _experts(model):
    return [p for name, p in model.named_parameters() if name.endswith(EXPERT_NAMES)]


def _train(model, optimizer, steps=3, dtype=torch.float32, clip_dense=None):
    """``steps`` training steps; after each backward, every expert tensor of ``model`` must have been
    updated in it (no .grad, its step advanced by one) when ``optimizer`` is in-backward."""
    for step in range(steps):
        model(_batch(step, dtype)).square().mean().backward()
        if isinstance(optimizer, sonar_kernels.SonarAdamW):
            for p in _experts(model):
                assert p.grad is None, "an expert tensor kept its gradient: trained as a dense one"
                assert float(optimizer.state[p]["step"]) == step + 1
        if clip_dense is not None:
            torch.nn.utils.clip_grad_norm_(clip_dense(model), 0.5)
        optimizer.step()
        optimizer.zero_grad()


def _assert_equal(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q), f"{name}: {(p.float() - q.float()).abs().max()}"


def _reference(backend, steps=3, **options):
    """The documented path: SonarAdamW(model) on a model built the plain way."""
    model = Tiny(backend=backend)
    _train(model, sonar_kernels.SonarAdamW(model, **HYPER, **options), steps)
    return model


# --- Case 1: the optimizer built over parameters or name-based groups of a transformers "sonar" model ---

transformers = pytest.importorskip("transformers", minversion="5.13")


def _olmoe(backend, seed=0, implementation="sonar"):
    from sonar_kernels.integrations import transformers as hf

    hf.register()
    torch.manual_seed(seed)
    config = transformers.OlmoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=1,
        pad_token_id=2,
    )  # fmt: skip
    config._experts_implementation = implementation
    model = transformers.OlmoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(EXPERT_NAMES):
                p.normal_(0, p.shape[-1] ** -0.5)
    return hf.set_backend(model, backend)


def _train_lm(model, optimizer, steps=3):
    for step in range(steps):
        tokens = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        model(tokens, labels=tokens).loss.backward()
        for name, p in model.named_parameters():
            if name.endswith(EXPERT_NAMES):
                assert p.grad is None, f"{name} kept its gradient: trained as a dense parameter"
        optimizer.step()
        optimizer.zero_grad()


def _decay_groups(model):
    """Name-based decay / no-decay groups (gpt-oss's and Qwen3-MoE's recipes, transformers.Trainer's)."""
    decay = [p for name, p in model.named_parameters() if p.dim() >= 2 and "norm" not in name]
    no_decay = [p for name, p in model.named_parameters() if p.dim() < 2 or "norm" in name]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameters_of_a_transformers_model_equal_the_model_given_bitwise(backend):
    base = _olmoe(backend)
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    _train_lm(reference, sonar_kernels.SonarAdamW(reference, **HYPER, max_grad_norm=0.5))
    optimizer = sonar_kernels.SonarAdamW(model.parameters(), **HYPER, max_grad_norm=0.5)
    _train_lm(model, optimizer)
    assert len(optimizer.expert_tensors) == 4
    _assert_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_name_based_groups_of_a_transformers_model_equal_torch_adamw_with_dense_clipping(backend):
    base = _olmoe(backend)
    standard, model = copy.deepcopy(base), copy.deepcopy(base)
    optimizer = sonar_kernels.SonarAdamW(_decay_groups(model), **HYPER, max_grad_norm=0.5)
    _train_lm(model, optimizer)
    assert len(optimizer.expert_tensors) == 4
    # Standard training with the same groups, the dense parameters clipped in the groups' order; fused, as
    # SonarAdamW's default flags run torch's fused AdamW on the CPU.
    reference = torch.optim.AdamW(_decay_groups(standard), **HYPER, fused=True)
    experts = {id(p) for p in _experts(standard)}
    for step in range(3):
        tokens = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        standard(tokens, labels=tokens).loss.backward()
        dense = [p for group in reference.param_groups for p in group["params"] if id(p) not in experts]
        torch.nn.utils.clip_grad_norm_(dense, 0.5)
        reference.step()
        reference.zero_grad()
    if backend == "torch":
        _assert_equal(model, standard)
    else:  # the Triton update's arithmetic against torch's CPU AdamW (test_sonar_adamw.py's bound)
        for (name, p), q in zip(model.named_parameters(), standard.parameters(), strict=True):
            assert rel_err(p, q) <= 1e-6, name


# --- Case 2: Parameter objects replaced before the optimizer is built ---


def _meta_then_to_empty(backend):
    with torch.device("meta"):
        model = Tiny(backend=backend)
    model.to_empty(device="cpu")
    model.load_state_dict(Tiny(backend=backend).state_dict())  # the weights of the reference
    return model


def _overwrite_conversion(backend):
    model = Tiny(backend=backend)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        before = [id(p) for p in model.parameters()]
        model.float()
        assert all(id(p) != b for p, b in zip(model.parameters(), before, strict=True))
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    return model


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "build", [_meta_then_to_empty, _overwrite_conversion], ids=["meta-to_empty", "overwrite"]
)
@pytest.mark.parametrize("given", ["parameters", "groups"])
def test_replaced_parameters_are_adopted_at_the_first_forward(backend, build, given):
    model = build(backend)
    assert not any(specs.is_expert_tensor(p) for p in _experts(model))  # the marks went with the old objects
    params = (
        model.parameters()
        if given == "parameters"
        else [
            {"params": [p for n, p in model.named_parameters() if n.startswith(m)]}
            for m in ("router", "experts", "head")
        ]
    )
    optimizer = sonar_kernels.SonarAdamW(params, **HYPER, max_grad_norm=0.5)
    _train(model, optimizer)
    assert len(optimizer.expert_tensors) == 2
    _assert_equal(model, _reference(backend, max_grad_norm=0.5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tensor_the_update_cannot_take_is_refused_at_the_first_forward_before_anything(backend):
    model = _meta_then_to_empty(backend)
    groups = [
        {"params": list(model.experts.parameters()), "amsgrad": True},
        {"params": [*model.router.parameters(), *model.head.parameters()]},
    ]
    optimizer = sonar_kernels.SonarAdamW(groups, **HYPER)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"amsgrad=True.* holds expert tensors"):
        model(_batch(0)).square().mean().backward()
    assert not optimizer.expert_tensors and all(not optimizer.state[p] for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_experts_switched_to_sonar_after_a_dense_backward_are_refused_until_step():
    model = _olmoe("torch", implementation="eager")
    with pytest.warns(UserWarning, match="unless the model is switched"):
        optimizer = sonar_kernels.SonarAdamW(model, **HYPER)
    tokens = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    model(tokens, labels=tokens).loss.backward()  # the experts' gradients reach .grad: dense
    model.set_experts_implementation("sonar")
    with pytest.raises(RuntimeError, match="trained as a dense parameter"):
        model(tokens, labels=tokens)
    assert not optimizer.expert_tensors
    optimizer.step()  # the dense step of that backward, the experts included (they were dense)
    optimizer.zero_grad()
    _train_lm(model, optimizer, steps=1)  # adopted at this forward, with the state of that step
    assert len(optimizer.expert_tensors) == 4
    assert all(float(optimizer.state[p]["step"]) == 2.0 for p in optimizer.expert_tensors)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("given", ["parameters", "groups"])
def test_fsdp2_sharded_parameters_given_as_a_list_are_expert_tensors(one_rank_mesh, backend, given):
    from torch.distributed.fsdp import fully_shard

    models = []
    for target in ("model", given):
        model = Tiny(backend=backend)
        fully_shard(model.experts, mesh=one_rank_mesh)
        fully_shard(model, mesh=one_rank_mesh)
        params = {
            "model": model,
            "parameters": model.parameters(),
            "groups": [{"params": list(model.experts.parameters())}, {"params": [model.head.weight, model.head.bias]},
                       {"params": list(model.router.parameters())}],
        }[target]  # fmt: skip
        optimizer = sonar_kernels.SonarAdamW(params, **HYPER)
        assert len(optimizer.expert_tensors) == 2
        _train(model, optimizer)
        models.append(model)
    for p, q in zip(models[1].parameters(), models[0].parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local())


# --- Case 3: an optimizer that does not own the experts, an optimizer that finds none ---


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_optimizer_that_does_not_own_the_experts_is_named_once(backend):
    model = Tiny(backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
    with pytest.warns(UserWarning, match="AdamW trains 2 expert tensor.*SonarAdamW") as record:
        _train(model, optimizer, steps=3)
    assert sum("expert tensor" in str(w.message) for w in record) == 1
    # The training itself is standard training, unchanged.
    standard = Tiny(backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(standard, torch.optim.AdamW(standard.parameters(), **HYPER), steps=3)
    _assert_equal(model, standard)


def test_transformers_trainers_default_optimizer_is_named(tmp_path):
    model = _olmoe("torch")

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            tokens = torch.randint(3, 64, (12,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": tokens, "labels": tokens}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    with pytest.warns(UserWarning, match="trains 4 expert tensor.*SonarAdamW"):
        trainer.train()


def test_sonar_adamw_over_a_model_without_experts_warns_once():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER)
    with pytest.warns(UserWarning, match="updates no expert tensor in the backward") as record:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
    assert sum("no expert tensor" in str(w.message) for w in record) == 1


# --- Case 7: a conversion in swap mode after the optimizer was built ---


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("given", ["model", "parameters"])
def test_a_swap_conversion_after_the_optimizer_equals_building_it_after(backend, given):
    def converted(model):
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            return model.to(torch.bfloat16)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)

    model = Tiny(backend=backend)
    optimizer = sonar_kernels.SonarAdamW(model if given == "model" else model.parameters(), **HYPER)
    converted(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    _train(model, optimizer, dtype=torch.bfloat16)
    reference = converted(Tiny(backend=backend))
    _train(reference, sonar_kernels.SonarAdamW(reference, **HYPER), dtype=torch.bfloat16)
    _assert_equal(model, reference)
    for p in _experts(model):
        assert optimizer.state[p]["exp_avg"].dtype == torch.bfloat16


# --- Every way to build the optimizer: each expert tensor updated in the backward once per step ---


def _sweep_ddp(model, mesh):
    from torch.nn.parallel import DistributedDataParallel

    # Before DDP wraps the module, with the group over which the experts are replicated (docs/distributed.md).
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, data_parallel_group=mesh)
    return DistributedDataParallel(model), optimizer


def _sweep_fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.experts, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, sonar_kernels.SonarAdamW(model.parameters(), **HYPER)


def _sweep_add_param_group(model, mesh):
    optimizer = sonar_kernels.SonarAdamW(model.router.parameters(), **HYPER)
    optimizer.add_param_group({"params": model.experts.parameters()})
    optimizer.add_param_group({"params": model.head.parameters(), "weight_decay": 0.0})
    return model, optimizer


def _sweep_trainer(model, mesh):
    args = transformers.TrainingArguments(output_dir="/tmp/unused", report_to=[], use_cpu=True)
    trainer = transformers.Trainer(
        model=model, args=args, optimizer_cls_and_kwargs=(sonar_kernels.SonarAdamW, dict(HYPER))
    )
    return model, trainer.create_optimizer()


def _sweep_torchtitan(model, mesh):
    pytest.importorskip("torchtitan")
    from sonar_kernels.integrations.torchtitan import sonar_adamw

    container = sonar_adamw(**HYPER).build(model_parts=[model])
    return model, next(iter(container))


SWEEP = {
    "model": lambda model, mesh: (model, sonar_kernels.SonarAdamW(model, **HYPER)),
    "parameters": lambda model, mesh: (model, sonar_kernels.SonarAdamW(model.parameters(), **HYPER)),
    "generator-of-named": lambda model, mesh: (
        model,
        sonar_kernels.SonarAdamW((p for _, p in model.named_parameters()), **HYPER),
    ),
    "decay-groups": lambda model, mesh: (model, sonar_kernels.SonarAdamW(_decay_groups(model), **HYPER)),
    "add_param_group": _sweep_add_param_group,
    "ddp": _sweep_ddp,
    "fsdp2": _sweep_fsdp2,
    "trainer-create_optimizer": _sweep_trainer,
    "torchtitan-container": _sweep_torchtitan,
    "meta-to_empty": lambda model, mesh: (
        _meta_then_to_empty("torch"),
        None,
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", list(SWEEP))
def test_every_way_to_build_the_optimizer_updates_each_expert_tensor_in_the_backward_once_per_step(
    one_rank_mesh, path
):
    model, optimizer = SWEEP[path](Tiny(), one_rank_mesh)
    if optimizer is None:
        optimizer = sonar_kernels.SonarAdamW(model.parameters(), **HYPER)
    inner = getattr(model, "module", model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            model(_batch(step)).square().mean().backward()
            for p in _experts(inner):
                assert sonar_kernels.optim.expert_optimizer(p) is optimizer
                assert p.grad is None and float(optimizer.state[p]["step"]) == step + 1
            optimizer.step()
            for p in _experts(inner):
                assert float(optimizer.state[p]["step"]) == step + 1
            optimizer.zero_grad()
    # Neither the unowned-experts nor the no-experts warning; FSDP2's shards, updated from their reduced
    # gradient (not in the wgrad epilogue), are told so once (ShardedExpertsWarning), the others never.
    sharded = [w for w in caught if issubclass(w.category, sonar_kernels.optim.ShardedExpertsWarning)]
    assert [str(w.message) for w in caught if w not in sharded] == []
    assert len(sharded) == (1 if path == "fsdp2" else 0), path
    if sharded:
        assert "fully_shard_dense" in str(sharded[0].message)
