"""The Triton backward of moe_mlp (no optimizer attached) against float64 autograd through reference.py."""

import pytest
import torch
from cases import CASES, Case
from numerics import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import sonar_kernels
from sonar_kernels import reference

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
GRAD_NAMES = {0: "d hidden_states", 2: "d top_k_weights", 3: "d gate_up_proj", 4: "d down_proj"}


def _grads(inputs, grad_out, activation, backend):
    """(out, gradients of hidden_states, top_k_weights, gate_up_proj, down_proj) from one backward."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    if backend == "reference64":
        leaves = [t.detach().double().requires_grad_() if t.is_floating_point() else t for t in inputs]
        out = reference.moe_mlp(*leaves, activation=activation)
        out.backward(grad_out.double())
    else:
        out = sonar_kernels.moe_mlp(*leaves, activation=activation, backend=backend)
        out.backward(grad_out)
    return out, {i: leaves[i].grad for i in GRAD_NAMES}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_backward_matches_float64_reference(case, dtype, device):
    inputs = case.make(dtype, device=device)
    grad_out = torch.randn(case.T, case.H).to(dtype).to(device)
    _, grads = _grads(inputs, grad_out, "silu", "triton")
    _, expected = _grads(inputs, grad_out, "silu", "reference64")
    for i, name in GRAD_NAMES.items():
        assert grads[i].dtype == inputs[i].dtype, name
        assert_close(grads[i], expected[i], dtype, what=name)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("case", [CASES[2], CASES[5], CASES[7]])
def test_gelu_backward_matches_float64_reference(case, activation, device):
    inputs = case.make(torch.float32, device=device)
    grad_out = torch.randn(case.T, case.H).to(device)
    _, grads = _grads(inputs, grad_out, activation, "triton")
    _, expected = _grads(inputs, grad_out, activation, "reference64")
    for i, name in GRAD_NAMES.items():
        assert_close(grads[i], expected[i], torch.float32, what=name)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gelu_tanh_backward_in_bf16_matches_float64_reference(backend, device):
    case = CASES[7].values[0]  # sentinels
    inputs = case.make(torch.bfloat16, device=device)
    grad_out = torch.randn(case.T, case.H).to(torch.bfloat16).to(device)
    _, grads = _grads(inputs, grad_out, "gelu_tanh", backend)
    _, expected = _grads(inputs, grad_out, "gelu_tanh", "reference64")
    for i, name in GRAD_NAMES.items():
        assert_close(grads[i], expected[i], torch.bfloat16, what=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stride_zero_grad_out(dtype, device):
    # out.sum().backward() hands the backward an expanded (stride 0) dO.
    inputs = Case(30, 32, 16, 5, 3, "sentinels").make(dtype, device=device)
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    sonar_kernels.moe_mlp(*leaves, backend="triton").sum().backward()
    ones = torch.ones(30, 32, dtype=dtype, device=device)
    _, expected = _grads(inputs, ones, "silu", "reference64")
    for i, name in GRAD_NAMES.items():
        assert_close(leaves[i].grad, expected[i], dtype, what=name)


def test_only_the_gradients_asked_for(device):
    x, index, w, w1, w2 = Case(37, 33, 17, 7, 3).make(torch.float32, device=device)
    w1.requires_grad_()
    out = sonar_kernels.moe_mlp(x, index, w, w1, w2, backend="triton")
    grad_out = torch.randn_like(out)
    (grad_w1,) = torch.autograd.grad(out, [w1], grad_out)
    _, expected = _grads((x, index, w, w1, w2), grad_out, "silu", "reference64")
    assert_close(grad_w1, expected[3], torch.float32, what="d gate_up_proj")


def test_same_bits_twice(device):
    inputs = Case(37, 33, 17, 7, 3).make(torch.bfloat16, device=device)
    grad_out = torch.randn(37, 33).bfloat16().to(device)
    _, first = _grads(inputs, grad_out, "silu", "triton")
    _, second = _grads(inputs, grad_out, "silu", "triton")
    for i in GRAD_NAMES:
        assert torch.equal(first[i].view(torch.int16), second[i].view(torch.int16))


def test_fp32_master_weights_under_bf16_compute(device):
    # bf16 activations with fp32 weights: the weight gradients are fp32 (the parameter's dtype).
    x, index, w, w1, w2 = Case(37, 33, 17, 7, 3).make(
        torch.bfloat16, weight_dtype=torch.float32, device=device
    )
    grad_out = torch.randn(37, 33).bfloat16().to(device)
    _, grads = _grads((x, index, w, w1, w2), grad_out, "silu", "triton")
    _, expected = _grads((x, index, w, w1.bfloat16(), w2.bfloat16()), grad_out, "silu", "reference64")
    assert grads[3].dtype == grads[4].dtype == torch.float32
    for i, name in GRAD_NAMES.items():
        assert_close(grads[i], expected[i], torch.bfloat16, what=name)


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


MATMULS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "dot", "linear", "_grouped_mm", "einsum", "addmv", "mv"}
HOST_SYNCS = {"_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero", "allclose", "tolist"}


@pytest.mark.parametrize("with_optimizer", [False, True], ids=["plain", "expert-adamw"])
def test_backward_runs_no_torch_matmul_and_no_host_sync(with_optimizer, device):
    x, index, w, w1, w2 = Case(37, 33, 17, 7, 3).make(torch.float32, device=device)
    x.requires_grad_()
    w.requires_grad_()
    w1 = torch.nn.Parameter(w1)
    w2 = torch.nn.Parameter(w2)
    if with_optimizer:
        optimizer = sonar_kernels.ExpertAdamW([w1, w2])  # noqa: F841 (kept alive through the backward)
    out = sonar_kernels.moe_mlp(x, index, w, w1, w2, backend="triton")
    grad_out = torch.randn_like(out)
    recorder = _OpRecorder()
    with recorder:
        out.backward(grad_out)
    seen = set(recorder.ops)
    assert not seen & MATMULS, sorted(seen & MATMULS)
    assert not seen & HOST_SYNCS, sorted(seen & HOST_SYNCS)
    assert (w1.grad is None) == with_optimizer


class _NoOpFunctionMode(torch.overrides.TorchFunctionMode):
    """A torch function mode that changes nothing: under any mode moe_mlp runs its custom ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("with_optimizer", [False, True], ids=["plain", "expert-adamw"])
