"""An expert tensor is updated only by a backward that computes its gradient, and a misuse raises the
library's own error before anything changes (both backends). Expected dX from the float64 reference
(plain torch autograd over sonar_kernels.reference)."""

import pytest
import torch
from numerics import rel_err

import sonar_kernels
from sonar_kernels import reference

E, H, I, T, TOP_K = 4, 16, 8, 8, 2
BACKENDS = ["torch", "triton"]


def _setup(backend):
    torch.manual_seed(0)
    experts = sonar_kernels.SonarExperts(E, H, I, backend=backend)
    optimizer = sonar_kernels.ExpertAdamW(experts.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(T, H, requires_grad=True)
    index, weights = torch.randint(0, E, (T, TOP_K)), torch.rand(T, TOP_K)
    return experts, optimizer, x, index, weights


def _snapshot(experts, optimizer):
    return [t.detach().clone() for p in experts.parameters() for t in (p, *optimizer.state[p].values())]


def _assert_untouched(experts, optimizer, before):
    after = _snapshot(experts, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert all(p.grad is None for p in experts.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ["autograd.grad", "Tensor.backward(inputs=)", "autograd.backward(inputs=)"])
def test_a_backward_that_does_not_ask_for_the_weights_leaves_them_and_their_state(backend, entry):
    experts, optimizer, x, index, weights = _setup(backend)
    before = _snapshot(experts, optimizer)
    loss = experts(x, index, weights).square().sum()
    if entry == "autograd.grad":
        (grad_x,) = torch.autograd.grad(loss, x)
    elif entry == "Tensor.backward(inputs=)":
        loss.backward(inputs=[x])
        grad_x = x.grad
    else:
        torch.autograd.backward([loss], inputs=[x])
        grad_x = x.grad
    _assert_untouched(experts, optimizer, before)
    # dX as plain torch autograd gives it, in float64.
    x64 = x.detach().double().requires_grad_()
    w1, w2 = (p.detach().double() for p in experts.parameters())
    reference.moe_mlp(x64, index, weights.double(), w1, w2).square().sum().backward()
    assert rel_err(grad_x, x64.grad) <= 1e-5
    # A backward that asks for them updates them, once.
    experts(x, index, weights).square().sum().backward()
    assert all(float(optimizer.state[p]["step"]) == 1 for p in experts.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("step_between", [False, True])
def test_a_second_backward_of_one_graph_raises_the_librarys_error_and_changes_nothing(backend, step_between):
    experts, optimizer, x, index, weights = _setup(backend)
    loss = experts(x, index, weights).square().sum()
    loss.backward(retain_graph=True)
    if step_between:
        optimizer.step()
    before = _snapshot(experts, optimizer)
    with pytest.raises(RuntimeError, match="changed after the forward of this graph"):
        loss.backward()
    _assert_untouched(experts, optimizer, before)
    x.grad = None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hyperparameter_set_between_forward_and_backward_raises_the_librarys_error(backend):
    experts, optimizer, x, index, weights = _setup(backend)
    loss = experts(x, index, weights).square().sum()
    optimizer.param_groups[0]["lr"] = 5e-3
    before = _snapshot(experts, optimizer)
    with pytest.raises(RuntimeError, match="set between this forward and its backward"):
        loss.backward()
    _assert_untouched(experts, optimizer, before)
