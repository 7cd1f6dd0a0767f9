"""Non-finite and overflowing gradients: the update is skipped, counted, and nothing becomes NaN or Inf.

The decision for an expert tensor is made before its update's launch (ops.triton_backend.wgrad); the expected
outcome here comes from the plain gradient the same kernels write without an optimizer, or from torch.
"""

import pytest
import torch
from test_expert_adamw import HYPER, _batch, _bits, _weights
from test_sonar_adamw import HYPER as SONAR_HYPER
from test_sonar_adamw import TinyMoE
from test_sonar_adamw import _batch as _sonar_batch

import sonar_kernels
from sonar_kernels import ops

NAN = float("nan")


def _state(optimizer, params):
    return [
        t.clone()
        for p in params
        for t in (
            p.detach(),
            optimizer.state[p]["exp_avg"],
            optimizer.state[p]["exp_avg_sq"],
            optimizer.state[p]["step"],
        )
    ]


def _assert_bits_equal(a, b, what):
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(_bits(x), _bits(y)), f"{what}: tensor {i} differs"


def _poisoned_batch(step, dtype, device, where):
    x, index, weights, grad_out = _batch(step, dtype, device)
    if where == "grad_out-nan":
        grad_out[3, 5] = NAN
    elif where == "grad_out-inf":
        grad_out[0, 0] = float("inf")
    elif where == "hidden_states-inf":
        x[7, 2] = -float("inf")
    return x, index, weights, grad_out


@pytest.mark.parametrize("fused_epilogue", [True, False], ids=["fused", "split"])
@pytest.mark.parametrize("where", ["grad_out-nan", "grad_out-inf", "hidden_states-inf"])
def test_non_finite_gradient_skips_both_updates_and_training_goes_on(where, fused_epilogue, device):
    dtype = torch.float32
    w1, w2 = _weights(dtype, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER, fused_epilogue=fused_epilogue)
    x, index, weights, grad_out = _batch(0, dtype, device)
    sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton").backward(grad_out)
    optimizer.step()
    before = _state(optimizer, (w1, w2))

    x, index, weights, grad_out = _poisoned_batch(1, dtype, device, where)
    sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton").backward(grad_out)
    _assert_bits_equal(_state(optimizer, (w1, w2)), before, "after the skipped update")
    assert int(optimizer.expert_skipped_updates()) == 2
    assert int(optimizer.expert_skipped_updates([w1])) == 1
    assert float(optimizer.expert_grad_norm([w2])) == float("inf")
    optimizer.step()
    assert w1.grad is None and w2.grad is None

    # The next step updates again, as if the poisoned batch had not been there.
    x, index, weights, grad_out = _batch(2, dtype, device)
    sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton").backward(grad_out)
    optimizer.step()
    a1, a2 = _weights(dtype, device)
    clean = sonar_kernels.ExpertAdamW([a1, a2], **HYPER, fused_epilogue=fused_epilogue)
    for step in (0, 2):
        x, index, weights, grad_out = _batch(step, dtype, device)
        sonar_kernels.moe_mlp(x, index, weights, a1, a2, backend="triton").backward(grad_out)
        clean.step()
    _assert_bits_equal(_state(optimizer, (w1, w2)), _state(clean, (a1, a2)), "the step after the skip")
    assert float(optimizer.state[w1]["step"]) == 2.0
    assert all(torch.isfinite(t).all() for t in _state(optimizer, (w1, w2)))


def _fp16_case(device, grad_scale, w2_scale=1.0):
    """fp16 expert weights, and a batch whose dO is scaled by ``grad_scale`` (W2 by ``w2_scale``)."""
    w1, w2 = _weights(torch.float16, device)
    with torch.no_grad():
        w2.mul_(w2_scale)
    x, index, weights, grad_out = _batch(0, torch.float16, device)
    return w1, w2, (x, index, weights, (grad_out.float() * grad_scale).half())


def _plain_grads(w1, w2, batch):
    x, index, weights, grad_out = batch
    a, b = w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
    out = sonar_kernels.moe_mlp(x, index, weights, a, b, backend="triton")
    return torch.autograd.grad(out, [a, b], grad_out)


def _one_update(w1, w2, batch, **options):
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER, **options)
    x, index, weights, grad_out = batch
    sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton").backward(grad_out)
    return optimizer


