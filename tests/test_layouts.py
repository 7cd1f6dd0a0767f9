"""The expert weights' layouts (transposed, gate/up interleaved, gate and up separate tensors, both): forward, every gradient and the
in-backward update of each layout against the float64 reference on the same weights rearranged, here, into
the concatenated layout by plain indexing (an oracle independent of ``specs.gate_up_view``)."""

import pytest
import torch
from numerics import assert_close

import sonar_kernels
from sonar_kernels import reference
from sonar_kernels.ops import library
from sonar_kernels.specs import LAYOUTS, is_gated, mark_expert_tensors, parse_activation

E, H, I, T, TOP_K = 4, 24, 8, 12, 2
# The layouts with a gate (the ungated ones have their own tests below: their W1 has I rows, not 2I).
GATED_LAYOUTS = [layout for layout in LAYOUTS if is_gated(layout)]


def _flags(layout):
    return {"transposed": layout.endswith("_transposed"), "interleaved": layout.startswith("interleaved")}


# The names of the expert weights in the order to_layout returns them (up_proj: separate layouts only).
WEIGHT_NAMES = ("gate_up_proj", "down_proj", "up_proj")


def to_layout(w1, w2, layout):
    """Concatenated [E, 2I, H], [E, H, I] -> ``layout``'s tensors (new memory): (gate_up_proj, down_proj),
    or (gate, down_proj, up) for a separate layout."""
    tensors = [w1, w2]
    if layout.startswith("interleaved"):
        tensors[0] = torch.stack((w1[:, :I], w1[:, I:]), dim=2).flatten(1, 2)  # gate 0, up 0, gate 1, ...
    if layout.startswith("separate"):
        tensors = [w1[:, :I], w2, w1[:, I:]]
    if layout.endswith("_transposed"):
        tensors = [t.transpose(1, 2) for t in tensors]
    return tuple(t.contiguous() for t in tensors)


def to_concatenated(tensors, layout):
    """``layout``'s tensors -> concatenated [E, 2I, H], [E, H, I]; differentiable."""
    if layout.endswith("_transposed"):
        tensors = [t.transpose(1, 2) for t in tensors]
    w1, w2 = tensors[:2]
    if layout.startswith("interleaved"):
        w1 = torch.cat((w1[:, 0::2], w1[:, 1::2]), dim=1)
    if layout.startswith("separate"):
        w1 = torch.cat((w1, tensors[2]), dim=1)
    return w1, w2


def weights_of(tensors):
    """The weights as moe_mlp's keywords."""
    return dict(zip(WEIGHT_NAMES, tensors, strict=False))


