"""ExpertAdamW and SonarAdamW with ``moments_dtype="8bit"`` (docs/design.md, "8-bit moments"): the update each
backend applies equals the scheme's torch ops (sonar_kernels/rules/moments_8bit.py, tested against a float64
implementation in test_moments_8bit.py) fed the gradient that backend computes; the fused epilogue equals
the split path; checkpoints restore the state exactly and convert to and from torch.optim.AdamW."""

import pytest
import torch
from cases import Case

import sonar_kernels
from sonar_kernels.rules import adamw as rules_adamw
from sonar_kernels.rules import moments_8bit as q8

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# T, H, I, E, top_k: W1 [E, 64, 96] (a partial column tile of the wgrad kernel), W2 [E, 96, 32].
SHAPE = Case(16, 96, 32, 2, 2)
STEPS = 2


def _inputs(device, dtype=torch.float32, shape=SHAPE):
    torch.manual_seed(0)
    x, index, weights, w1, w2 = shape.make(dtype, device=device)
    grads = [
        torch.randn(shape.T, shape.H, generator=torch.Generator().manual_seed(s)).to(dtype).to(device)
        for s in range(STEPS)
    ]
    return x, index, weights, w1, w2, grads


def _train(backend, device, dtype=torch.float32, shape=SHAPE, **options):
    x, index, weights, w1, w2, grads = _inputs(device, dtype, shape)
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    optimizer = sonar_kernels.ExpertAdamW([p1, p2], moments_dtype="8bit", **HYPER, **options)
    for grad_out in grads:
        sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend=backend).backward(grad_out)
        optimizer.step()
    return (p1, p2), optimizer


def _reference(backend, device, dtype=torch.float32):
    """The scheme's torch ops fed the gradients ``backend`` computes without an optimizer."""
    x, index, weights, w1, w2, grads = _inputs(device, dtype)
    hyper = torch.tensor(
        [HYPER["lr"], *HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]], dtype=torch.float64
    )
    tensors = [w1.clone(), w2.clone()]
    states = [
        (q8.quantize(torch.zeros(w.shape), "exp_avg"), q8.quantize(torch.zeros(w.shape), "exp_avg_sq"))
        for w in tensors
    ]
    for step, grad_out in enumerate(grads, start=1):
        p1, p2 = (t.clone().requires_grad_() for t in tensors)
        sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend=backend).backward(grad_out)
        scalars = rules_adamw.adamw_scalars(torch.tensor(float(step)), hyper)
        for i, p in enumerate((p1, p2)):
            new_p, m, v = q8.adamw_8bit_update(
                tensors[i].cpu(),
                p.grad.float().cpu(),
                *[tuple(t.cpu() for t in s) for s in states[i]],
                scalars,
                hyper,
            )
            tensors[i] = new_p.to(dtype).to(device)
            states[i] = (m, v)
    return tensors, states


def _state_of(optimizer, p):
    s = optimizer.state[p]
    return ((s["exp_avg_codes"], s["exp_avg_scales"]), (s["exp_avg_sq_codes"], s["exp_avg_sq_scales"]))


@pytest.mark.usefixtures("wgrad_tiles_of_the_8bit_update")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_each_backend_applies_the_scheme_to_its_own_gradient(backend, device):
    params, optimizer = _train(backend, device)
    tensors, states = _reference(backend, device)
    for p, want, want_state in zip(params, tensors, states, strict=True):
        assert torch.equal(p.detach(), want)
        for got, expected in zip(_state_of(optimizer, p), want_state, strict=True):
            assert all(torch.equal(a.cpu(), b) for a, b in zip(got, expected, strict=True))
        assert float(optimizer.state[p]["step"]) == STEPS and p.grad is None


# The tests' shape, and issue 48's (E 4, H 128, I 64, 48 tokens, top-2, fp32), where the split path's wgrad
# on other tiles than the fused epilogue's differed in the last bits: neither pins the tiles.
@pytest.mark.parametrize("shape", [SHAPE, Case(48, 128, 64, 4, 2)], ids=["T16-H96-I32-E2", "T48-H128-I64-E4"])
def test_the_fused_epilogue_equals_the_split_path(shape, device):
    fused_params, fused = _train("triton", device, shape=shape, fused_epilogue=True)
    split_params, split = _train("triton", device, shape=shape, fused_epilogue=False)
    for a, b in zip(fused_params, split_params, strict=True):
        assert torch.equal(a, b)
        for x, y in zip(_state_of(fused, a), _state_of(split, b), strict=True):
            assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))


