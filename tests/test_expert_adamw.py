"""ExpertAdamW: the AdamW update applied in the backward, against torch.optim.AdamW and the split path."""

import math

import numpy as np
import pytest
import torch
from cases import Case
from numerics import assert_close, rel_err
from torch.utils.checkpoint import checkpoint

import sonar_kernels
from sonar_kernels import ops, reference

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
E, H, I, TOP_K, T = 4, 33, 17, 2, 24


def _batch(step, dtype, device):
    """Random data for one step; expert E - 1 gets tokens in steps 0 and 1 and none in step 2."""
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(T, H, generator=generator).to(dtype)
    scores = torch.rand(T, E, generator=generator)
    if step >= 2:
        scores[:, E - 1] = -1.0
    index = scores.topk(TOP_K, dim=1).indices
    weights = torch.softmax(torch.randn(T, TOP_K, generator=generator), dim=1).to(dtype)
    grad_out = torch.randn(T, H, generator=generator).to(dtype)
    return x.to(device), index.to(device), weights.to(device), grad_out.to(device)


def _weights(dtype, device):
    generator = torch.Generator().manual_seed(7)
    w1 = (torch.randn(E, 2 * I, H, generator=generator) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=generator) / I**0.5).to(dtype)
    return torch.nn.Parameter(w1.to(device)), torch.nn.Parameter(w2.to(device))


def _backward(step, w1, w2, dtype, device, **kwargs):
    x, index, weights, grad_out = _batch(step, dtype, device)
    sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton", **kwargs).backward(grad_out)


def _plain_grads(step, w1, w2, dtype, device):
    """dW1, dW2 of the same kernels without an optimizer (what the split path writes), at these weights."""
    x, index, weights, grad_out = _batch(step, dtype, device)
    a, b = w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
    out = sonar_kernels.moe_mlp(x, index, weights, a, b, backend="triton")
    return torch.autograd.grad(out, [a, b], grad_out)


def _torch_adamw_step(param, state, grad, hyper=HYPER):
    """torch.optim.AdamW (fused) from a copy of ``param`` and ``state``, fed ``grad``."""
    q = torch.nn.Parameter(param.detach().clone())
    optimizer = torch.optim.AdamW([q], fused=True, **hyper)
    optimizer.state[q] = {
        "step": state["step"].detach().clone(),
        "exp_avg": state["exp_avg"].clone(),
        "exp_avg_sq": state["exp_avg_sq"].clone(),
    }
    q.grad = grad.to(q.dtype)
    optimizer.step()
    return q.detach(), optimizer.state[q]["exp_avg"], optimizer.state[q]["exp_avg_sq"]


# torch's CPU AdamW and docs/design.md's arithmetic (torch's fused CUDA kernel) round differently: the decay
# as p * fp32(1 - lr * wd) vs p - lr * wd * p in fp64, the update as step_size * (m / denom) vs
# (step_size * m) / denom, and the bias corrections in fp64 vs fp32. Each rounding is within half an ulp;
# exp_avg and exp_avg_sq go through two of them, W through up to six (measured worst: 3).
ULP_BOUND = {"W": 3.0, "exp_avg": 2.0, "exp_avg_sq": 2.0}


def _ulps(actual, expected, scale):
    """Elementwise |actual - expected| in units in the last place of ``expected``'s dtype at ``scale``."""
    tiny = torch.finfo(expected.dtype).tiny
    _, exponent = torch.frexp(scale.detach().abs().float().clamp_min(tiny))
    mantissa_bits = round(-math.log2(torch.finfo(expected.dtype).eps))
    ulp = torch.ldexp(torch.ones_like(scale, dtype=torch.float32), exponent - 1 - mantissa_bits)
    return (actual.double() - expected.double()).abs() / ulp.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_three_steps_match_torch_adamw_fed_the_split_path_gradient(dtype, device):
    w1, w2 = _weights(dtype, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER)
    for step in range(3):
        grads = _plain_grads(step, w1, w2, dtype, device)
        expected = [_torch_adamw_step(p, optimizer.state[p], g) for p, g in zip((w1, w2), grads, strict=True)]
        before = [(p.detach().clone(), optimizer.state[p]["exp_avg"].clone()) for p in (w1, w2)]
        _backward(step, w1, w2, dtype, device)
        assert w1.grad is None and w2.grad is None
        optimizer.step()
        optimizer.zero_grad()
        for p, g, (p_old, m_old), (p_ref, m_ref, v_ref) in zip(
            (w1, w2), grads, before, expected, strict=True
        ):
            state = optimizer.state[p]
            assert float(state["step"]) == step + 1
            got = (p.detach(), state["exp_avg"], state["exp_avg_sq"])
            if dtype == torch.float32:
                # ulps at the magnitude of the operands: a result that cancels to ~0 keeps their ulp.
                # The update of W scales with exp_avg's operands, which cancel too.
                beta1, beta2 = HYPER["betas"]
                scale_m = torch.maximum(
                    torch.maximum(m_old.abs() * beta1, g.abs() * (1 - beta1)), m_ref.abs()
                )
                count = step + 1
                denom = v_ref.sqrt() / math.sqrt(1 - beta2**count) + HYPER["eps"]
                scale_update = HYPER["lr"] / (1 - beta1**count) * scale_m / denom
                scales = (
                    torch.maximum(torch.maximum(p_old.abs(), p_ref.abs()), scale_update),
                    scale_m,
                    v_ref,
                )
                for name, a, b, scale in zip(
                    ("W", "exp_avg", "exp_avg_sq"), got, (p_ref, m_ref, v_ref), scales, strict=True
                ):
                    worst = float(_ulps(a, b, scale).max())
                    assert worst <= ULP_BOUND[name], (
                        f"step {step}: {name} differs from torch.optim.AdamW by {worst:.2f} ulp"
                    )
            else:
                for name, a, b in zip(
                    ("W", "exp_avg", "exp_avg_sq"), got, (p_ref, m_ref, v_ref), strict=True
                ):
                    assert_close(a, b, dtype, what=f"step {step}: {name}")
    # Expert E - 1 got no token in the last step: still decayed and moved by its moments.
    assert optimizer.state[w1]["exp_avg"][E - 1].abs().sum() > 0