@pytest.mark.parametrize("fused_epilogue", [True, False], ids=["fused", "split"])
def test_overflow_when_rounding_the_gradient_skips_only_that_tensor(fused_epilogue, device):
    # fp16 weights with fp32 moments: the fp32 wgrad of W2 is finite but beyond fp16's 65504, so it
    # rounds to inf; W2 scaled down keeps dHpre, and so dW1, small.
    w1, w2, batch = _fp16_case(device, grad_scale=1.5e4, w2_scale=1e-3)
    g1, g2 = _plain_grads(w1, w2, batch)
    assert torch.isfinite(g1).all() and not torch.isfinite(g2).all()  # the case is what it claims
    before = [w1.detach().clone(), w2.detach().clone()]
    optimizer = _one_update(w1, w2, batch, moments_dtype=torch.float32, fused_epilogue=fused_epilogue)
    assert torch.equal(w2.detach(), before[1])
    assert float(optimizer.state[w2]["step"]) == 0.0
    assert not optimizer.state[w2]["exp_avg"].any() and not optimizer.state[w2]["exp_avg_sq"].any()
    assert not torch.equal(w1.detach(), before[0])
    assert float(optimizer.state[w1]["step"]) == 1.0
    assert int(optimizer.expert_skipped_updates([w2])) == 1
    assert int(optimizer.expert_skipped_updates([w1])) == 0
    assert all(torch.isfinite(t).all() for t in _state(optimizer, (w1, w2)))


def test_gradient_beyond_the_moments_limit_is_skipped(device):
    # fp16 moments: g * g must fit fp16, so an entry above ops.grad_limit(fp16) = 128 skips the update.
    assert ops.grad_limit(torch.float16) == 128.0
    assert ops.grad_limit(torch.bfloat16) == ops.grad_limit(torch.float32) == 2.0**63
    w1, w2, batch = _fp16_case(device, grad_scale=200.0)
    g1, g2 = _plain_grads(w1, w2, batch)
    assert torch.isfinite(g2).all() and g2.abs().max() > 128  # finite, but g * g overflows fp16
    results = []
    for fused_epilogue in (True, False):
        a1, a2 = (torch.nn.Parameter(p.detach().clone()) for p in (w1, w2))
        optimizer = _one_update(a1, a2, batch, fused_epilogue=fused_epilogue)
        expected = [int(not (g.abs().max() <= 128)) for g in (g1, g2)]
        got = [int(optimizer.expert_skipped_updates([p])) for p in (a1, a2)]
        assert got == expected
        results.append(_state(optimizer, (a1, a2)))
    _assert_bits_equal(results[0], results[1], "fused vs split")


def test_precheck_that_fires_on_a_finite_gradient_changes_no_bit(device, monkeypatch):
    # fp16 moments (limit 128): the cheap bound n * max|P| * max|Q| exceeds the limit, every entry is
    # below it; the exact check pass runs and the update equals the split path's.
    w1, w2, batch = _fp16_case(device, grad_scale=4.0)
    g1, g2 = _plain_grads(w1, w2, batch)
    assert max(float(g1.abs().max()), float(g2.abs().max())) <= 128
    fired = []
    original = (
        ops.triton_backend.wgrad.overflow_flag
    )  # the update's flag (ops/triton_backend/update_bound.py)

    def spy(*args):
        flag = original(*args)
        fired.append(float(flag))
        return flag

    monkeypatch.setattr(ops.triton_backend.wgrad, "overflow_flag", spy)
    a1, a2 = (torch.nn.Parameter(p.detach().clone()) for p in (w1, w2))
    fused = _one_update(a1, a2, batch)
    assert fired == [1.0, 1.0]
    b1, b2 = (torch.nn.Parameter(p.detach().clone()) for p in (w1, w2))
    split = _one_update(b1, b2, batch, fused_epilogue=False)
    assert int(fused.expert_skipped_updates()) == 0
    _assert_bits_equal(_state(fused, (a1, a2)), _state(split, (b1, b2)), "fused vs split")
    assert float(fused.state[a1]["step"]) == 1.0


def test_non_finite_micro_batch_skips_the_accumulated_update(device):
    dtype = torch.float32
    w1, w2 = _weights(dtype, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER, accumulation_steps=2)
    before = _state(optimizer, (w1, w2))
    for step, where in ((0, "grad_out-inf"), (1, None)):
        x, index, weights, grad_out = _poisoned_batch(step, dtype, device, where)
        sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton").backward(grad_out)
    _assert_bits_equal(_state(optimizer, (w1, w2)), before, "after the skipped accumulated update")
    assert int(optimizer.expert_skipped_updates()) == 2
    assert w1.grad is None and w2.grad is None
    optimizer.step()