def _inputs(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=generator)
    # Expert 1 gets no token: its rows of the gradient are 0, its update is weight decay alone.
    index = torch.randint(0, E - 1, (T, TOP_K), generator=generator)
    index[index == 1] = E - 1
    weights = torch.rand(T, TOP_K, generator=generator)
    w1 = torch.randn(E, 2 * I, H, generator=generator) * H**-0.5
    w2 = torch.randn(E, H, I, generator=generator) * I**-0.5
    return x.to(dtype), index, weights.to(dtype), w1.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("layout", GATED_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_every_layout_matches_the_float64_reference(backend, dtype, layout):
    x, index, weights, w1, w2 = _inputs(dtype)
    leaves = [t.clone().requires_grad_() for t in (x, weights, *to_layout(w1, w2, layout))]
    out = sonar_kernels.moe_mlp(
        leaves[0], index, leaves[1], **weights_of(leaves[2:]), backend=backend, **_flags(layout)
    )
    exact = [t.detach().double().requires_grad_() for t in leaves]
    expected = reference.moe_mlp(exact[0], index, exact[1], *to_concatenated(exact[2:], layout))
    assert_close(out, expected, dtype)
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(grad_out)
    expected.backward(grad_out.double())
    for name, leaf, ref in zip(("x", "top_k_weights", *WEIGHT_NAMES), leaves, exact, strict=False):
        assert leaf.grad.shape == leaf.shape and leaf.grad.stride() == leaf.stride(), name
        assert_close(leaf.grad, ref.grad, dtype, what=name)


# Every layout on the fused epilogue and on the torch backend; the split path and gradient accumulation
# (an accumulation buffer with the weight's strides) on the layout with the most strides to get wrong.
UPDATE_CASES = [
    *((backend, True, 1, layout) for layout in GATED_LAYOUTS for backend in ("triton", "torch")),
    ("triton", False, 1, "interleaved_transposed"),
    ("triton", True, 2, "interleaved_transposed"),
    ("torch", True, 2, "interleaved_transposed"),
    ("triton", False, 1, "separate_transposed"),
    ("triton", True, 2, "separate"),
]


@pytest.mark.parametrize("backend, fused_epilogue, accumulation_steps, layout", UPDATE_CASES)
def test_every_layout_is_updated_in_place_like_torch_adamw(
    backend, fused_epilogue, accumulation_steps, layout
):
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    x, index, weights, w1, w2 = _inputs(torch.float32)
    params = [torch.nn.Parameter(w) for w in to_layout(w1, w2, layout)]
    addresses = [p.data_ptr() for p in params]
    mark_expert_tensors(*params)
    optimizer = sonar_kernels.ExpertAdamW(
        params, **hyper, fused_epilogue=fused_epilogue, accumulation_steps=accumulation_steps
    )
    exact = [torch.nn.Parameter(p.detach().double()) for p in params]
    torch_adamw = torch.optim.AdamW(exact, **hyper)
    for step in range(2):
        for micro in range(accumulation_steps):
            grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(10 * step + micro))
            sonar_kernels.moe_mlp(
                x, index, weights, **weights_of(params), backend=backend, **_flags(layout)
            ).backward(grad_out)
            expected = reference.moe_mlp(x.double(), index, weights.double(), *to_concatenated(exact, layout))
            expected.backward(grad_out.double())
        assert all(p.grad is None for p in params)  # updated in the backward, no gradient kept
        optimizer.step()
        torch_adamw.step()
        torch_adamw.zero_grad()
    for name, p, ref, address in zip(WEIGHT_NAMES, params, exact, addresses, strict=False):
        assert p.data_ptr() == address  # in place
        state = optimizer.state[p]
        assert state["exp_avg"].stride() == p.stride() and float(state["step"]) == 2
        assert_close(p, ref, torch.float32, what=name)
        assert_close(
            state["exp_avg"], torch_adamw.state[ref]["exp_avg"], torch.float32, what=f"{name} exp_avg"
        )
        assert_close(
            state["exp_avg_sq"],
            torch_adamw.state[ref]["exp_avg_sq"],
            torch.float32,
            what=f"{name} exp_avg_sq",
        )


def test_grouped_mlp_takes_the_layouts():
    x, _, _, w1, w2 = _inputs(torch.float32)
    counts = torch.tensor([5, 0, 4, 3])
    expected = sonar_kernels.grouped_mlp(x, counts, w1, w2, backend="torch")
    for layout in GATED_LAYOUTS:
        out = sonar_kernels.grouped_mlp(
            x, counts, **weights_of(to_layout(w1, w2, layout)), backend="torch", **_flags(layout)
        )
        # The same products; torch's GEMM may order the sums differently for other strides.
        assert_close(out, expected, torch.float32, what=layout)


def test_layout_shapes_and_flags_are_checked_before_any_kernel():
    x, index, weights, w1, w2 = _inputs(torch.float32)
    w1_t, w2_t = to_layout(w1, w2, "concatenated_transposed")
    with pytest.raises(ValueError, match=r"gate_up_proj.shape\[1\] must equal the hidden size H = 24"):
        sonar_kernels.moe_mlp(x, index, weights, w1, w2_t, backend="torch", transposed=True)
    with pytest.raises(ValueError, match=r"down_proj.shape\[2\] must equal the hidden size H = 24"):
        sonar_kernels.moe_mlp(x, index, weights, w1_t, w2, backend="torch", transposed=True)
    with pytest.raises(ValueError, match=r"gate_up_proj must be \[E, H, 2I\]"):
        sonar_kernels.moe_mlp(x, index, weights, w1_t[0], w2_t, backend="torch", transposed=True)
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="torch", interleaved="yes")