def test_three_steps_match_torch_adamw_fed_float64_reference_gradients(device):
    w1, w2 = _weights(torch.float32, device)
    q1, q2 = (torch.nn.Parameter(p.detach().clone()) for p in (w1, w2))
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER)
    reference_optimizer = torch.optim.AdamW([q1, q2], foreach=False, **HYPER)
    for step in range(3):
        _backward(step, w1, w2, torch.float32, device)
        optimizer.step()
        x, index, weights, grad_out = _batch(step, torch.float64, device)
        a, b = q1.detach().double().requires_grad_(), q2.detach().double().requires_grad_()
        out = reference.moe_mlp(x, index, weights, a, b)
        q1.grad, q2.grad = (g.float() for g in torch.autograd.grad(out, [a, b], grad_out))
        reference_optimizer.step()
    for p, q in ((w1, q1), (w2, q2)):
        assert rel_err(p, q) <= 2e-5
        for key in ("exp_avg", "exp_avg_sq"):
            err = rel_err(optimizer.state[p][key], reference_optimizer.state[q][key])
            assert err <= 2e-5, f"{key}: {err:.2e}"


FUSED_VS_SPLIT = [
    pytest.param(torch.float32, None, None, id="fp32"),
    pytest.param(torch.bfloat16, None, None, id="bf16"),
    pytest.param(torch.bfloat16, torch.float32, None, id="bf16-fp32-moments"),
    pytest.param(torch.bfloat16, torch.float32, torch.float32, id="bf16-fp32-moments-fp32-grad"),
]


