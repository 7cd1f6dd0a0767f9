"""The Triton forward of moe_mlp against a float64 evaluation of reference.py."""

import pytest
import torch
from cases import CASES, Case
from numerics import SAME_ROUNDING_TOLERANCE, assert_close, to_double
from test_expert_adamw import ULP_BOUND, _ulps
from torch.utils._python_dispatch import TorchDispatchMode

import sonar_kernels
from sonar_kernels import reference
from sonar_kernels.ops import library

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
]


def _reference64(inputs, activation):
    return reference.moe_mlp(*to_double(*inputs), activation=activation)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_float64_reference(case, activation, dtype, device):
    inputs = case.make(dtype, device=device)
    out = sonar_kernels.moe_mlp(*inputs, activation=activation, backend="triton")
    assert out.dtype == dtype
    assert_close(out, _reference64(inputs, activation), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [CASES[2], CASES[5], CASES[7]])
def test_gelu_tanh_forward_matches_float64_reference(case, dtype, device):
    # The tanh-approximated GELU (Gemma's "gelu_pytorch_tanh"): one more constexpr path of the same kernel.
    inputs = case.make(dtype, device=device)
    out = sonar_kernels.moe_mlp(*inputs, activation="gelu_tanh", backend="triton")
    assert_close(out, _reference64(inputs, "gelu_tanh"), dtype)
    assert_close(
        out, reference.moe_mlp(*inputs, activation="gelu_tanh"), dtype, tolerances=SAME_ROUNDING_TOLERANCE
    )


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_reference_at_the_same_rounding_points(case, dtype, device):
    # reference.py in the same dtype rounds where the kernels round; only the fp32 summation order
    # differs. A rounding point missing or rounding the wrong way (error ~u) fails this.
    inputs = case.make(dtype, device=device)
    out = sonar_kernels.moe_mlp(*inputs, backend="triton")
    assert_close(out, reference.moe_mlp(*inputs), dtype, tolerances=SAME_ROUNDING_TOLERANCE)


@pytest.mark.parametrize("case", CASES[2:3] + CASES[-2:-1])
def test_same_bits_twice(case, device):
    inputs = case.make(torch.bfloat16, device=device)
    first = sonar_kernels.moe_mlp(*inputs, backend="triton")
    second = sonar_kernels.moe_mlp(*inputs, backend="triton")
    assert torch.equal(first.view(torch.int16), second.view(torch.int16))


def test_fp32_master_weights_under_bf16_compute(device):
    # fp32 weights with bf16 activations: the kernels round weight tiles to bf16 in registers.
    inputs = Case(37, 33, 17, 7, 3).make(torch.bfloat16, weight_dtype=torch.float32, device=device)
    out = sonar_kernels.moe_mlp(*inputs, backend="triton")
    x, index, w, w1, w2 = inputs
    expected = _reference64((x, index, w, w1.bfloat16(), w2.bfloat16()), "silu")
    assert out.dtype == torch.bfloat16
    assert_close(out, expected, torch.bfloat16)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_index_dtypes(index_dtype, device):
    inputs = Case(30, 32, 16, 5, 3, "sentinels").make(torch.float32, index_dtype=index_dtype, device=device)
    out = sonar_kernels.moe_mlp(*inputs, backend="triton")
    assert_close(out, _reference64(inputs, "silu"), torch.float32)


def test_non_contiguous_inputs(device):
    x, index, w, w1, w2 = Case(37, 33, 17, 7, 3, "sentinels").make(torch.float32, device=device)
    # Transposed storage, or every other column of a wider tensor.
    x_nc = x.T.contiguous().T
    index_nc = index.T.contiguous().T
    w_nc = torch.stack([w, w], dim=2)[:, :, 0]
    w1_nc = w1.transpose(1, 2).contiguous().transpose(1, 2)
    w2_nc = torch.stack([w2, w2], dim=3)[..., 1]
    inputs = (x_nc, index_nc, w_nc, w1_nc, w2_nc)
    assert not any(t.is_contiguous() for t in inputs)
    out = sonar_kernels.moe_mlp(*inputs, backend="triton")
    assert_close(out, _reference64((x, index, w, w1, w2), "silu"), torch.float32)


