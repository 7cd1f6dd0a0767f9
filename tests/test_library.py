"""The sonar_kernels:: custom ops: torch.library.opcheck (schema, fake tensors, autograd registration,
AOT dispatch) on both backends, and their results against the float64 reference and torch's AdamW."""

import pytest
import torch
from cases import Case
from numerics import rel_err, to_double

from sonar_kernels import reference
from sonar_kernels.ops import library

BACKENDS = ["torch", "triton"]


def _inputs(dtype=torch.float32, device="cpu"):
    # H and I whose strides are 16-byte multiples (torch's grouped GEMM), an expert without tokens, and
    # sentinel ids (dropped slots).
    return Case(12, 16, 8, 5, 2, "sentinels").make(dtype, device=device)


def _state(w: torch.Tensor, lr: float = 1e-2):
    """(the update's mutable tensors in library.STATE_FIELDS order, its hyperparameter tensor)."""
    state = [
        torch.zeros_like(w),
        torch.zeros_like(w),
        torch.zeros((), dtype=torch.float32, device=w.device),
        torch.zeros((), dtype=torch.float32, device=w.device),
        torch.zeros((), dtype=torch.int64, device=w.device),
        torch.zeros((), dtype=torch.int64, device=w.device),
    ]
    return state, torch.tensor([lr, 0.9, 0.999, 1e-8, 0.1], dtype=torch.float64, device=w.device)


def _forward_args(x, index, weights, w1, w2, backend, layout="concatenated", up=None, b1=None, b2=None):
    """The forward op's arguments without updates (no states, hyperparameters or gradient dtypes; the
    fused epilogue, torch AdamW's flags unset) and SwiGLU."""
    return (x, index, weights, w1, w2, up, b1, b2, "silu", backend, layout, [], [0] * 5, [None] * 5, [-1] * 5,
            True, None, None)  # fmt: skip


def _core_args(
    grad_out, x, weights, w1, w2, hpre, meta, backend, needs, layout="concatenated", up=None, b2=None
):
    """The arguments of the backward's core op (library.CORE_NEEDS order for ``needs``)."""
    return (grad_out, x, weights, w1, w2, up, b2, hpre, list(meta), list(needs), "silu", backend, layout)


def _opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_no_op_takes_more_than_twenty_arguments():
    ops = [v for v in vars(library).values() if isinstance(v, torch._library.custom_ops.CustomOpDef)]
    assert {op._name for op in ops} >= {"moe_mlp_fwd", "moe_mlp_bwd", "expert_wgrad", "expert_wgrad_"}
    for op in ops:
        assert len(op._opoverload._schema.arguments) <= 20, op._name


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_op_passes_opcheck_and_matches_the_reference(backend, device):
    x, index, weights, w1, w2 = _inputs(device=device)
    args = _forward_args(x, index, weights, w1, w2, backend)
    _opcheck(library.moe_mlp_fwd, args)
    out = library.moe_mlp_fwd(*args)[0]
    expected = reference.moe_mlp(*to_double(x, index, weights, w1, w2))
    assert rel_err(out, expected) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_ops_pass_opcheck_and_match_the_reference(backend, device):
    # The core op, then the gradient op of each weight: nothing is mutated (a weight saved by another node
    # stays usable).
    x, index, weights, w1, w2 = _inputs(device=device)
    out, hpre, *meta = library.moe_mlp_fwd(*_forward_args(x, index, weights, w1, w2, backend))
    grad_out = torch.randn_like(out)
    core = _core_args(grad_out, x, weights, w1, w2, hpre, meta, backend, [True, True, True, True, False])
    _opcheck(library.moe_mlp_bwd, core)
    versions = (w1._version, w2._version, hpre._version)
    grad_x, grad_w, grad_hpre, a, magnitudes = library.moe_mlp_bwd(*core)
    assert magnitudes.numel() == 0
    wgrads = []
    for name, weight, p, q in (("gate_up_proj", w1, grad_hpre, x), ("down_proj", w2, grad_out, a)):
        args = (name, weight, p, q, weights, list(meta), backend, "concatenated")
        _opcheck(library.expert_wgrad, args)
        wgrads.append(library.expert_wgrad(*args))
    assert (w1._version, w2._version, hpre._version) == versions
    leaves = [t.requires_grad_() for t in to_double(x, weights, w1, w2)]
    reference.moe_mlp(leaves[0], index, *leaves[1:]).backward(*to_double(grad_out))
    for got, leaf in zip((grad_x, grad_w, *wgrads), leaves, strict=True):
        assert rel_err(got, leaf.grad) <= 1e-5