def _run(dtype, device, steps=3, **options):
    w1, w2 = _weights(dtype, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER, **options)
    for step in range(steps):
        _backward(step, w1, w2, dtype, device)
        optimizer.step()
    return [
        t.clone()
        for p in (w1, w2)
        for t in (p.detach(), optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])
    ]


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize(("dtype", "moments_dtype", "grad_dtype"), FUSED_VS_SPLIT)
def test_fused_and_split_paths_give_identical_bits(dtype, moments_dtype, grad_dtype, device):
    options = {"moments_dtype": moments_dtype, "grad_dtype": grad_dtype}
    fused = _run(dtype, device, **options)
    split = _run(dtype, device, fused_epilogue=False, **options)
    again = _run(dtype, device, **options)
    assert fused[1].dtype == (moments_dtype or dtype)
    for a, b, c in zip(fused, split, again, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        assert torch.equal(_bits(a), _bits(c))


def test_fp32_gradient_option_changes_the_update(device):
    # grad_dtype=float32 keeps the fp32 accumulator; the default rounds it to bf16 first.
    default = _run(torch.bfloat16, device, steps=1, moments_dtype=torch.float32)
    fp32_grad = _run(torch.bfloat16, device, steps=1, moments_dtype=torch.float32, grad_dtype=torch.float32)
    assert not torch.equal(default[1], fp32_grad[1])
    assert rel_err(default[1], fp32_grad[1]) < 2.0**-8


def test_hyperparameters_are_read_from_param_groups_when_backward_runs(device):
    w1, w2 = _weights(torch.float32, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5 if epoch >= 1 else 1.0)
    _backward(0, w1, w2, torch.float32, device)
    optimizer.step()
    scheduler.step()
    # load_state_dict replaces the group dicts: the new ones must be the ones read.
    optimizer.load_state_dict(optimizer.state_dict())
    group = optimizer.param_groups[0]
    assert group["lr"] == HYPER["lr"] * 0.5
    group.update(betas=(0.8, 0.9), eps=1e-6, weight_decay=0.5)
    changed = {"lr": group["lr"], "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.5}
    grads = _plain_grads(1, w1, w2, torch.float32, device)
    expected = [
        _torch_adamw_step(p, optimizer.state[p], g, changed)[0] for p, g in zip((w1, w2), grads, strict=True)
    ]
    unchanged = [_torch_adamw_step(p, optimizer.state[p], g)[0] for p, g in zip((w1, w2), grads, strict=True)]
    _backward(1, w1, w2, torch.float32, device)
    for p, e, u in zip((w1, w2), expected, unchanged, strict=True):
        assert rel_err(p, e) <= 1e-6
        assert rel_err(p, u) > 1e-4  # the change is visible


def test_state_layout_is_torch_adamws(device):
    w1, w2 = _weights(torch.bfloat16, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2])
    for p in (w1, w2):
        state = optimizer.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert state["step"].dim() == 0 and state["step"].dtype == torch.float32
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert state["exp_avg"].shape == p.shape
    fp32 = sonar_kernels.ExpertAdamW([torch.nn.Parameter(w1.detach().clone())], moments_dtype=torch.float32)
    assert next(iter(fp32.state.values()))["exp_avg"].dtype == torch.float32
    # torch.optim.AdamW's state_dict loads, and the moments keep their dtype.
    assert set(torch.optim.AdamW([w1]).state_dict()["param_groups"][0]) >= {
        "lr",
        "betas",
        "eps",
        "weight_decay",
    }


def test_step_and_zero_grad_never_update_twice(device):
    w1, w2 = _weights(torch.float32, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER)
    _backward(0, w1, w2, torch.float32, device)
    after_backward = w1.detach().clone()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.step()
    assert torch.equal(w1.detach(), after_backward)
    assert float(optimizer.state[w1]["step"]) == 1


def test_second_backward_before_step_raises_and_writes_nothing(device):
    w1, w2 = _weights(torch.float32, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER)
    _backward(0, w1, w2, torch.float32, device)
    snapshot = [
        w1.detach().clone(),
        optimizer.state[w1]["exp_avg"].clone(),
        optimizer.state[w1]["step"].clone(),
    ]
    with pytest.raises(RuntimeError, match="already updated"):
        _backward(1, w1, w2, torch.float32, device)
    now = [w1.detach(), optimizer.state[w1]["exp_avg"], optimizer.state[w1]["step"]]
    assert all(torch.equal(a, b) for a, b in zip(snapshot, now, strict=True))


def test_frozen_experts_are_neither_updated_nor_given_a_gradient(device):
    w1, w2 = _weights(torch.float32, device)
    w1.requires_grad_(False)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER)
    before = w1.detach().clone()
    _backward(0, w1, w2, torch.float32, device)
    assert torch.equal(w1, before) and w1.grad is None
    assert float(optimizer.state[w1]["step"]) == 0
    assert float(optimizer.state[w2]["step"]) == 1 and w2.grad is None


def test_stale_saved_weights_fail_loudly_after_the_update(device):
    w1, w2 = _weights(torch.float32, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER)  # noqa: F841
    other = (w1 * w1).sum()  # saves w1
    _backward(0, w1, w2, torch.float32, device)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        other.backward()


def test_two_live_graphs_over_the_same_experts_raise(device):
    w1, w2 = _weights(torch.float32, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER)
    x, index, weights, grad_out = _batch(0, torch.float32, device)
    before = w1.detach().clone()
    out = sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton")
    out = out + sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton")
    with pytest.raises(RuntimeError, match="other live autograd graph"):
        out.backward(grad_out)
    assert torch.equal(w1.detach(), before)
    del out
    # Once those graphs are gone, one forward and one backward work again.
    _backward(0, w1, w2, torch.float32, device)
    assert float(optimizer.state[w1]["step"]) == 1


def test_discarded_graph_does_not_trip_the_guard(device):
    w1, w2 = _weights(torch.float32, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER)
    x, index, weights, _ = _batch(0, torch.float32, device)
    sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton")  # graph dropped at once
    _backward(0, w1, w2, torch.float32, device)
    assert float(optimizer.state[w1]["step"]) == 1