def test_no_tokens(device):
    x, index, w, w1, w2 = Case(1, 32, 16, 4, 2).make(torch.float32, device=device)
    out = sonar_kernels.moe_mlp(x[:0], index[:0], w[:0], w1, w2, backend="triton")
    assert out.shape == (0, 32)


def test_all_slots_dropped(device):
    x, index, w, w1, w2 = Case(9, 32, 16, 4, 2).make(torch.float32, device=device)
    out = sonar_kernels.moe_mlp(x, torch.full_like(index, -1), w, w1, w2, backend="triton")
    assert torch.equal(out, torch.zeros_like(out))


def test_dropped_slot_weights_are_not_read(device):
    x, index, w, w1, w2 = Case(30, 32, 16, 5, 3, "sentinels").make(torch.float32, device=device)
    w = torch.where((index < 0) | (index >= 5), float("nan"), w)
    out = sonar_kernels.moe_mlp(x, index, w, w1, w2, backend="triton")
    assert_close(out, _reference64((x, index, w, w1, w2), "silu"), torch.float32)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_torch_backend_is_the_reference(backend, activation):
    # On CPU tensors "auto" means the torch reference.
    inputs = Case(37, 33, 17, 7, 3, "sentinels").make(torch.float32)
    out = sonar_kernels.moe_mlp(*inputs, activation=activation, backend=backend)
    expected = reference.moe_mlp(*inputs, activation=activation)
    assert torch.equal(out, expected)