def test_eager_function_and_custom_ops_give_the_same_bits(backend, with_optimizer, device):
    # Plain eager mode runs moe_mlp's autograd formula as an autograd.Function without the custom ops'
    # dispatch; under a torch function mode (as under any mode or tensor subclass) the ops run. The same
    # gradients, or the same in-backward updates, bit for bit, over two steps.
    case = CASES[2].values[0]
    inputs = case.make(torch.float32, device=device if backend == "triton" else "cpu")
    grad_out = torch.randn(case.T, case.H, generator=torch.Generator().manual_seed(1)).to(inputs[0].device)
    results = []
    for mode in (None, _NoOpFunctionMode()):
        x, index, weights, w1, w2 = (t.detach().clone() for t in inputs)
        x.requires_grad_(True)
        weights.requires_grad_(True)
        params = [torch.nn.Parameter(w1), torch.nn.Parameter(w2)]
        optimizer = sonar_kernels.ExpertAdamW(params, lr=1e-2) if with_optimizer else None
        grads = []
        for _ in range(2):
            with mode if mode is not None else torch.enable_grad():
                out = sonar_kernels.moe_mlp(x, index, weights, *params, backend=backend)
                assert (type(out.grad_fn).__name__ == "EagerMoeMlpBackward") == (mode is None)
                out.backward(grad_out)
            grads += [x.grad.clone(), weights.grad.clone()]
            if optimizer is not None:
                optimizer.step()
                assert all(p.grad is None for p in params)
            else:
                grads += [p.grad.clone() for p in params]
            for t in (x, weights, *params):
                t.grad = None
        results.append(grads + [p.detach().clone() for p in params])
    for got, expected in zip(*results, strict=True):
        assert torch.equal(got, expected)