def test_the_state_is_codes_and_scales_and_biases_keep_exact_moments():
    weight = torch.nn.Parameter(torch.zeros(2, 8, 64))
    bias = torch.nn.Parameter(torch.zeros(2, 8))
    optimizer = sonar_kernels.ExpertAdamW([weight, bias], moments_dtype="8bit")
    assert {k: (v.dtype, tuple(v.shape)) for k, v in optimizer.state[weight].items()} == {
        "step": (torch.float32, ()),
        "exp_avg_codes": (torch.int8, (2, 8, 64)),
        "exp_avg_scales": (torch.float32, (2, 8, 2)),
        "exp_avg_sq_codes": (torch.uint8, (2, 8, 64)),
        "exp_avg_sq_scales": (torch.float32, (2, 8, 2)),
    }
    assert optimizer.state[bias]["exp_avg"].dtype == torch.float32
    with pytest.raises(ValueError, match="multiple of 32"):
        sonar_kernels.ExpertAdamW([torch.nn.Parameter(torch.zeros(2, 8, 48))], moments_dtype="8bit")
    with pytest.raises(TypeError, match='"8bit"'):
        sonar_kernels.ExpertAdamW([weight], moments_dtype="4bit")


def test_a_checkpoint_restores_codes_and_scales_exactly_and_converts_to_and_from_torch_adamw():
    params, optimizer = _train("torch", "cpu")
    saved = optimizer.state_dict()
    for state in saved["state"].values():
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_codes"].dtype == torch.int8
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    restored = sonar_kernels.ExpertAdamW(copies, moments_dtype="8bit", **HYPER)
    restored.load_state_dict(saved)
    for p, q in zip(params, copies, strict=True):
        for x, y in zip(_state_of(optimizer, p), _state_of(restored, q), strict=True):
            assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
    # Into torch.optim.AdamW: the dequantized moments.
    plain = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], **HYPER)
    plain.load_state_dict(saved)
    for p, q in zip(params, plain.param_groups[0]["params"], strict=True):
        m = q8.dequantize(*_state_of(optimizer, p)[0], "exp_avg")
        assert torch.equal(plain.state[q]["exp_avg"], m)
    # From torch.optim.AdamW: quantized by the scheme's rule.
    torch_state = {"state": {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(p.shape), "exp_avg_sq": torch.rand(p.shape)}
                             for i, p in enumerate(params)}, "param_groups": saved["param_groups"]}  # fmt: skip
    restored.load_state_dict(torch_state)
    for i, q in enumerate(copies):
        codes, scales = q8.quantize(torch_state["state"][i]["exp_avg"], "exp_avg")
        assert torch.equal(restored.state[q]["exp_avg_codes"], codes) and torch.equal(
            restored.state[q]["exp_avg_scales"], scales
        )
        assert float(restored.state[q]["step"]) == 3.0


@pytest.mark.usefixtures("wgrad_tiles_of_the_8bit_update")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_accumulated_micro_batches_equal_the_scheme_on_their_summed_gradient(backend, device):
    # Two micro-batches per step: the last one's update adds the first one's gradient (in .grad).
    x, index, weights, w1, w2, grads = _inputs(device)
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    optimizer = sonar_kernels.ExpertAdamW([p1, p2], moments_dtype="8bit", accumulation_steps=2, **HYPER)
    q1, q2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    for grad_out in grads:
        sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend=backend).backward(grad_out)
        sonar_kernels.moe_mlp(x, index, weights, q1, q2, backend=backend).backward(grad_out)
    optimizer.step()
    hyper = torch.tensor(
        [HYPER["lr"], *HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]], dtype=torch.float64
    )
    scalars = rules_adamw.adamw_scalars(torch.tensor(1.0), hyper)
    for p, q in ((p1, q1), (p2, q2)):
        zeros = (
            q8.quantize(torch.zeros(q.shape), "exp_avg"),
            q8.quantize(torch.zeros(q.shape), "exp_avg_sq"),
        )
        new_p, m, v = q8.adamw_8bit_update(q.detach().cpu(), q.grad.float().cpu(), *zeros, scalars, hyper)
        assert torch.equal(p.detach().cpu(), new_p)
        state = _state_of(optimizer, p)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(state[0] + state[1], m + v, strict=True))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_non_finite_gradient_skips_the_update_as_a_whole(backend, device):
    x, index, weights, w1, w2, grads = _inputs(device)
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    optimizer = sonar_kernels.ExpertAdamW([p1, p2], moments_dtype="8bit", **HYPER)
    sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend=backend).backward(grads[0])
    optimizer.step()
    before = {p: [t.clone() for t in (p.detach(), *optimizer.state[p].values())] for p in (p1, p2)}
    bad = grads[1].clone()
    bad[2, 3] = float("nan")
    sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend=backend).backward(bad)
    optimizer.step()
    for p in (p1, p2):
        assert all(
            torch.equal(a, b)
            for a, b in zip((p.detach(), *optimizer.state[p].values()), before[p], strict=True)
        )
    assert int(optimizer.expert_skipped_updates()) == 2


