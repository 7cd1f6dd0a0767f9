"""Expert tensors replaced by new Parameter objects after training started (docs/usage.md, "Ownership"):
``load_state_dict(assign=True)``, ``to_empty()`` (plain, and with torch's overwrite and swap conversion
modes), ``torch.utils.swap_tensors``. The optimizer that updated the old tensor adopts the new one with
its state, on both backends and every state kind: the run equals, bit for bit, the same run without the
replacement (weights and optimizer state). Where it cannot (another shape), a warning says so at that
forward; a replacement between a backward and ``step()`` is refused before anything changes.

The reference is the same training without the replacement, itself tested against torch.optim.AdamW in
test_sonar_adamw.py, test_moments_8bit_optim.py and test_master_weights_optim.py.
"""

import copy
import warnings

import pytest
import torch
from numerics import assert_same_run

import sonar_kernels
from sonar_kernels.optim.ownership import UnownedExpertsWarning

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
BACKENDS = ["torch", "triton"]
# The state kinds: (the parameters' dtype, SonarAdamW's options).
KINDS = {
    "fp32": (torch.float32, {}),
    "8bit": (torch.float32, {"moments_dtype": "8bit"}),
    "bf16": (torch.bfloat16, {}),
    "bf16-remainder": (torch.bfloat16, {"master_weights": "remainder"}),
    "bf16-stochastic": (torch.bfloat16, {"master_weights": "stochastic", "rounding_seed": 3}),
    "bf16-8bit-remainder": (torch.bfloat16, {"moments_dtype": "8bit", "master_weights": "remainder"}),
}
# Steps before the replacement, and in all.
BEFORE, STEPS = 2, 4


class Tiny(torch.nn.Module):
    """A router, SonarExperts and a dense head; H and I multiples of the 8-bit moments' block (32)."""

    def __init__(self, backend="torch", hidden=32):
        super().__init__()
        torch.manual_seed(0)
        self.router = torch.nn.Linear(hidden, 4)
        self.experts = sonar_kernels.SonarExperts(4, hidden, 32, backend=backend)
        self.head = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        weights, index = torch.softmax(self.router(x), -1).topk(2, dim=-1)
        return self.head(self.experts(x, index, weights.to(x.dtype)))


def _batch(step, dtype):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 32, generator=generator).to(dtype)


def _assign(model):
    """model.experts.load_state_dict(assign=True) with copies of its own values (a checkpoint just saved)."""
    state = {key: value.clone() for key, value in model.experts.state_dict().items()}
    model.experts.load_state_dict(state, assign=True)


def _to_empty(model, mode=None):
    """to_empty() then the saved values loaded: plain (``param.data`` replaced), or in torch's "overwrite"
    mode (new Parameter objects) or "swap" mode (the Parameter objects kept, their contents swapped)."""
    state = {key: value.clone() for key, value in model.experts.state_dict().items()}
    flag = {
        None: None,
        "overwrite": torch.__future__.set_overwrite_module_params_on_conversion,
        "swap": torch.__future__.set_swap_module_params_on_conversion,
    }[mode]
    if flag is not None:
        flag(True)
    try:
        model.experts.to_empty(device="cpu")
    finally:
        if flag is not None:
            flag(False)
    model.experts.load_state_dict(state)


def _swap_tensors(model):
    """torch.utils.swap_tensors of each expert Parameter with a new one holding its values."""
    for p in model.experts.parameters():
        torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().clone()))


WAYS = {
    "assign": _assign,
    "to_empty-overwrite": lambda model: _to_empty(model, "overwrite"),
    "to_empty-swap": lambda model: _to_empty(model, "swap"),
    "to_empty": _to_empty,
    "swap_tensors": _swap_tensors,
}


def _run(backend, kind, replace=None):
    dtype, options = KINDS[kind]
    model = Tiny(backend=backend).to(dtype)
    optimizer = sonar_kernels.SonarAdamW(model.parameters(), **HYPER, **options, max_grad_norm=0.5)
    for step in range(STEPS):
        if replace is not None and step == BEFORE:
            replace(model)
        model(_batch(step, dtype)).square().mean().backward()
        for p in model.experts.parameters():
            assert p.grad is None, "an expert tensor kept its gradient: no in-backward owner"
            assert float(optimizer.state[p]["step"]) == step + 1
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