def bias_to_layout(b1, layout):
    """gate_up_proj_bias [E, 2I] with the gate entries first -> the layout's order."""
    if layout.startswith("interleaved"):
        return torch.stack((b1[:, :I], b1[:, I:]), dim=2).flatten(1, 2).contiguous()
    return b1.clone()


def bias_to_concatenated(b1, layout):
    return torch.cat((b1[:, 0::2], b1[:, 1::2]), dim=1) if layout.startswith("interleaved") else b1


def _check_against(out, expected, leaves, exact, names, dtype):
    """``out`` and, after one backward of the same gradient, every leaf's gradient (its shape, and its
    values at the dtype's tolerance) against the float64 ``expected`` and its leaves ``exact``."""
    assert_close(out, expected, dtype)
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(grad_out)
    expected.backward(grad_out.double())
    for name, leaf, ref in zip(names, leaves, exact, strict=True):
        assert leaf.grad.shape == leaf.shape, name
        assert_close(leaf.grad, ref.grad, dtype, what=name)


# gpt-oss's clamped SwiGLU, with a limit that the projections cross.
CLAMPED = sonar_kernels.clamped_swiglu(alpha=1.702, limit=0.5)


@pytest.mark.parametrize("layout", ["concatenated", "interleaved_transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_biases_and_the_clamped_swiglu_match_the_float64_reference(backend, dtype, layout):
    x, index, weights, w1, w2 = _inputs(dtype)
    generator = torch.Generator().manual_seed(2)
    b1 = (torch.randn(E, 2 * I, generator=generator) * 0.3).to(dtype)
    b2 = (torch.randn(E, H, generator=generator) * 0.3).to(dtype)
    leaves = [
        t.clone().requires_grad_()
        for t in (x, weights, *to_layout(w1, w2, layout), bias_to_layout(b1, layout), b2)
    ]
    out = sonar_kernels.moe_mlp(
        leaves[0], index, leaves[1], leaves[2], leaves[3], activation=CLAMPED, backend=backend,
        gate_up_proj_bias=leaves[4], down_proj_bias=leaves[5], **_flags(layout),
    )  # fmt: skip
    exact = [t.detach().double().requires_grad_() for t in leaves]
    expected = reference.moe_mlp(
        exact[0], index, exact[1], *to_concatenated(exact[2:4], layout), activation=CLAMPED,
        gate_up_proj_bias=bias_to_concatenated(exact[4], layout), down_proj_bias=exact[5],
    )  # fmt: skip
    # bf16: the biases' gradients sum rounded dHpre rows (as autograd's bias gradient does in bf16).
    names = ("x", "top_k_weights", "gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
    _check_against(out, expected, leaves, exact, names, dtype)
    # Expert 1 has no token: its biases get zero gradients.
    assert torch.equal(leaves[5].grad[1], torch.zeros(H, dtype=dtype))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_clamps_pass_the_gradient_at_their_bounds_as_torch_does(backend):
    # One token, one expert: Hpre = W1[0] @ e_0 is exactly the first column of W1, so the gate and up
    # values sit on the clamp's bounds (and beyond); torch's clamp passes the gradient at the bounds.
    limit = 2.0
    activation = sonar_kernels.clamped_swiglu(alpha=1.0, limit=limit)
    x = torch.zeros(1, H)
    x[0, 0] = 1.0
    w1 = torch.zeros(E, 2 * I, H)
    w1[0, :I, 0] = torch.tensor([limit, -limit, limit + 1, 0.5, limit, -3.0, 1.0, limit - 1e-3])  # gate
    w1[0, I:, 0] = torch.tensor([limit, -limit, limit, -limit - 1, 3.0, -limit, limit + 1e-3, 0.0])  # up
    w2 = torch.randn(E, H, I, generator=torch.Generator().manual_seed(0))
    index, weights = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    sonar_kernels.moe_mlp(
        leaves[0], index, weights, leaves[1], leaves[2], activation=activation, backend=backend
    ).sum().backward()
    exact = [t.double().requires_grad_() for t in (x, w1, w2)]
    reference.moe_mlp(
        exact[0], index, weights.double(), exact[1], exact[2], activation=activation
    ).sum().backward()
    assert_close(leaves[1].grad, exact[1].grad, torch.float32, what="gate_up_proj")
    # Where the reference's gradient is 0 (beyond a clamp), the kernels' is exactly 0 too.
    beyond = exact[1].grad[0, :, 0] == 0
    assert beyond.any() and torch.equal(leaves[1].grad[0, :, 0][beyond], torch.zeros(int(beyond.sum())))


def test_clamped_swiglu_names_and_refusals():
    assert sonar_kernels.clamped_swiglu(1.702, 7.0) == "clamped_swiglu(alpha=1.702, limit=7.0)"
    assert parse_activation("clamped_swiglu") == ("clamped_swiglu", 1.702, 7.0)
    assert parse_activation(sonar_kernels.clamped_swiglu(0.5, 3)) == ("clamped_swiglu", 0.5, 3.0)
    x, index, weights, w1, w2 = _inputs(torch.float32)
    for bad in ("clamped_swiglu(alpha=1.0, limit=0.0)", "clamped_swiglu(alpha=inf, limit=1.0)",
                "clamped_swiglu(alpha=a, limit=1.0)", "swiglu"):  # fmt: skip
        with pytest.raises(ValueError, match="activation"):
            sonar_kernels.moe_mlp(x, index, weights, w1, w2, activation=bad, backend="torch")


def test_bias_shapes_and_dtypes_are_checked_before_any_kernel():
    x, index, weights, w1, w2 = _inputs(torch.float32)
    for kwargs, error, words in (
        (
            {"gate_up_proj_bias": torch.zeros(E, I)},
            ValueError,
            r"gate_up_proj_bias must have shape \[4, 16\]",
        ),
        ({"down_proj_bias": torch.zeros(E, I)}, ValueError, r"down_proj_bias must have shape \[4, 24\]"),
        ({"down_proj_bias": torch.zeros(E, H, dtype=torch.float64)}, TypeError, "dtype of its weight"),
        ({"gate_up_proj_bias": [0.0]}, TypeError, "gate_up_proj_bias must be a torch.Tensor"),
    ):
        with pytest.raises(error, match=words):
            sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="torch", **kwargs)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_biases_are_updated_in_the_backward_like_torch_adamw(backend, monkeypatch):
    # A bias is an expert tensor too: updated inside the backward op (the Triton wgrad's epilogue), never
    # given a gradient that an optimizer hook would apply afterwards.
    returned = []
    run_expert_wgrad = library.run_expert_wgrad

    def recording(name, *args, **kwargs):
        grad = run_expert_wgrad(name, *args, **kwargs)
        if name.endswith("_bias"):
            returned.append((name, kwargs["mode"], grad))  # the tensor's mode, what its job returned
        return grad

    monkeypatch.setattr(library, "run_expert_wgrad", recording)
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    layout = "interleaved_transposed"
    x, index, weights, w1, w2 = _inputs(torch.float32)
    generator = torch.Generator().manual_seed(3)
    b1, b2 = torch.randn(E, 2 * I, generator=generator) * 0.3, torch.randn(E, H, generator=generator) * 0.3
    params = [torch.nn.Parameter(t) for t in (*to_layout(w1, w2, layout), bias_to_layout(b1, layout), b2)]
    mark_expert_tensors(*params)
    optimizer = sonar_kernels.ExpertAdamW(params, **hyper)
    exact = [torch.nn.Parameter(p.detach().double()) for p in params]
    torch_adamw = torch.optim.AdamW(exact, **hyper)
    for step in range(2):
        grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(step))
        sonar_kernels.moe_mlp(
            x, index, weights, params[0], params[1], activation=CLAMPED, backend=backend,
            gate_up_proj_bias=params[2], down_proj_bias=params[3], **_flags(layout),
        ).backward(grad_out)  # fmt: skip
        assert all(p.grad is None for p in params)  # every expert tensor updated in the backward
        assert all(float(optimizer.state[p]["step"]) == step + 1 for p in params)
        reference.moe_mlp(
            x.double(), index, weights.double(), *to_concatenated(exact[0:2], layout), activation=CLAMPED,
            gate_up_proj_bias=bias_to_concatenated(exact[2], layout), down_proj_bias=exact[3],
        ).backward(grad_out.double())  # fmt: skip
        optimizer.step()
        torch_adamw.step()
        torch_adamw.zero_grad()
    for name, p, ref in zip(
        ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"), params, exact, strict=True
    ):
        assert_close(p, ref, torch.float32, what=name)
    # Each bias's job updated it and returned no gradient, in each of the two backwards.
    assert sorted(returned) == [
        (name, "update", None) for name in ("down_proj_bias", "gate_up_proj_bias") for _ in range(2)
    ]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_experts_without_a_gate_match_the_float64_reference(backend, dtype, transposed):
    # Nemotron-H's experts: the up projection alone [E, I, H], the squared ReLU, here with biases.
    x, index, weights, _, w2 = _inputs(dtype)
    generator = torch.Generator().manual_seed(4)
    w1 = (torch.randn(E, I, H, generator=generator) * H**-0.5).to(dtype)
    b1 = (torch.randn(E, I, generator=generator) * 0.3).to(dtype)
    b2 = (torch.randn(E, H, generator=generator) * 0.3).to(dtype)
    stored = [w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()] if transposed else [w1, w2]
    leaves = [t.clone().requires_grad_() for t in (x, weights, *stored, b1, b2)]
    out = sonar_kernels.moe_mlp(
        leaves[0], index, leaves[1], leaves[2], leaves[3], activation="relu2", backend=backend, gated=False,
        transposed=transposed, gate_up_proj_bias=leaves[4], down_proj_bias=leaves[5],
    )  # fmt: skip
    exact = [t.detach().double().requires_grad_() for t in leaves]
    w1_exact, w2_exact = (exact[2].transpose(1, 2), exact[3].transpose(1, 2)) if transposed else exact[2:4]
    expected = reference.moe_mlp(
        exact[0], index, exact[1], w1_exact, w2_exact, activation="relu2", gated=False,
        gate_up_proj_bias=exact[4], down_proj_bias=exact[5],
    )  # fmt: skip
    names = ("x", "top_k_weights", "up_proj", "down_proj", "up_proj_bias", "down_proj_bias")
    _check_against(out, expected, leaves, exact, names, dtype)


@pytest.mark.parametrize("backend, fused_epilogue", [("triton", True), ("triton", False), ("torch", True)])
def test_experts_without_a_gate_are_updated_in_place_like_torch_adamw(backend, fused_epilogue):
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    x, index, weights, _, w2 = _inputs(torch.float32)
    w1 = torch.randn(E, I, H, generator=torch.Generator().manual_seed(4)) * H**-0.5
    params = [torch.nn.Parameter(w) for w in (w1, w2.clone())]
    mark_expert_tensors(*params)
    optimizer = sonar_kernels.ExpertAdamW(params, **hyper, fused_epilogue=fused_epilogue)
    exact = [torch.nn.Parameter(p.detach().double()) for p in params]
    torch_adamw = torch.optim.AdamW(exact, **hyper)
    for step in range(2):
        grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(step))
        sonar_kernels.moe_mlp(
            x, index, weights, *params, activation="relu2", backend=backend, gated=False
        ).backward(grad_out)
        assert all(p.grad is None for p in params)
        reference.moe_mlp(
            x.double(), index, weights.double(), *exact, activation="relu2", gated=False
        ).backward(grad_out.double())
        optimizer.step()
        torch_adamw.step()
        torch_adamw.zero_grad()
    for name, p, ref in zip(("up_proj", "down_proj"), params, exact, strict=True):
        assert_close(p, ref, torch.float32, what=name)