@pytest.mark.parametrize("chunk_experts", [1, None])
def test_the_torch_backends_chunks_give_the_same_bits_and_skip_as_a_whole(chunk_experts, monkeypatch):
    # Chunks of one expert (W1's is 64 x 96 fp32), or whole tensors: the same update; and a non-finite
    # gradient in the last expert's rows skips the whole tensor, decided before the first chunk is written.
    from sonar_kernels.ops.torch_backend import mlp as torch_backend

    monkeypatch.setattr(torch_backend, "WGRAD_CHUNK_BYTES", None if chunk_experts is None else 64 * 96 * 4)
    params, optimizer = _train("torch", "cpu")
    tensors, states = _reference("torch", "cpu")
    for p, want, want_state in zip(params, tensors, states, strict=True):
        assert torch.equal(p.detach(), want)
        for got, expected in zip(_state_of(optimizer, p), want_state, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    x, index, weights, *_ = _inputs("cpu")
    before = {p: [t.clone() for t in (p.detach(), *optimizer.state[p].values())] for p in params}
    bad = torch.zeros(SHAPE.T, SHAPE.H)
    bad[index[:, 0] == SHAPE.E - 1] = float("inf")  # tokens routed to the last expert
    sonar_kernels.moe_mlp(x, index, weights, *params, backend="torch").backward(bad)
    for p in params:
        assert all(
            torch.equal(a, b)
            for a, b in zip((p.detach(), *optimizer.state[p].values()), before[p], strict=True)
        )


@pytest.mark.usefixtures("wgrad_tiles_of_the_8bit_update")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_scheduled_tensor_lr_and_the_expert_grad_norm_with_8bit_moments(backend, device):
    # A tensor lr (torch.optim.AdamW's "lr as a Tensor") halved, then thirded, by LambdaLR between the
    # steps: each in-backward update reads the group's value at its backward. expert_grad_norm is the
    # norm of both tensors' gradients (computed here without an optimizer).
    x, index, weights, w1, w2, grads = _inputs(device)
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    optimizer = sonar_kernels.ExpertAdamW(
        [p1, p2], moments_dtype="8bit", **{**HYPER, "lr": torch.tensor(HYPER["lr"])}
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    tensors = [w1.clone(), w2.clone()]
    states = [
        (q8.quantize(torch.zeros(w.shape), "exp_avg"), q8.quantize(torch.zeros(w.shape), "exp_avg_sq"))
        for w in tensors
    ]
    for step, grad_out in enumerate(grads + grads[:1], start=1):
        lr = float(optimizer.param_groups[0]["lr"])
        assert lr == pytest.approx(HYPER["lr"] / step, rel=1e-6)
        q1, q2 = (t.clone().requires_grad_() for t in tensors)
        sonar_kernels.moe_mlp(x, index, weights, q1, q2, backend=backend).backward(grad_out)
        sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend=backend).backward(grad_out)
        optimizer.step()
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(q.grad.float()) for q in (q1, q2)])
        )
        torch.testing.assert_close(optimizer.expert_grad_norm().cpu(), norm.cpu(), rtol=1e-5, atol=0)
        hyper = torch.tensor([lr, *HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]], dtype=torch.float64)
        scalars = rules_adamw.adamw_scalars(torch.tensor(float(step)), hyper)
        for i, q in enumerate((q1, q2)):
            new_p, m, v = q8.adamw_8bit_update(
                tensors[i].cpu(), q.grad.float().cpu(), *[tuple(t.cpu() for t in s) for s in states[i]],
                scalars, hyper,
            )  # fmt: skip
            tensors[i], states[i] = new_p.to(device), (m, v)
        scheduler.step()
    for p, t, (m, v) in zip((p1, p2), tensors, states, strict=True):
        assert torch.equal(p.detach(), t)
        state = _state_of(optimizer, p)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(state[0] + state[1], m + v, strict=True))