# Under the Triton interpreter one new-object path and one swap path (the others share their code).
CASES = [
    (backend, kind, way)
    for backend in BACKENDS
    for kind in KINDS
    for way in WAYS
    if backend == "torch" or way in ("assign", "swap_tensors")
]


@pytest.mark.parametrize(("backend", "kind", "way"), CASES)
def test_a_replacement_after_training_started_equals_no_replacement_bitwise(backend, kind, way):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # none of ours: the optimizer keeps training the experts
        replaced = _run(backend, kind, WAYS[way])
    assert_same_run(replaced, _run(backend, kind))
    model, optimizer = replaced
    assert [id(p) for p in optimizer.expert_tensors] == [id(p) for p in model.experts.parameters()]


def _trained_one_step(backend):
    """Tiny with SonarAdamW after one whole step (fp32)."""
    model = Tiny(backend=backend)
    optimizer = sonar_kernels.SonarAdamW(model.parameters(), **HYPER)
    model(_batch(0, torch.float32)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_whole_model_assign_load_keeps_the_experts_trained_and_names_the_dense_parameters(backend):
    # The dense parameters follow torch.optim.AdamW's rule (the optimizer holds the old objects): the
    # experts are adopted, and the dense parameters left behind are named once.
    model, optimizer = _trained_one_step(backend)
    before = [optimizer.state[p] for p in model.experts.parameters()]
    model.load_state_dict({key: value.clone() for key, value in model.state_dict().items()}, assign=True)
    model(_batch(1, torch.float32)).square().mean().backward()
    for p in model.experts.parameters():
        assert p.grad is None and float(optimizer.state[p]["step"]) == 2.0
    assert all(
        optimizer.state[p] is state for p, state in zip(model.experts.parameters(), before, strict=True)
    )
    with pytest.warns(UserWarning, match=r"4 dense parameter\(s\) it holds got no gradient"):
        optimizer.step()
    optimizer.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # once per optimizer
        model(_batch(2, torch.float32)).square().mean().backward()
        optimizer.step()


def test_a_transformers_model_reloaded_with_assign_keeps_its_experts_trained():
    transformers = pytest.importorskip("transformers", minversion="5.13")
    from test_expert_identity import EXPERT_NAMES, _olmoe

    model = _olmoe("torch")
    optimizer = sonar_kernels.SonarAdamW(model.parameters(), **HYPER)
    tokens = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.load_state_dict({key: value.clone() for key, value in model.state_dict().items()}, assign=True)
    model(tokens, labels=tokens).loss.backward()
    experts = [p for name, p in model.named_parameters() if name.endswith(EXPERT_NAMES)]
    assert len(experts) == 4 and isinstance(model, transformers.PreTrainedModel)
    for p in experts:
        assert p.grad is None and float(optimizer.state[p]["step"]) == 2.0
        assert any(p is q for q in optimizer.expert_tensors)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replacement_the_optimizer_cannot_take_is_named_at_that_forward(backend):
    model, optimizer = _trained_one_step(backend)
    # Two experts fewer: the state of the old tensor cannot follow.
    model.experts.gate_up_proj = torch.nn.Parameter(model.experts.gate_up_proj.detach()[:2].clone())
    model.experts.down_proj = torch.nn.Parameter(model.experts.down_proj.detach()[:2].clone())
    model.router = torch.nn.Linear(32, 2)
    with pytest.warns(UnownedExpertsWarning, match=r"shape \(2, 64, 32\) replaced one that SonarAdamW"):
        model(_batch(1, torch.float32)).square().mean().backward()
    assert model.experts.gate_up_proj.grad is not None  # not updated: nobody owns it, as the warning says
    assert all(not any(p is q for q in optimizer.expert_tensors) for p in model.experts.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replacement_between_a_backward_and_step_is_refused_before_anything(backend):
    model = Tiny(backend=backend)
    optimizer = sonar_kernels.SonarAdamW(model.parameters(), **HYPER)
    model(_batch(0, torch.float32)).square().mean().backward()  # experts updated; step() not called yet
    old = list(model.experts.parameters())
    states = [{key: value.clone() for key, value in optimizer.state[p].items()} for p in old]
    _assign(model)
    new = list(model.experts.parameters())
    with pytest.raises(RuntimeError, match=r"replaced by a new tensor .* between a backward"):
        model(_batch(1, torch.float32))
    for p, q, state in zip(old, new, states, strict=True):
        assert torch.equal(p, q) and q.grad is None
        assert any(p is r for r in optimizer.expert_tensors)
        assert all(torch.equal(optimizer.state[p][key], value) for key, value in state.items())


def _restore(model, snapshot, way):
    """The rollback of the model to ``snapshot`` (its state_dict): in place, or the experts as new Parameter
    objects (a whole-model assign would leave the dense parameters behind, as with torch.optim.AdamW): the
    dense parameters then restored in place, the experts' tensors only replaced, never written."""
    if way == "in_place":
        model.load_state_dict({key: value.clone() for key, value in snapshot.items()})
        return
    dense = {key: value.clone() for key, value in snapshot.items() if not key.startswith("experts.")}
    missing = model.load_state_dict(dense, strict=False).missing_keys
    assert missing and all(key.startswith("experts.") for key in missing)
    experts = {key[len("experts.") :]: value for key, value in snapshot.items() if key.startswith("experts.")}
    model.experts.load_state_dict({key: value.clone() for key, value in experts.items()}, assign=True)


@pytest.mark.parametrize("way", ["assign", "in_place"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rollback_between_a_backward_and_step_is_refused_at_step_then_honoured_by_loading_the_state(
    backend, way
):
    # The usual rollback of a bad step: restore the snapshot taken before the backward, straight to step().
    # step() refuses it before anything changes (the updated weights would be given up while their moments
    # and step keep the update); loading the optimizer's state of the snapshot then completes the rollback,
    # and the run equals, bit for bit, the run that never took the bad step.
    model, optimizer = _trained_one_step(backend)
    snapshot = {key: value.clone() for key, value in model.state_dict().items()}
    saved = copy.deepcopy(optimizer.state_dict())  # a state_dict holds the live state tensors
    model(_batch(1, torch.float32)).square().mean().backward()  # the bad step: experts updated
    experts = list(model.experts.parameters())
    after = [{key: value.clone() for key, value in optimizer.state[p].items()} for p in experts]
    dense = [(p, p.detach().clone(), p.grad.clone()) for p in optimizer.dense_parameters()]
    _restore(model, snapshot, way)
    how = "replaced in its experts module" if way == "assign" else "written in place"
    with pytest.raises(RuntimeError, match=rf"was {how}.* between the backward that updated it and step\(\)"):
        optimizer.step()
    for p, state in zip(experts, after, strict=True):  # nothing changed: the state holds the update still
        assert any(p is q for q in optimizer.expert_tensors)
        assert all(torch.equal(optimizer.state[p][key], value) for key, value in state.items())
    for p, value, grad in dense:
        assert (
            torch.equal(p, value) and torch.equal(p.grad, grad) and float(optimizer.state[p]["step"]) == 1.0
        )
    optimizer.load_state_dict(saved)  # completes the rollback and ends the step
    optimizer.zero_grad()
    for step in (2, 3):
        model(_batch(step, torch.float32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    reference, reference_optimizer = _trained_one_step(backend)  # never took the bad step
    for step in (2, 3):
        reference(_batch(step, torch.float32)).square().mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert_same_run((model, optimizer), (reference, reference_optimizer))


def test_ownership_warnings_name_the_users_line():
    # UnownedExpertsWarning at the forward of a replacement the optimizer cannot take, and at the first step
    # of torch.optim.AdamW over "sonar" experts: the line named is this file's, never torch's nn.Module call
    # or optimizer wrapper; so are SonarAdamW's own warnings from step().
    model, _optimizer = _trained_one_step("torch")  # alive: the owner the warning names
    model.experts.gate_up_proj = torch.nn.Parameter(model.experts.gate_up_proj.detach()[:2].clone())
    model.experts.down_proj = torch.nn.Parameter(model.experts.down_proj.detach()[:2].clone())
    model.router = torch.nn.Linear(32, 2)
    with pytest.warns(UnownedExpertsWarning) as caught:
        model(_batch(1, torch.float32))
    assert {w.filename for w in caught} == {__file__}
    plain = Tiny()
    adamw = torch.optim.AdamW(plain.parameters(), **HYPER)
    plain(_batch(0, torch.float32)).square().mean().backward()
    with pytest.warns(UnownedExpertsWarning) as caught:
        adamw.step()
    assert {w.filename for w in caught} == {__file__}
    dense = sonar_kernels.SonarAdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.warns(UserWarning, match="updates no expert tensor") as caught:
        dense.step()
    assert {w.filename for w in caught} == {__file__}