def test_non_reentrant_checkpointing_updates_once_with_the_same_bits(device):
    results = []
    for use_checkpoint in (False, True):
        w1, w2 = _weights(torch.float32, device)
        optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER)
        for step in range(2):
            x, index, weights, grad_out = _batch(step, torch.float32, device)

            def layer(x, w1=w1, w2=w2, index=index, weights=weights):
                return sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton")

            x.requires_grad_()
            out = checkpoint(layer, x, use_reentrant=False) if use_checkpoint else layer(x)
            out.backward(grad_out)
            optimizer.step()
        assert float(optimizer.state[w1]["step"]) == 2
        results.append((w1.detach().clone(), w2.detach().clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize(
    ("group_flags", "torch_flags"),
    # By default torch's fused AdamW (on the CPU as on CUDA); a group's own flag keeps torch's meaning.
    [({}, {"fused": True}), ({"fused": False}, {"fused": False}), ({"foreach": True}, {"foreach": True})],
    ids=["default-fused", "for-loop", "foreach"],
)
def test_torch_backend_updates_in_backward_with_torchs_adamw(group_flags, torch_flags):
    # backend="torch": the gradient of the whole batched tensor is applied through torch's AdamW as soon
    # as it is accumulated, then released (the paper's method).
    experts = sonar_kernels.SonarExperts(E, H, I, backend="torch")
    twin = sonar_kernels.SonarExperts(E, H, I, backend="torch")
    twin.load_state_dict(experts.state_dict())
    optimizer = sonar_kernels.ExpertAdamW([{"params": list(experts.parameters()), **group_flags}], **HYPER)
    reference_optimizer = torch.optim.AdamW(twin.parameters(), **torch_flags, **HYPER)
    for step in range(2):
        x, index, weights, grad_out = _batch(step, torch.float32, "cpu")
        experts(x, index, weights).backward(grad_out)
        assert experts.gate_up_proj.grad is None and experts.down_proj.grad is None
        optimizer.step()
        twin(x, index, weights).backward(grad_out)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    for a, b in zip(experts.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fp32_weights_under_bf16_autocast(device):
    results = {}
    for fused in (True, False):
        w1, w2 = _weights(torch.float32, device)
        optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER, fused_epilogue=fused)
        x, index, weights, grad_out = _batch(0, torch.float32, device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            out = sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton")
        assert out.dtype == torch.bfloat16
        out.backward(grad_out.bfloat16())
        assert w1.dtype == torch.float32 and w1.grad is None
        assert optimizer.state[w1]["exp_avg"].dtype == torch.float32
        results[fused] = (w1.detach().clone(), w2.detach().clone())
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False], strict=True))
    # Against the plain gradient of the same bf16 compute (fp32 weights) fed to torch.optim.AdamW.
    q1, q2 = _weights(torch.float32, device)
    reference_optimizer = torch.optim.AdamW([q1, q2], foreach=False, **HYPER)
    x, index, weights, grad_out = _batch(0, torch.float32, device)
    out = sonar_kernels.moe_mlp(x.bfloat16(), index, weights, q1, q2, backend="triton")
    out.backward(grad_out.bfloat16())
    reference_optimizer.step()
    assert rel_err(results[True][0], q1) <= 1e-6
    assert rel_err(results[True][1], q2) <= 1e-6


BAD_OPTIONS = [
    pytest.param({"lr": -1.0}, ValueError, "lr", id="lr"),
    pytest.param({"betas": (0.9, 1.0)}, ValueError, "betas", id="beta2"),
    pytest.param({"betas": (0.9,)}, ValueError, "betas", id="betas-shape"),
    pytest.param({"eps": -1e-8}, ValueError, "eps", id="eps"),
    pytest.param({"weight_decay": -0.1}, ValueError, "weight_decay", id="weight_decay"),
    pytest.param({"moments_dtype": torch.float64}, TypeError, "moments_dtype", id="moments_dtype"),
    pytest.param({"grad_dtype": torch.int32}, TypeError, "grad_dtype", id="grad_dtype"),
]


@pytest.mark.parametrize(("options", "error", "words"), BAD_OPTIONS)
def test_bad_options_are_refused(options, error, words):
    with pytest.raises(error, match=words):
        sonar_kernels.ExpertAdamW([torch.nn.Parameter(torch.zeros(2, 4, 4))], **options)


def test_bad_tensors_are_refused():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        sonar_kernels.ExpertAdamW([torch.nn.Parameter(torch.zeros(2, 4, 4, dtype=torch.float64))])
    with pytest.raises(ValueError, match="dense"):
        sonar_kernels.ExpertAdamW([torch.zeros(2, 4, 8)[..., ::2]])


def test_mismatched_moments_are_refused_before_any_kernel(device):
    x, index, weights, w1, w2 = Case(20, 32, 16, 4, 2).make(torch.float32, device=device)
    w1.requires_grad_()
    out, hpre, meta = ops.moe_mlp_fwd(x, index, weights, w1, w2, "silu")
    update = ops.AdamWUpdate(
        exp_avg=torch.zeros_like(w1), exp_avg_sq=torch.zeros(4, 16, 32, device=device),
        step=torch.zeros((), device=device),
        hyper=torch.tensor([1e-3, 0.9, 0.999, 1e-8, 0.0], dtype=torch.float64, device=device),
        grad_dtype=torch.float32,
    )  # fmt: skip
    before = w1.detach().clone()
    with pytest.raises(ValueError, match="exp_avg_sq of gate_up_proj"):
        ops.moe_mlp_bwd(
            torch.ones_like(out), x, weights, w1, w2, hpre, meta, "silu", (True, True, True, True),
            gate_up_proj_update=update,
        )  # fmt: skip
    assert torch.equal(w1.detach(), before) and float(update.step) == 0