def _filled(gradient, value: float):
    """The torch backend's gradient of an expert tensor, every entry of it replaced by ``value`` (whole or
    chunk by chunk, as the update asks for it)."""

    class Filled(ops.torch_backend.expert_gradient.ExpertGradient):
        def compute(self, first, last, out):
            return super().compute(first, last, out).fill_(value)

        def full(self):
            return super().full().fill_(value)

    filled = Filled.__new__(Filled)
    filled.__dict__.update(gradient.__dict__)
    return filled


@pytest.mark.parametrize(
    "flags", [{"foreach": False}, {"foreach": True}, {"fused": True}], ids=["for-loop", "foreach", "fused"]
)
@pytest.mark.parametrize("where", ["dense", "experts"])
def test_sonar_adamw_skips_non_finite_updates_on_the_torch_backend(where, flags, monkeypatch):
    model = TinyMoE("torch")
    optimizer = sonar_kernels.SonarAdamW(model, **SONAR_HYPER, max_grad_norm=0.5, **flags)
    x, y = _sonar_batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    states = {
        name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()
    }

    x, y = _sonar_batch(1)
    if where == "experts":
        # A NaN gradient of down_proj only (the torch backend's wgrad): the other updates still run.
        original = ops.torch_backend.wgrad.expert_gradient

        def nan_down_proj_grad(name, *args, **kwargs):
            # The update computes a NaN gradient in place of the wgrad's.
            gradient = original(name, *args, **kwargs)
            return _filled(gradient, NAN) if name == "down_proj" else gradient

        with monkeypatch.context() as patch:
            patch.setattr(ops.torch_backend.wgrad, "expert_gradient", nan_down_proj_grad)
            torch.nn.functional.mse_loss(model(x), y).backward()
    else:
        torch.nn.functional.mse_loss(model(x), y).backward()
        model.head.bias.grad[0] = float("inf")
    optimizer.step()
    for name, p in model.named_parameters():
        skipped = name == "experts.down_proj" if where == "experts" else not name.startswith("experts.")
        assert torch.equal(p.detach(), before[name]) == skipped, name
        for key, value in optimizer.state[p].items():
            assert torch.isfinite(value).all(), (name, key)
            if skipped:
                assert torch.equal(value, states[name][key]), (name, key)
    assert int(optimizer.dense_skipped_steps) == (where == "dense")
    assert int(optimizer.expert_skipped_updates()) == (where == "experts")