def test_an_ungated_layout_refuses_what_needs_a_gate():
    x, index, weights, _, w2 = _inputs(torch.float32)
    w1 = torch.randn(E, I, H)
    with pytest.raises(ValueError, match="interleaved=True needs gated=True"):
        sonar_kernels.moe_mlp(x, index, weights, w1, w2, backend="torch", gated=False, interleaved=True)
    with pytest.raises(ValueError, match="clamped_swiglu needs a gate"):
        sonar_kernels.moe_mlp(x, index, weights, w1, w2, activation=CLAMPED, backend="torch", gated=False)
    with pytest.raises(ValueError, match=r"gate_up_proj.shape\[1\] must be down_proj.shape\[2\] = I"):
        sonar_kernels.moe_mlp(x, index, weights, torch.randn(E, 2 * I, H), w2, backend="torch", gated=False)


def test_a_separate_up_tensor_is_checked_before_any_kernel():
    x, index, weights, w1, w2 = _inputs(torch.float32)
    gate, _, up = to_layout(w1, w2, "separate")
    with pytest.raises(ValueError, match=r"up_proj must have the strides of gate_up_proj"):
        sonar_kernels.moe_mlp(
            x, index, weights, gate, w2, up_proj=up.transpose(1, 2).contiguous().transpose(1, 2)
        )
    with pytest.raises(ValueError, match=r"up_proj must have the shape of gate_up_proj"):
        sonar_kernels.moe_mlp(x, index, weights, gate, w2, up_proj=up[:, :-1])
    with pytest.raises(TypeError, match=r"up_proj must have the dtype of gate_up_proj"):
        sonar_kernels.moe_mlp(x, index, weights, gate, w2, up_proj=up.double())
    with pytest.raises(TypeError, match=r"up_proj must be a torch.Tensor"):
        sonar_kernels.moe_mlp(x, index, weights, gate, w2, up_proj=up.tolist())
    with pytest.raises(ValueError, match=r"up_proj .* cannot be combined with interleaved=True"):
        sonar_kernels.moe_mlp(x, index, weights, gate, w2, up_proj=up, interleaved=True)
    with pytest.raises(ValueError, match=r"up_proj .* cannot be combined with gated=False"):
        sonar_kernels.moe_mlp(x, index, weights, gate, w2, up_proj=up, gated=False)
    with pytest.raises(ValueError, match=r"gate_up_proj_bias with a separate up_proj is not supported"):
        sonar_kernels.moe_mlp(
            x, index, weights, gate, w2, up_proj=up, gate_up_proj_bias=torch.zeros(E, 2 * I)
        )
    # gate_up_proj is the gate alone with up_proj: [E, I, H], not [E, 2I, H].
    with pytest.raises(ValueError, match=r"gate_up_proj.shape\[1\] must be down_proj.shape\[2\] = I"):
        sonar_kernels.moe_mlp(x, index, weights, w1, w2, up_proj=torch.zeros_like(w1))
    # A gate and an up view of one tensor (the kernels address both from one pointer).
    out = sonar_kernels.moe_mlp(x, index, weights, w1[:, :I], w2, up_proj=w1[:, I:], backend="triton")
    assert_close(
        out, reference.moe_mlp(x.double(), index, weights.double(), w1.double(), w2.double()), torch.float32
    )
    # The up tensor before the gate in memory: a negative half stride.
    swapped = torch.cat((w1[:, I:], w1[:, :I]), dim=1)
    out = sonar_kernels.moe_mlp(x, index, weights, w1[:, I:], w2, up_proj=w1[:, :I], backend="triton")
    expected = reference.moe_mlp(x.double(), index, weights.double(), swapped.double(), w2.double())
    assert_close(out, expected, torch.float32)