def test_several_wgrad_tiles_per_expert_fused_equals_split_and_torch(device):
    # H = 136 and 2I = 140: several row and column tiles of the wgrad kernels per expert.
    x, index, weights, w1, w2 = Case(12, 136, 70, 3, 2).make(torch.float32, device=device)
    grad_out = torch.randn(12, 136).to(device)
    results = []
    for fused in (True, False):
        p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
        optimizer = sonar_kernels.ExpertAdamW([p1, p2], **HYPER, fused_epilogue=fused)
        sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend="triton").backward(grad_out)
        optimizer.step()
        results.append((p1.detach().clone(), p2.detach().clone(), optimizer.state[p1]["exp_avg"].clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    q1, q2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    reference_optimizer = torch.optim.AdamW([q1, q2], foreach=False, **HYPER)
    a, b = w1.double().requires_grad_(), w2.double().requires_grad_()
    out = reference.moe_mlp(x.double(), index, weights.double(), a, b)
    q1.grad, q2.grad = (g.float() for g in torch.autograd.grad(out, [a, b], grad_out.double()))
    reference_optimizer.step()
    assert rel_err(results[0][0], q1) <= 2e-5 and rel_err(results[0][1], q2) <= 2e-5


def test_a_failure_before_the_updates_changes_nothing_and_the_graph_can_run_again(device, monkeypatch):
    w1, w2 = _weights(torch.float32, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER)
    before = [w1.detach().clone(), w2.detach().clone()]
    x, index, weights, grad_out = _batch(0, torch.float32, device)
    x.requires_grad_()
    out = sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton")

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    # dX fails: the updates wait for the weights' whole gradients (after dX), so none ran.
    with monkeypatch.context() as patch:
        patch.setattr(ops.triton_backend.backward, "_dx", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            out.backward(grad_out, retain_graph=True)
    assert all(float(optimizer.state[w]["step"]) == 0 for w in (w1, w2))
    assert torch.equal(w1, before[0]) and torch.equal(w2, before[1])
    # The graph runs again and updates each weight once, as a first backward would.
    out.backward(grad_out)
    assert all(float(optimizer.state[w]["step"]) == 1 for w in (w1, w2))
    q1, q2 = (torch.nn.Parameter(w.clone()) for w in before)
    _owner = sonar_kernels.ExpertAdamW([q1, q2], **HYPER)  # alive until the backward ran
    sonar_kernels.moe_mlp(x, index, weights, q1, q2, backend="triton").backward(grad_out)
    assert torch.equal(w1, q1) and torch.equal(w2, q2)


def test_a_failure_after_the_first_update_leaves_it_recorded(device, monkeypatch):
    w1, w2 = _weights(torch.float32, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER)
    x, index, weights, grad_out = _batch(0, torch.float32, device)
    x.requires_grad_()
    out = sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="triton")
    original = ops.triton_backend.wgrad._wgrad

    def fail_second(*args, **kwargs):
        if kwargs["name"] == "down_proj" and args[7] is not None:  # W2's update
            raise torch.OutOfMemoryError("simulated")
        return original(*args, **kwargs)

    # gate_up_proj is updated first, then down_proj's launch fails: W1's update stands and is recorded,
    # W2 is untouched.
    with monkeypatch.context() as patch:
        patch.setattr(ops.triton_backend.wgrad, "_wgrad", fail_second)
        with pytest.raises(torch.OutOfMemoryError):
            out.backward(grad_out, retain_graph=True)
    assert float(optimizer.state[w1]["step"]) == 1 and float(optimizer.state[w2]["step"]) == 0
    # Retrying that graph fails loudly (W1 changed since the forward) instead of updating twice.
    with pytest.raises(RuntimeError, match="changed after the forward of this graph"):
        out.backward(grad_out)
    assert float(optimizer.state[w1]["step"]) == 1


def test_param_groups_from_generators(device):
    experts = sonar_kernels.SonarExperts(E, H, I, backend="triton", device=device)
    optimizer = sonar_kernels.ExpertAdamW([experts.gate_up_proj], **HYPER)
    optimizer.add_param_group({"params": (p for p in [experts.down_proj]), "lr": 1e-3})
    assert [len(g["params"]) for g in optimizer.param_groups] == [1, 1]
    x, index, weights, grad_out = _batch(0, torch.float32, device)
    experts(x, index, weights).backward(grad_out)
    assert float(optimizer.state[experts.down_proj]["step"]) == 1


def test_requires_grad_turned_on_later_is_updated_once_at_step():
    experts = sonar_kernels.SonarExperts(E, H, I, backend="torch")
    experts.down_proj.requires_grad_(False)
    optimizer = sonar_kernels.ExpertAdamW(experts.parameters(), **HYPER)
    experts.down_proj.requires_grad_(True)
    before = experts.down_proj.detach().clone()
    x, index, weights, grad_out = _batch(0, torch.float32, "cpu")
    experts(x, index, weights).backward(grad_out)
    optimizer.step()
    assert experts.down_proj.grad is None and not torch.equal(experts.down_proj, before)
    assert float(optimizer.state[experts.down_proj]["step"]) == 1
    experts(x, index, weights).backward(grad_out)  # its hook exists now: updated in the backward
    assert experts.down_proj.grad is None and float(optimizer.state[experts.down_proj]["step"]) == 2


def test_state_dict_round_trip_and_torch_adamw_state_loads(device):
    w1, w2 = _weights(torch.bfloat16, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER, moments_dtype=torch.float32)
    _backward(0, w1, w2, torch.bfloat16, device)
    optimizer.step()
    saved = optimizer.state_dict()
    for index, p in enumerate((w1, w2)):
        # The step is saved as a CPU copy, as a non-fused torch.optim.AdamW keeps it.
        step = saved["state"][index]["step"]
        assert step.device.type == "cpu" and step is not optimizer.state[p]["step"]
        assert optimizer.state[p]["step"].device == p.device
    other = sonar_kernels.ExpertAdamW(
        [torch.nn.Parameter(w1.detach().clone()), torch.nn.Parameter(w2.detach().clone())]
    )
    other.load_state_dict(saved)
    for p, q in zip((w1, w2), [p for g in other.param_groups for p in g["params"]], strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            a, b = optimizer.state[p][key], other.state[q][key]
            assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b), key
    assert other.state[q]["exp_avg"].dtype == torch.float32  # not cast to the bf16 parameter's dtype

    # A torch.optim.AdamW state_dict (CPU step, moments in the parameter's dtype) loads as well.
    t1, t2 = _weights(torch.float32, device)
    torch_optimizer = torch.optim.AdamW([t1, t2], **HYPER)
    t1.grad, t2.grad = torch.randn_like(t1), torch.randn_like(t2)
    torch_optimizer.step()
    sonar = sonar_kernels.ExpertAdamW(
        [torch.nn.Parameter(t1.detach().clone()), torch.nn.Parameter(t2.detach().clone())]
    )
    sonar.load_state_dict(torch_optimizer.state_dict())
    p = sonar.param_groups[0]["params"][0]
    assert sonar.state[p]["step"].dtype == torch.float32 and sonar.state[p]["step"].device == p.device
    assert float(sonar.state[p]["step"]) == 1
    assert torch.equal(sonar.state[p]["exp_avg"], torch_optimizer.state[t1]["exp_avg"])
    assert sonar.param_groups[0]["lr"] == HYPER["lr"]


@pytest.mark.parametrize(
    ("key", "value"), [("amsgrad", True), ("maximize", True), ("capturable", True), ("differentiable", True)]
)
def test_unsupported_adamw_options_in_a_loaded_state_are_refused(key, value):
    p = torch.nn.Parameter(torch.randn(2, 4, 4))
    state = torch.optim.AdamW([p], **{key: value}).state_dict()
    optimizer = sonar_kernels.ExpertAdamW([torch.nn.Parameter(p.detach().clone())])
    with pytest.raises(ValueError, match=key):
        optimizer.load_state_dict(state)


def _torch_2_13_cuda_fused_adamw(p, g, m, v, step, hyper):
    """torch 2.13's fused CUDA AdamW (fused_adam_utils.cuh, same-dtype kernel), evaluated with numpy
    (IEEE fp32 operations; torch's CPU kernels turn a division by a scalar into a multiplication):
    fp32 hyperparameters, torch's fp32 pow (``torch.pow``, the powf its kernel calls), fma (evaluated
    exactly in fp64, rounded once), IEEE division and square root. Returns fp32 tensors."""
    f32, f64 = np.float32, np.float64

    def fma(a, b, c):
        return (f64(a) * b.astype(f64) + c.astype(f64)).astype(f32)

    lr, eps, wd = f32(hyper["lr"]), f32(hyper["eps"]), f32(hyper["weight_decay"])
    beta1, beta2 = (f32(b) for b in hyper["betas"])
    step32 = torch.tensor(float(step))
    beta1_pow, beta2_pow = (float(torch.pow(torch.tensor(float(b)), step32)) for b in (beta1, beta2))
    bias_correction1 = f32(1) - f32(beta1_pow)
    bias_correction2_sqrt = np.sqrt(f32(1) - f32(beta2_pow))
    step_size = lr / bias_correction1
    p, g, m, v = (t.detach().float().cpu().numpy() for t in (p, g, m, v))
    if hyper["weight_decay"] != 0:
        p = fma(-(lr * wd), p, p)
    m = fma(beta1, m, fma(-beta1, g, g))
    gg = g * g
    v = fma(beta2, v, fma(-beta2, gg, gg))
    p = p - (step_size * m) / (np.sqrt(v) / bias_correction2_sqrt + eps)
    return tuple(torch.from_numpy(np.ascontiguousarray(t)) for t in (p, m, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_2_13_cuda_arithmetic_is_bit_exact(dtype, device, monkeypatch):
    # On CUDA the update follows the arithmetic of the installed torch's fused AdamW; check the "fp32"
    # variant (torch 2.13's) here against an independent evaluation of its formula, and fused == split.
    monkeypatch.setattr(ops.triton_backend.wgrad_update, "adamw_arithmetic", lambda device: "fp32")
    results = {}
    for fused in (True, False):
        w1, w2 = _weights(dtype, device)
        optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER, fused_epilogue=fused)
        for step in range(2):
            grads = _plain_grads(step, w1, w2, dtype, device)
            expected = [
                _torch_2_13_cuda_fused_adamw(
                    p.detach(),
                    g,
                    optimizer.state[p]["exp_avg"],
                    optimizer.state[p]["exp_avg_sq"],
                    step + 1,
                    HYPER,
                )
                for p, g in zip((w1, w2), grads, strict=True)
            ]
            _backward(step, w1, w2, dtype, device)
            optimizer.step()
            for p, (p_ref, m_ref, v_ref) in zip((w1, w2), expected, strict=True):
                got = (p.detach(), optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])
                for a, b in zip(got, (p_ref, m_ref, v_ref), strict=True):
                    b = b.to(a.device, a.dtype)
                    assert torch.equal(a, b), f"step {step}: {(a.float() - b.float()).abs().max():.3e}"
        results[fused] = [t.clone() for p in (w1, w2) for t in (p.detach(), optimizer.state[p]["exp_avg"])]
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False], strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("start_step", [0, 9, 999, 99_999])
@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.999)], ids=["beta2=0.95", "beta2=0.999"])
def test_bitwise_equal_to_torch_fused_adamw_on_cuda(dtype, start_step, betas):
    # The goal on CUDA: the same bits as torch.optim.AdamW(fused=True) given the same rounded gradient.
    hyper = dict(HYPER, betas=betas)
    w1, w2 = _weights(dtype, "cuda")
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **hyper)
    for p in (w1, w2):
        optimizer.state[p]["step"].fill_(start_step)
        optimizer.state[p]["exp_avg"].normal_(0, 1e-3)
        optimizer.state[p]["exp_avg_sq"].uniform_(0, 1e-5)
    grads = _plain_grads(0, w1, w2, dtype, "cuda")
    expected = [
        _torch_adamw_step(p, optimizer.state[p], g, hyper) for p, g in zip((w1, w2), grads, strict=True)
    ]
    _backward(0, w1, w2, dtype, "cuda")
    for p, (p_ref, m_ref, v_ref) in zip((w1, w2), expected, strict=True):
        state = optimizer.state[p]
        for a, b in ((p.detach(), p_ref), (state["exp_avg"], m_ref), (state["exp_avg_sq"], v_ref)):
            assert torch.equal(a, b), f"{float((a != b).float().mean()):.2e} of the elements differ"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_consecutive_steps_bitwise_equal_to_torch_fused_adamw_on_cuda(dtype):
    # 300 steps in a row with torch's default betas, each against torch.optim.AdamW(fused=True) from the
    # same weights and state: beta2 ** step is where an update's bias correction differs first (one bit
    # of 1 - 0.999 ** step moves every weight; kernels/adamw.py).
    hyper = dict(HYPER, betas=(0.9, 0.999))
    w1, w2 = _weights(dtype, "cuda")
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **hyper)
    for step in range(300):
        grads = _plain_grads(step % 2, w1, w2, dtype, "cuda")
        expected = [
            _torch_adamw_step(p, optimizer.state[p], g, hyper) for p, g in zip((w1, w2), grads, strict=True)
        ]
        _backward(step % 2, w1, w2, dtype, "cuda")
        optimizer.step()
        for p, (p_ref, m_ref, v_ref) in zip((w1, w2), expected, strict=True):
            state = optimizer.state[p]
            for a, b in ((p.detach(), p_ref), (state["exp_avg"], m_ref), (state["exp_avg_sq"], v_ref)):
                assert torch.equal(a, b), f"step {step + 1}: {float((a != b).float().mean()):.2e} differ"