def test_sonar_adamw_dense_skip_then_training_equals_torch_adamw_without_that_dense_step():
    sonar_model, torch_model = TinyMoE("torch"), TinyMoE("torch")
    torch_model.load_state_dict(sonar_model.state_dict())
    sonar = sonar_kernels.SonarAdamW(sonar_model, **SONAR_HYPER, max_grad_norm=0.5)
    dense = [p for name, p in torch_model.named_parameters() if not name.startswith("experts.")]
    # Fused: SonarAdamW's default flags run torch's fused AdamW on the CPU.
    standard_dense = torch.optim.AdamW(dense, **SONAR_HYPER, fused=True)
    standard_experts = torch.optim.AdamW(torch_model.experts.parameters(), **SONAR_HYPER, fused=True)
    for step in range(4):
        x, y = _sonar_batch(step)
        torch.nn.functional.mse_loss(sonar_model(x), y).backward()
        if step == 2:
            sonar_model.embed.weight.grad[0, 0] = NAN
        sonar.step()
        sonar.zero_grad()
        torch.nn.functional.mse_loss(torch_model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(dense, 0.5)
        standard_experts.step()  # the expert gradients of step 2 were finite: updated in that backward
        if step != 2:
            standard_dense.step()
        torch_model.zero_grad()
    _assert_same_parameters(sonar_model, torch_model)
    assert int(sonar.dense_skipped_steps) == 1


def _assert_same_parameters(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_clipping_by_the_true_global_norm_skips_the_dense_update_when_an_expert_update_was_skipped(
    monkeypatch,
):
    model = TinyMoE("torch")
    optimizer = sonar_kernels.SonarAdamW(
        model, **SONAR_HYPER, max_grad_norm=0.5, clip_norm_includes_experts=True
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    original = ops.torch_backend.wgrad.expert_gradient

    def inf_gate_up_proj_grad(name, *args, **kwargs):
        # An infinite gradient of gate_up_proj (the torch backend's wgrad), given to its update.
        gradient = original(name, *args, **kwargs)
        return _filled(gradient, float("inf")) if name == "gate_up_proj" else gradient

    monkeypatch.setattr(ops.torch_backend.wgrad, "expert_gradient", inf_gate_up_proj_grad)
    x, y = _sonar_batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    monkeypatch.undo()
    optimizer.step()
    assert float(optimizer.last_grad_norm) == float("inf")
    assert int(optimizer.dense_skipped_steps) == 1
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]) == (name != "experts.down_proj"), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_precheck_does_not_fire_on_ordinary_gradients(dtype, device, monkeypatch):
    # The check pass would double the wgrad's cost: on ordinary data the bound must rule it out.
    fired = []
    original = (
        ops.triton_backend.wgrad.overflow_flag
    )  # the update's flag (ops/triton_backend/update_bound.py)
    monkeypatch.setattr(
        ops.triton_backend.wgrad,
        "overflow_flag",
        lambda *args: fired.append(float(original(*args))) or original(*args),
    )
    w1, w2 = _weights(dtype, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER, moments_dtype=torch.float32)
    for step in range(2):
        x, index, weights, grad_out = _batch(step, dtype, device)
        sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton").backward(grad_out)
        optimizer.step()
    assert fired == [0.0] * 4


@pytest.mark.parametrize("flags", [{"foreach": False}, {"fused": True}], ids=["for-loop", "fused"])
def test_dense_entry_beyond_the_limit_skips_without_clipping(flags):
    model = TinyMoE("torch")
    optimizer = sonar_kernels.SonarAdamW(model, **SONAR_HYPER, **flags)  # no max_grad_norm: no norm
    x, y = _sonar_batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    model.embed.bias.grad[1] = 2.0**70  # finite, but its square overflows the fp32 exp_avg_sq
    before = {name: p.detach().clone() for name, p in model.named_parameters()}  # experts: already updated
    optimizer.step()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
        assert all(torch.isfinite(v).all() for v in optimizer.state[p].values()), name
    assert int(optimizer.dense_skipped_steps) == 1


def test_non_finite_micro_batch_in_a_float32_buffer_skips_the_update(device):
    w1, w2 = _weights(torch.bfloat16, device)
    optimizer = sonar_kernels.ExpertAdamW(
        [w1, w2], **HYPER, grad_dtype=torch.float32, moments_dtype=torch.float32, accumulation_steps=2
    )
    before = _state(optimizer, (w1, w2))
    for step, where in ((0, "grad_out-nan"), (1, None)):
        x, index, weights, grad_out = _poisoned_batch(step, torch.bfloat16, device, where)
        sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton").backward(grad_out)
    _assert_bits_equal(_state(optimizer, (w1, w2)), before, "after the skipped accumulated update")
    assert int(optimizer.expert_skipped_updates()) == 2
    assert not optimizer._record.micro_batches.buffers


@pytest.mark.parametrize("where", ["dX", "dW1"])
def test_a_failed_backward_leaves_no_unwritten_accumulation_buffer(where, device, monkeypatch):
    w1, w2 = _weights(torch.bfloat16, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER, grad_dtype=torch.float32, accumulation_steps=2)
    if where == "dX":  # the layer's core, before any wgrad

        def failing(*args):
            raise RuntimeError("dX failed")

        monkeypatch.setattr(ops.triton_backend.backward, "_dx", failing)
    else:  # after dW2's launch, before dW1's
        original = ops.triton_backend.wgrad.expert_wgrad

        def failing(name, *args, **kwargs):
            if name == "gate_up_proj":
                raise RuntimeError("dW1 failed")
            return original(name, *args, **kwargs)

        monkeypatch.setattr(ops.triton_backend.wgrad, "expert_wgrad", failing)
    x, index, weights, grad_out = _batch(0, torch.bfloat16, device)
    x.requires_grad_()  # so that dX is computed
    with pytest.raises(RuntimeError, match=f"{where} failed"):
        sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton").backward(grad_out)
    assert w1 not in optimizer._record.micro_batches.buffers and (
        w2 in optimizer._record.micro_batches.buffers
    ) == (where == "dW1")
    before = w1.detach().clone()
    optimizer.step()  # applies W2's window cut short, if it was written; W1 has nothing to apply
    assert torch.equal(w1.detach(), before) and float(optimizer.state[w1]["step"]) == 0.0
    assert float(optimizer.state[w2]["step"]) == (1.0 if where == "dW1" else 0.0)
