"""Both backends apply the same documented AdamW rule when dtypes are mixed (docs/design.md, "Arithmetic":
weight, gradient and moments loaded as fp32, the arithmetic in fp32, each stored once in its own dtype),
checked against an independent float64 emulation of that rule, three steps."""

import math

import pytest
import torch
from numerics import rel_err

import sonar_kernels

E, H, I, T, TOP_K = 4, 16, 8, 24, 2
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1
STEPS = 3


def _emulate(p, g, m, v, step):
    """One AdamW step of the rule in float64, each result rounded to fp32 (the arithmetic's precision),
    then stored in the tensor's own dtype."""
    b1, b2 = BETAS
    p64, g64, m64, v64 = (t.double() for t in (p, g, m, v))
    p64 = p64 * (1 - LR * WD)
    m64 = b1 * m64 + (1 - b1) * g64
    v64 = b2 * v64 + (1 - b2) * g64 * g64
    step_size = LR / (1 - b1**step)
    p64 = p64 - step_size * m64 / (v64.sqrt() / math.sqrt(1 - b2**step) + EPS)
    return tuple(new.float().to(old.dtype) for new, old in ((p64, p), (m64, m), (v64, v)))


def _batch(step, dtype):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(T, H, generator=generator).to(dtype)
    index = torch.randint(0, E, (T, TOP_K), generator=generator)
    return (
        x,
        index,
        torch.rand(T, TOP_K, generator=generator).to(dtype),
        torch.randn(T, H, generator=generator),
    )


def _assert_stored_alike(actual, expected, what):
    """fp32: within 1e-6 normwise. A 16-bit dtype: each entry within one unit in the last place of that
    dtype (the two sides may round a value on a rounding boundary differently), few of them off."""
    assert actual.dtype == expected.dtype, what
    if actual.dtype == torch.float32:
        assert rel_err(actual, expected) <= 1e-6, what
        return
    eps = torch.finfo(actual.dtype).eps
    a, b = actual.double(), expected.double()
    assert ((a - b).abs() <= eps * b.abs()).all(), what
    assert rel_err(actual, expected) <= eps / 8, what


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    ("weight_dtype", "moments_dtype", "grad_dtype"),
    [
        (torch.float32, torch.bfloat16, None),
        (torch.float32, torch.float16, None),
        (torch.bfloat16, torch.float32, None),
        (torch.float32, torch.float32, torch.bfloat16),
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.float32),
    ],
    ids=["fp32-weights-bf16-moments", "fp32-weights-fp16-moments", "bf16-weights-fp32-moments",
         "fp32-weights-bf16-grad", "fp32-weights-bf16-moments-bf16-grad", "bf16-weights-fp32-moments-fp32-grad"],
)  # fmt: skip
def test_mixed_dtypes_follow_the_documented_rule_on_both_backends(
    backend, weight_dtype, moments_dtype, grad_dtype
):
    # grad_dtype: the wgrad is rounded to it before the update; with fp32 weights the emulation rounds the
    # fp32 gradient of the ordinary backward the same way. A grad_dtype wider than 16-bit weights: the
    # ordinary backward of fp32 weights holding the same values (the GEMMs run in the activations' dtype,
    # the weights rounded to it in registers, so every product is the same) gives that gradient in fp32.
    torch.manual_seed(0)
    model = sonar_kernels.SonarExperts(E, H, I, backend=backend, dtype=weight_dtype)
    optimizer = sonar_kernels.ExpertAdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, moments_dtype=moments_dtype,
        grad_dtype=grad_dtype,
    )  # fmt: skip
    # Each step is emulated from the model's own state before it, with the gradient of the same backend's
    # ordinary backward on the same weights (no optimizer: the gradient in the weight's dtype, which is
    # what the update uses by default).
    wide_grad = grad_dtype is not None and grad_dtype.itemsize > weight_dtype.itemsize
    shadow_dtype = grad_dtype if wide_grad else weight_dtype
    shadow = sonar_kernels.SonarExperts(E, H, I, backend=backend, dtype=shadow_dtype)
    for step in range(1, STEPS + 1):
        x, index, weights, grad_out = _batch(step, weight_dtype)
        with torch.no_grad():
            for q, p in zip(shadow.parameters(), model.parameters(), strict=True):
                q.copy_(p)
        shadow.zero_grad()
        shadow(x, index, weights).backward(grad_out.to(weight_dtype))
        before = {
            name: (p.detach().clone(), *(optimizer.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")))
            for name, p in model.named_parameters()
        }
        model(x, index, weights).backward(grad_out.to(weight_dtype))
        optimizer.step()
        for (name, p), q in zip(model.named_parameters(), shadow.parameters(), strict=True):
            grad = q.grad if grad_dtype is None else q.grad.to(grad_dtype)
            expected = _emulate(before[name][0], grad, *before[name][1:], step)
            state = optimizer.state[p]
            for actual, wanted, what in zip((p.detach(), state["exp_avg"], state["exp_avg_sq"]), expected,
                                            ("weight", "exp_avg", "exp_avg_sq"), strict=True):  # fmt: skip
                _assert_stored_alike(actual, wanted, f"step {step} {name} {what}")