def test_loaded_state_without_moments_or_with_bad_hyperparameters_is_refused():
    p = torch.nn.Parameter(torch.randn(2, 4, 4))
    optimizer = sonar_kernels.ExpertAdamW([p])
    state = optimizer.state_dict()
    broken = {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": state["param_groups"]}
    with pytest.raises(ValueError, match="no exp_avg"):
        optimizer.load_state_dict(broken)
    bad_lr = {"state": state["state"], "param_groups": [dict(state["param_groups"][0], lr=-1.0)]}
    with pytest.raises(ValueError, match="lr"):
        optimizer.load_state_dict(bad_lr)
    # fp64 moments (not a kernel dtype) load as the parameter's dtype.
    fp64 = {
        "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(2, 4, 4, dtype=torch.float64),
                      "exp_avg_sq": torch.ones(2, 4, 4, dtype=torch.float64)}},
        "param_groups": state["param_groups"],
    }  # fmt: skip
    optimizer.load_state_dict(fp64)
    assert optimizer.state[p]["exp_avg"].dtype == torch.float32
    assert torch.equal(optimizer.state[p]["exp_avg"], torch.ones(2, 4, 4))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_expert_gradient_norms_equal_the_reference_gradient_norms(backend, device):
    device = device if backend == "triton" else "cpu"
    x, index, weights, w1, w2 = Case(37, 33, 17, 7, 3).make(torch.float32, device=device)
    grad_out = torch.randn(37, 33).to(device)
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    optimizer = sonar_kernels.ExpertAdamW([p1, p2], **HYPER)
    sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend=backend).backward(grad_out)
    a, b = w1.double().requires_grad_(), w2.double().requires_grad_()
    out = reference.moe_mlp(x.double(), index, weights.double(), a, b)
    g1, g2 = torch.autograd.grad(out, [a, b], grad_out.double())
    assert_close(optimizer.expert_grad_norm([p1]), g1.norm(), torch.float32, what="||dW1||")
    assert_close(optimizer.expert_grad_norm([p2]), g2.norm(), torch.float32, what="||dW2||")
    total = torch.sqrt(g1.norm() ** 2 + g2.norm() ** 2)
    assert_close(optimizer.expert_grad_norm(), total, torch.float32, what="total")
    with pytest.raises(ValueError, match="not an expert tensor"):
        optimizer.expert_grad_norm([torch.nn.Parameter(torch.zeros(2))])


