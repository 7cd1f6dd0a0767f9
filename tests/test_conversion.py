"""A model cast with its SonarAdamW kept (``model.to(torch.bfloat16)``; docs/usage.md, "Casting the model
after building the optimizer"): the state of every parameter follows the new dtype, the expert tensors' at
their module's forward and the dense parameters' at ``step()``, so the step after the cast is applied
whole. References: building the optimizer after the cast (a cast before any step), a checkpoint whose state
was converted by hand and loaded into a new optimizer after the cast, and torch.optim.AdamW(fused=True)
with its state converted by hand (the torch backend: SonarAdamW's default flags run torch's fused AdamW on
the CPU, bitwise, test_sonar_adamw.py)."""

import warnings

import pytest
import torch
from test_replacement import Tiny, _batch

import sonar_kernels
from sonar_kernels.optim.ownership import UnownedExpertsWarning

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
BACKENDS = ["torch", "triton"]
KINDS = {"default": {}, "8bit": {"moments_dtype": "8bit"}}
BEFORE, STEPS = 2, 4


def _train(model, optimizer, steps, first=0):
    for step in range(first, steps):
        dtype = next(model.parameters()).dtype
        model(_batch(step, dtype)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _by_hand(saved: dict, dtype: torch.dtype) -> dict:
    """``saved`` (an optimizer's state_dict) with every floating tensor but ``step`` and 8-bit codes in
    ``dtype``: what torch.optim.AdamW would hold had it been built after the cast."""
    state = {}
    for index, entries in saved["state"].items():
        codes = "exp_avg_codes" in entries
        # Copies: a state_dict holds the optimizer's live tensors (the step of the run going on).
        state[index] = {
            key: value.to(dtype)
            if key != "step" and not codes and value.is_floating_point()
            else value.clone()
            for key, value in entries.items()
        }
    return {"state": state, "param_groups": saved["param_groups"]}


def _assert_equal(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q), f"{name}: {(p.float() - q.float()).abs().max()}"


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cast_before_any_step_equals_building_the_optimizer_after_it(backend, kind):
    model = Tiny(backend=backend)
    optimizer = sonar_kernels.SonarAdamW(model.parameters(), **HYPER, **KINDS[kind], max_grad_norm=0.5)
    model.to(torch.bfloat16)
    _train(model, optimizer, 2)
    reference = Tiny(backend=backend).to(torch.bfloat16)
    _train(
        reference,
        sonar_kernels.SonarAdamW(reference.parameters(), **HYPER, **KINDS[kind], max_grad_norm=0.5),
        2,
    )
    _assert_equal(model, reference)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cast_after_training_started_equals_a_checkpoint_converted_by_hand(backend, kind):
    model = Tiny(backend=backend)
    optimizer = sonar_kernels.SonarAdamW(model.parameters(), **HYPER, **KINDS[kind], max_grad_norm=0.5)
    _train(model, optimizer, BEFORE)
    reference = Tiny(backend=backend)
    reference.load_state_dict(model.state_dict())
    saved = _by_hand(optimizer.state_dict(), torch.bfloat16)
    model.to(torch.bfloat16)  # the optimizer kept
    _train(model, optimizer, STEPS, first=BEFORE)
    reference.to(torch.bfloat16)
    restarted = sonar_kernels.SonarAdamW(reference.parameters(), **HYPER, **KINDS[kind], max_grad_norm=0.5)
    restarted.load_state_dict(saved)
    _train(reference, restarted, STEPS, first=BEFORE)
    _assert_equal(model, reference)
    for p in model.parameters():
        state = optimizer.state[p]
        assert state["exp_avg_codes" if "exp_avg_codes" in state else "exp_avg"].dtype in (
            torch.bfloat16,
            torch.int8,
        )
        assert float(state["step"]) == STEPS


def test_a_cast_after_training_started_equals_torch_adamw_with_its_state_converted_by_hand():
    model = Tiny()
    optimizer = sonar_kernels.SonarAdamW(model.parameters(), **HYPER)
    reference = Tiny()
    torch_adamw = torch.optim.AdamW(reference.parameters(), **HYPER, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnownedExpertsWarning)  # the reference trains the experts as dense
        _train(model, optimizer, BEFORE)
        _train(reference, torch_adamw, BEFORE)
        model.to(torch.bfloat16)
        reference.to(torch.bfloat16)
        for state in torch_adamw.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = state[key].to(torch.bfloat16)
        _train(model, optimizer, STEPS, first=BEFORE)
        _train(reference, torch_adamw, STEPS, first=BEFORE)
    _assert_equal(model, reference)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], torch_adamw.state[q][key])


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_cast_to_a_dtype_the_update_does_not_take_is_refused_before_the_state_changes(kind):
    # model.double() with the optimizer kept: refused at the next forward, naming the dtype, with the expert
    # state as it was (the moments not converted to float64 first); cast back, the run goes on as if the
    # cast had never happened (the reference: the same run without it).
    model = Tiny()
    optimizer = sonar_kernels.SonarAdamW(model.parameters(), **HYPER, **KINDS[kind])
    _train(model, optimizer, BEFORE)
    before = {
        id(p): {key: value.clone() for key, value in optimizer.state[p].items()}
        for p in model.experts.parameters()
    }
    model.double()
    with pytest.raises(TypeError, match=r"converted to torch\.float64 \(its optimizer state was not changed"):
        model(_batch(BEFORE, torch.float64))
    for p in model.experts.parameters():
        for key, value in before[id(p)].items():
            kept = optimizer.state[p][key]
            assert kept.dtype == value.dtype and torch.equal(kept, value), key
    model.float()
    _train(model, optimizer, STEPS, first=BEFORE)
    reference = Tiny()
    reference_optimizer = sonar_kernels.SonarAdamW(reference.parameters(), **HYPER, **KINDS[kind])
    _train(reference, reference_optimizer, STEPS)
    _assert_equal(model, reference)