def test_update_op_passes_opcheck_and_equals_torch_adamw():
    w = torch.randn(3, 8, 4)
    grad = torch.randn_like(w)
    state, hyper = _state(w)
    torch.library.opcheck(
        library.expert_adamw_, (w.clone(), grad, None, [t.clone() for t in state], hyper, False, False),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip
    expected = torch.nn.Parameter(w.clone())
    reference_optimizer = torch.optim.AdamW([expected], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(2):
        library.expert_adamw_(w, grad, None, state, hyper, False, False)
        expected.grad = grad.clone()
        reference_optimizer.step()
    assert torch.equal(w, expected.detach())
    assert torch.equal(state[0], reference_optimizer.state[expected]["exp_avg"])
    assert float(state[2]) == 2.0 and float(state[4]) == 0
    assert torch.equal(hyper, _state(w)[1])  # read, never written


def test_a_new_learning_rate_in_the_hyperparameter_tensor_reaches_the_update():
    w = torch.randn(3, 8, 4)
    grad = torch.randn_like(w)
    state, hyper = _state(w, lr=0.0)
    before = w.clone()
    library.expert_adamw_(w, grad, None, state, hyper, False, False)
    assert torch.equal(w, before)  # lr 0, no decay
    hyper[0] = 1e-2
    library.expert_adamw_(w, grad, None, state, hyper, False, False)
    assert not torch.equal(w, before)


@pytest.mark.parametrize(
    ("backend", "mode"), [("triton", "update"), ("triton", "accumulate"), ("torch", "update")]
)
def test_wgrad_op_with_an_in_backward_update_passes_opcheck(backend, mode, device):
    # The update (or the addition to a buffer) happens inside the op: the schema must declare every
    # tensor it writes.
    x, index, weights, w1, w2 = _inputs(device=device)
    out, hpre, *meta = library.moe_mlp_fwd(*_forward_args(x, index, weights, w1, w2, backend))
    core = _core_args(
        torch.randn_like(out), x, weights, w1, w2, hpre, meta, backend, [False, False, False, True, True]
    )
    _, _, _, a, magnitudes = library.moe_mlp_bwd(*core)
    state, hyper = _state(w2)
    buffer = torch.zeros_like(w2) if mode == "accumulate" else None
    args = (
        "down_proj", w2, core[0], a, weights, list(meta), magnitudes if backend == "triton" else None, mode,
        state if mode == "update" else [], hyper, buffer, False, torch.float32, True, False, False, backend,
        "concatenated",
    )  # fmt: skip
    _opcheck(library.expert_wgrad_, args)
    if mode == "update":  # the update really ran: the weight moved, the step advanced
        before = w2.clone()
        library.expert_wgrad_(*args)
        assert float(state[2]) == 1.0 and not torch.equal(w2, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_ops_pass_opcheck_with_8bit_moments(backend, device):
    # The state list of library.STATE_FIELDS_8BIT (codes, step, norm, counter, scales) through the forward
    # op (which saves it for the backward) and the update op, which writes every one of them.
    x, index, weights, w1, w2 = Case(12, 32, 32, 3, 2).make(torch.float32, device=device)
    scales = torch.zeros(3, 32, 1, device=device)
    state = [
        torch.zeros(w2.shape, dtype=torch.int8, device=device), torch.zeros(w2.shape, dtype=torch.uint8, device=device),
        torch.zeros((), device=device), torch.zeros((), device=device), torch.zeros((), dtype=torch.int64, device=device),
        torch.zeros((), dtype=torch.int64, device=device), scales, scales.clone(),
    ]  # fmt: skip
    hyper = torch.tensor([1e-2, 0.9, 0.999, 1e-8, 0.1], dtype=torch.float64, device=device)
    forward = list(_forward_args(x, index, weights, w1, w2, backend))
    forward[11:15] = [state, [0, len(state), 0, 0, 0], [None, hyper, None, None, None], [-1] * 5]
    _opcheck(library.moe_mlp_fwd, tuple(forward))
    out, hpre, *meta = library.moe_mlp_fwd(*_forward_args(x, index, weights, w1, w2, backend))
    core = _core_args(
        torch.randn_like(out), x, weights, w1, w2, hpre, meta, backend, [False, False, False, True, True]
    )
    _, _, _, a, magnitudes = library.moe_mlp_bwd(*core)
    args = (
        "down_proj", w2, core[0], a, weights, list(meta), magnitudes if backend == "triton" else None, "update",
        state, hyper, None, False, torch.float32, True, None, None, backend, "concatenated",
    )  # fmt: skip
    _opcheck(library.expert_wgrad_, args)
    before = w2.clone()
    library.expert_wgrad_(*args)
    assert float(state[2]) == 1.0 and not torch.equal(w2, before) and bool(state[6].gt(0).all())


@pytest.mark.parametrize("moments", ["fp32", "8bit"])
@pytest.mark.parametrize("master", ["remainder", "stochastic"])
def test_the_ops_pass_opcheck_with_bf16_master_weights(master, moments):
    # The state lists of library.STATE_FIELDS_REMAINDER and STATE_FIELDS_STOCHASTIC (fp32 moments, step,
    # norm, counter, then the int16 remainder or the int64 seed), and their 8-bit forms (codes, step, norm,
    # counter, scales, then the remainder or seed), through the forward op and the torch backend's update op.
    x, index, weights, w1, w2 = Case(12, 32, 32, 3, 2).make(torch.bfloat16)
    extra = torch.zeros(w2.shape, dtype=torch.int16) if master == "remainder" else torch.tensor(5)
    counters = [
        torch.zeros(()),
        torch.zeros(()),
        torch.zeros((), dtype=torch.int64),
        torch.zeros((), dtype=torch.int64),
    ]
    if moments == "8bit":
        codes = [torch.zeros(w2.shape, dtype=torch.int8), torch.zeros(w2.shape, dtype=torch.uint8)]
        state = [*codes, *counters, torch.zeros(3, 32, 1), torch.zeros(3, 32, 1), extra]
    else:
        state = [torch.zeros(w2.shape), torch.zeros(w2.shape), *counters, extra]
    hyper = torch.tensor([1e-2, 0.9, 0.999, 1e-8, 0.1], dtype=torch.float64)
    forward = list(_forward_args(x, index, weights, w1, w2, "torch"))
    forward[11:15] = [state, [0, len(state), 0, 0, 0], [None, hyper, None, None, None], [-1] * 5]
    _opcheck(library.moe_mlp_fwd, tuple(forward))
    out, hpre, *meta = library.moe_mlp_fwd(*_forward_args(x, index, weights, w1, w2, "torch"))
    core = _core_args(
        torch.randn_like(out), x, weights, w1, w2, hpre, meta, "torch", [False, False, False, True, True]
    )
    _, _, _, a, _ = library.moe_mlp_bwd(*core)
    args = (
        "down_proj", w2, core[0], a, weights, list(meta), None, "update", state, hyper, None, False,
        torch.bfloat16, True, None, None, "torch", "concatenated",
    )  # fmt: skip
    _opcheck(library.expert_wgrad_, args)
    before = w2.clone()
    library.expert_wgrad_(*args)
    assert float(state[2]) == 1.0 and not torch.equal(w2, before)
    assert bool(state[-1].ne(0).any()) if master == "remainder" else int(state[-1]) == 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_with_a_separate_up_tensor_pass_opcheck_and_update_it(backend, device):
    # torchtitan's w1, w2, w3: the up tensor is an input of its own, updated by its own op.
    x, index, weights, w1, w2 = _inputs(device=device)
    I = w2.shape[2]
    gate, up = w1[:, :I].clone(), w1[:, I:].clone()
    args = _forward_args(x, index, weights, gate, w2, backend, layout="separate", up=up)
    _opcheck(library.moe_mlp_fwd, args)
    out, hpre, *meta = library.moe_mlp_fwd(*args)
    assert rel_err(out, reference.moe_mlp(*to_double(x, index, weights, w1, w2))) <= 1e-5
    core = _core_args(
        torch.randn_like(out), x, weights, gate, w2, hpre, meta, backend, [True, True, True, False, True],
        layout="separate", up=up,
    )  # fmt: skip
    _opcheck(library.moe_mlp_bwd, core)
    _, _, grad_hpre, _, magnitudes = library.moe_mlp_bwd(*core)
    state, hyper = _state(up)
    update = (
        "up_proj", up, grad_hpre[:, I:], x, weights, list(meta), magnitudes if backend == "triton" else None,
        "update", state, hyper, None, False, torch.float32, True, False, False, backend, "separate",
    )  # fmt: skip
    _opcheck(library.expert_wgrad_, update)
    before = up.clone()
    library.expert_wgrad_(*update)
    assert float(state[2]) == 1.0 and not torch.equal(up, before)
    grad_gate = library.expert_wgrad(
        "gate_up_proj", gate, grad_hpre[:, :I], x, weights, list(meta), backend, "separate"
    )
    assert grad_gate.shape == gate.shape  # the gate's ordinary gradient


@pytest.mark.parametrize("backend", BACKENDS)
def test_wgrad_op_updates_a_bias_in_place(backend, device):
    # The biases are expert tensors with updates of their own: their op declares them mutated with their state.
    x, index, weights, w1, w2 = _inputs(device=device)
    b1 = torch.randn(w1.shape[0], w1.shape[1], device=device) * 0.1
    b2 = torch.randn(w2.shape[0], w2.shape[1], device=device) * 0.1
    out, hpre, *meta = library.moe_mlp_fwd(*_forward_args(x, index, weights, w1, w2, backend, b1=b1, b2=b2))
    grad_out = torch.randn_like(out)
    core = _core_args(
        grad_out, x, weights, w1, w2, hpre, meta, backend, [False, True, True, False, True], b2=b2
    )
    _opcheck(library.moe_mlp_bwd, core)
    _, _, grad_hpre, _, magnitudes = library.moe_mlp_bwd(*core)
    state, hyper = _state(b2)
    update = (
        "down_proj_bias", b2, grad_out, None, weights, list(meta), magnitudes if backend == "triton" else None,
        "update", state, hyper, None, False, torch.float32, True, False, False, backend, "concatenated",
    )  # fmt: skip
    _opcheck(library.expert_wgrad_, update)
    before = b2.clone()
    library.expert_wgrad_(*update)
    assert float(state[2]) == 1.0 and not torch.equal(b2, before)
    grad_b1 = library.expert_wgrad(
        "gate_up_proj_bias", b1, grad_hpre, None, weights, list(meta), backend, "concatenated"
    )
    assert grad_b1.shape == b1.shape  # the other bias's ordinary gradient


def test_check_op_passes_opcheck_and_raises_unless_the_backward_accumulates_the_weights_gradient():
    w = torch.randn(2, 4, 3)
    step = torch.zeros((), dtype=torch.float32)
    torch.library.opcheck(
        library.check_update_requested, (w, step, "w"), test_utils=("test_schema", "test_faketensor")
    )

    def loss_with_check(weight, x):
        # A node whose backward runs the check against its own next functions (weight's AccumulateGrad).
        class Checked(torch.autograd.Function):
            @staticmethod
            def forward(ctx, weight, x):
                return (weight.sum(0) * x).sum()

            @staticmethod
            def backward(ctx, grad):
                library.check_update_requested(weight, step, "w")
                return grad * x.expand_as(weight), grad * weight.sum(0)

        return Checked.apply(weight, x)

    weight, x = w.clone().requires_grad_(), torch.randn(4, 3, requires_grad=True)
    loss_with_check(weight, x).backward()  # accumulated in .grad: no error
    assert weight.grad is not None
    with pytest.raises(RuntimeError, match="does not compute the gradient of the expert tensor"):
        torch.autograd.grad(loss_with_check(weight, x), [x])
    with pytest.raises(RuntimeError, match="returns to its caller the gradient of the expert tensor"):
        torch.autograd.grad(loss_with_check(weight, x), [weight, x])
    assert torch.equal(step, torch.zeros(()))