def _micro_batch(micro, dtype, device):
    x, index, weights, grad_out = _batch(micro, dtype, device)
    return x, index, weights, grad_out / 4


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_float32_accumulation_buffer_sums_micro_batches_in_float32(backend, device):
    # bf16 weights with grad_dtype=float32: micro-batch gradients are summed in an fp32 buffer (the
    # .grad of a bf16 tensor is bf16). Reference: the same gradients, summed in fp32 by autograd.
    device = device if backend == "triton" else "cpu"
    k = 4
    w1, w2 = _weights(torch.bfloat16, device)
    optimizer = sonar_kernels.ExpertAdamW(
        [w1, w2], **HYPER, grad_dtype=torch.float32, moments_dtype=torch.float32, accumulation_steps=k
    )
    # Triton: fp32 master copies of the same weights give the fp32 wgrad unrounded (the GEMMs still run
    # in bf16). torch: each micro-batch's gradient is bf16 (autograd), summed in fp32.
    masters = [torch.nn.Parameter(p.detach().float()) for p in (w1, w2)]
    for micro in range(k - 1):
        x, index, weights, grad_out = _micro_batch(micro, torch.bfloat16, device)
        sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend=backend).backward(grad_out)
        if backend == "triton":
            out = sonar_kernels.moe_mlp(x, index, weights, *masters, backend=backend)
            out.backward(grad_out)
        else:
            a, b = (p.detach().clone().requires_grad_() for p in (w1, w2))
            grads = torch.autograd.grad(
                sonar_kernels.moe_mlp(x, index, weights, a, b, backend=backend), [a, b], grad_out
            )
            for m, g in zip(masters, grads, strict=True):
                m.grad = g.float() if m.grad is None else m.grad + g.float()
    assert w1.grad is None and w2.grad is None
    for p, m in zip((w1, w2), masters, strict=True):
        buffer = optimizer._record.micro_batches.buffers[p]
        assert buffer.dtype == torch.float32 and torch.equal(buffer, m.grad)
    expected_grads = [m.grad.clone() for m in masters]
    x, index, weights, grad_out = _micro_batch(k - 1, torch.bfloat16, device)
    before = {p: {key: t.clone() for key, t in optimizer.state[p].items()} for p in (w1, w2)}
    p_before = [p.detach().clone() for p in (w1, w2)]
    sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend=backend).backward(grad_out)
    assert not optimizer._record.micro_batches.buffers
    # The update used buffer + the last micro-batch's gradient.
    if backend == "triton":
        sonar_kernels.moe_mlp(x, index, weights, *masters, backend=backend).backward(grad_out)
        expected_grads = [m.grad for m in masters]
    else:
        a, b = (p.clone().requires_grad_() for p in p_before)
        grads = torch.autograd.grad(
            sonar_kernels.moe_mlp(x, index, weights, a, b, backend=backend), [a, b], grad_out
        )
        expected_grads = [e + g.float() for e, g in zip(expected_grads, grads, strict=True)]
    for p, old, g in zip((w1, w2), p_before, expected_grads, strict=True):
        # torch.optim.AdamW in fp32 (the kernels' arithmetic), W rounded to bf16 once at the end.
        p_ref, m_ref, v_ref = _torch_adamw_step(old.float(), before[p], g)
        state = optimizer.state[p]
        assert_close(state["exp_avg"], m_ref, torch.float32, what="exp_avg")
        assert_close(state["exp_avg_sq"], v_ref, torch.float32, what="exp_avg_sq")
        assert_close(p.detach(), p_ref, torch.bfloat16, what="W")
    optimizer.step()
    optimizer.zero_grad()


def test_zero_grad_mid_window_drops_the_accumulation_buffer_and_starts_a_new_window(device):
    w1, w2 = _weights(torch.bfloat16, device)
    optimizer = sonar_kernels.ExpertAdamW([w1, w2], **HYPER, grad_dtype=torch.float32, accumulation_steps=2)
    _backward(0, w1, w2, torch.bfloat16, device)
    assert len(optimizer._record.micro_batches.buffers) == 2
    optimizer.zero_grad(set_to_none=False)
    assert all(not b.any() for b in optimizer._record.micro_batches.buffers.values())
    optimizer.zero_grad()
    assert not optimizer._record.micro_batches.buffers
    # The window starts again: the next backward is its first micro-batch, the one after updates.
    _backward(1, w1, w2, torch.bfloat16, device)
    assert float(optimizer.state[w1]["step"]) == 0.0
    _backward(2, w1, w2, torch.bfloat16, device)
    assert float(optimizer.state[w1]["step"]) == 1.0 and not optimizer._record.micro_batches.buffers