class _RecordOps(TorchDispatchMode):
    """The names of the aten ops that run, inside the sonar_kernels:: custom ops too (their Python bodies
    run under the recorder)."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "sonar_kernels":
            with self:
                return BODIES[func.overloadpacket.__name__](*args, **kwargs)
        self.ops.add(func.overloadpacket.__name__)
        out = func(*args, **kwargs)
        # A copy between devices (.cpu(), .tolist(), .to("cuda")) is a host sync too.
        tensors = [t for t in (*args, *kwargs.values(), out) if isinstance(t, torch.Tensor)]
        if len({t.device.type for t in tensors}) > 1:
            self.ops.add("cross_device_copy")
        return out


# The forward op's body, from the op's inputs (hidden_states, index, weights, W1, W2, up_proj, biases,
# activation, backend, layout, ...).
BODIES = {"moe_mlp_fwd": library.moe_mlp_fwd_body}
MATMULS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "_grouped_mm", "grouped_mm"}
HOST_SYNCS = {"_local_scalar_dense", "nonzero", "item", "cross_device_copy"}


@pytest.mark.parametrize("backend", ["triton", "torch", "reference"])
def test_forward_runs_no_host_sync_and_triton_no_torch_matmul(backend, device):
    # 16-byte aligned strides (H 32, I 16): torch's grouped GEMM runs on the CPU.
    inputs = Case(30, 32, 16, 5, 3, "sentinels").make(torch.float32, device=device)
    with _RecordOps() as recorder:
        if backend == "reference":
            reference.moe_mlp(*inputs)
        else:
            sonar_kernels.moe_mlp(*inputs, backend=backend)
    if backend == "reference":
        # The positive control: the recorder sees the oracle's matmuls (its host sync, Tensor.tolist,
        # bypasses the dispatcher).
        assert recorder.ops & MATMULS, sorted(recorder.ops)
    else:
        assert not recorder.ops & HOST_SYNCS, sorted(recorder.ops & HOST_SYNCS)
        # The Triton forward runs Triton kernels only; the torch backend torch's grouped GEMM.
        expected = set() if backend == "triton" else {"_grouped_mm"}
        assert recorder.ops & MATMULS == expected, sorted(recorder.ops & MATMULS)


GRAD_CASES = [CASES[2], CASES[5], CASES[7]]


@pytest.mark.parametrize("out_grad", ["random", "sum"])  # "sum": out.sum() gives a stride-0 gradient
@pytest.mark.parametrize("case", GRAD_CASES)
def test_gradients_match_float64_reference(case, out_grad, device):
    inputs = case.make(torch.float32, device=device)
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    leaves64 = [t.detach().double().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = sonar_kernels.moe_mlp(*leaves, backend="triton")
    out64 = reference.moe_mlp(*leaves64)
    if out_grad == "sum":
        out.sum().backward()
        out64.sum().backward()
    else:
        g = torch.randn_like(out)
        out.backward(g)
        out64.backward(g.double())
    for name, leaf, leaf64 in zip(("x", "index", "w", "w1", "w2"), leaves, leaves64, strict=True):
        if leaf.is_floating_point():
            assert_close(leaf.grad, leaf64.grad, torch.float32, what=f"grad of {name}")


def _no_slot(shape, device):
    x, index, w, w1, w2 = Case(9, 32, 16, 4, 2).make(torch.float32, device=device)
    if shape == "all-dropped":
        index = torch.full_like(index, -1)
    elif shape == "T0":
        x, index, w = x[:0], index[:0], w[:0]
    else:
        index, w = index[:, :0], w[:, :0]
    return x, index, w, w1, w2


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("shape", ["all-dropped", "T0", "top_k0"])
def test_gradients_when_no_slot_reaches_an_expert(shape, backend, device):
    if backend == "torch":
        device = "cpu"
    x, index, w, w1, w2 = _no_slot(shape, device)
    leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2)]
    out = sonar_kernels.moe_mlp(leaves[0], index, leaves[1], leaves[2], leaves[3], backend=backend)
    expected = reference.moe_mlp(*to_double(x, index, w, w1, w2))
    assert out.shape == expected.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(expected, torch.zeros_like(expected))
    out.sum().backward()
    for leaf in leaves:
        # No slot reaches an expert: every gradient is zero (None where autograd had nothing to add).
        assert leaf.grad is None or torch.equal(leaf.grad, torch.zeros_like(leaf))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_top_k_0_updates_the_experts_with_a_zero_gradient_as_torch_adamw(backend, device):
    # A router that selects no expert: every expert gets AdamW's update of a zero gradient (weight decay,
    # the moments' decay), as torch.optim.AdamW(fused=True) gives a batched tensor whose gradient is zero.
    if backend == "torch":
        device = "cpu"
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    x, index, w, w1, w2 = _no_slot("top_k0", device)
    params = [torch.nn.Parameter(t.clone()) for t in (w1, w2)]
    references = [torch.nn.Parameter(t.clone()) for t in (w1, w2)]
    optimizer = sonar_kernels.ExpertAdamW(params, **hyper)
    torch_adamw = torch.optim.AdamW(references, **hyper, fused=True)
    for _ in range(2):
        sonar_kernels.moe_mlp(x, index, w, *params, backend=backend).sum().backward()
        optimizer.step()
        for r in references:
            r.grad = torch.zeros_like(r)
        torch_adamw.step()
    for p, r, before in zip(params, references, (w1, w2), strict=True):
        assert p.grad is None and float(optimizer.state[p]["step"]) == 2.0 and not torch.equal(p, before)
        if backend == "torch":
            assert torch.equal(p, r)
        else:  # the decay rounded as docs/design.md's arithmetic (torch's fused CUDA AdamW) rounds it
            assert float(_ulps(p, r, torch.maximum(p.abs(), r.abs())).max()) <= ULP_BOUND["W"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], torch_adamw.state[r][key])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_autocast_computes_in_the_autocast_dtype(backend, device):
    if backend == "torch":
        device = "cpu"
    x, index, w, w1, w2 = Case(37, 33, 17, 7, 3).make(torch.float32, device=device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        out = sonar_kernels.moe_mlp(x, index, w, w1, w2, backend=backend)
    assert out.dtype == torch.bfloat16
    # The same as bf16 activations with fp32 master weights rounded to bf16 (weights stay fp32).
    expected = reference.moe_mlp(*to_double(x.bfloat16(), index, w, w1.bfloat16(), w2.bfloat16()))
    assert_close(out, expected, torch.bfloat16)
    assert w1.dtype == torch.float32


def test_double_backward_is_refused_clearly(device):
    x, index, w, w1, w2 = Case(9, 32, 16, 4, 2).make(torch.float32, device=device)
    x.requires_grad_()
    out = sonar_kernels.moe_mlp(x, index, w, w1, w2, backend="triton")
    # Refused when the differentiable backward is asked for (create_graph=True), not later.
    with pytest.raises(RuntimeError, match="moe_mlp is differentiable once"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)
