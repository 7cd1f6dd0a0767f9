"""ExpertAdamW and SonarAdamW with ``master_weights="remainder"`` (docs/design.md, "bf16 master weights"):
bf16 expert tensors whose fp32 master (weight and int16 remainder) follows torch.optim.AdamW on fp32 master
weights bit for bit on the torch backend (within the AdamW arithmetic's rounding on the Triton backend,
whose fused epilogue equals its split path bitwise), the forward reading the master's documented rounding;
checkpoints; the refusals."""

import pytest
import torch
from cases import Case
from numerics import rel_err

import sonar_kernels
from sonar_kernels.rules import adamw as rules_adamw
from sonar_kernels.rules import master_weights as mw

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# W1 [E, 64, 96], W2 [E, 96, 32]: whole experts' chunks on the torch backend.
SHAPE = Case(16, 96, 32, 4, 2)
STEPS = 20


def _inputs(device="cpu"):
    torch.manual_seed(0)
    x, index, weights, w1, w2 = SHAPE.make(torch.bfloat16, device=device)
    generator = torch.Generator().manual_seed(1)
    grads = [
        torch.randn(SHAPE.T, SHAPE.H, generator=generator).to(torch.bfloat16).to(device) for _ in range(STEPS)
    ]
    return x, index, weights, w1, w2, grads


@pytest.mark.parametrize("chunk_experts", [None, 1])
def test_the_master_follows_torch_adamw_on_fp32_masters_bitwise_over_20_steps(chunk_experts, monkeypatch):
    # The torch backend's in-backward update, whole or one expert per chunk (torch's fused AdamW by
    # chunks, each chunk's master merged and split again); the reference: torch.optim.AdamW(fused=True)
    # on fp32 masters, whose bf16 copies (the documented rounding) a separate forward reads.
    from sonar_kernels.ops.torch_backend import mlp as torch_backend

    if chunk_experts is not None:  # a chunk of one expert's gradient
        monkeypatch.setattr(torch_backend, "WGRAD_CHUNK_BYTES", 64 * 96 * 2)
    x, index, weights, w1, w2, grads = _inputs()
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    optimizer = sonar_kernels.ExpertAdamW([p1, p2], master_weights="remainder", **HYPER)
    masters = [torch.nn.Parameter(w.float()) for w in (w1, w2)]  # the bf16 weights are the first masters
    reference = torch.optim.AdamW(masters, **HYPER, fused=True)
    for grad_out in grads:
        copies = [mw.split(m.detach())[0].requires_grad_() for m in masters]
        sonar_kernels.moe_mlp(x, index, weights, *copies, backend="torch").backward(grad_out)
        for m, copy in zip(masters, copies, strict=True):
            m.grad = copy.grad.float()
        reference.step()
        sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend="torch").backward(grad_out)
        optimizer.step()
        for p, m in zip((p1, p2), masters, strict=True):
            state = optimizer.state[p]
            assert torch.equal(
                mw.merge(p.detach(), state["remainder"]).view(torch.int32), m.detach().view(torch.int32)
            )
            assert torch.equal(p.detach().view(torch.int16), mw.split(m.detach())[0].view(torch.int16))
    for p, m in zip((p1, p2), masters, strict=True):
        state, want = optimizer.state[p], reference.state[m]
        assert state["exp_avg"].dtype == torch.float32 and torch.equal(state["exp_avg"], want["exp_avg"])
        assert torch.equal(state["exp_avg_sq"], want["exp_avg_sq"]) and float(state["step"]) == STEPS
        assert p.grad is None and p.dtype == torch.bfloat16


def test_gradients_that_reach_grad_update_the_master_too():
    # A tensor used outside the MLP: its gradient reaches .grad and the same update applies.
    generator = torch.Generator().manual_seed(2)
    master = torch.randn(4, 8, 32, generator=generator)
    p = torch.nn.Parameter(master.to(torch.bfloat16))
    optimizer = sonar_kernels.ExpertAdamW([p], master_weights="remainder", **HYPER)
    m = torch.nn.Parameter(p.detach().float())
    reference = torch.optim.AdamW([m], **HYPER, fused=True)
    for _ in range(5):
        grad = torch.randn(master.shape, generator=generator).to(torch.bfloat16)
        (p * grad).sum().backward()
        m.grad = grad.float()
        reference.step()
        optimizer.step()
        assert torch.equal(mw.merge(p.detach(), optimizer.state[p]["remainder"]), m.detach())


def test_a_checkpoint_restores_the_remainder_and_one_without_it_starts_from_the_bf16_weight():
    x, index, weights, w1, w2, grads = _inputs()
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    optimizer = sonar_kernels.ExpertAdamW([p1, p2], master_weights="remainder", **HYPER)
    for grad_out in grads[:3]:
        sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend="torch").backward(grad_out)
        optimizer.step()
    saved = optimizer.state_dict()
    assert saved["state"][0]["remainder"].dtype == torch.int16
    restored = sonar_kernels.ExpertAdamW([p1, p2], master_weights="remainder", **HYPER)
    restored.load_state_dict(saved)
    for p in (p1, p2):
        for key in ("remainder", "exp_avg", "exp_avg_sq"):
            assert torch.equal(restored.state[p][key], optimizer.state[p][key]), key
        assert restored.state[p]["exp_avg"].dtype == torch.float32  # not torch's cast to the bf16 weight
    # torch.optim.AdamW's state dict (no remainder): the remainder starts at 0.
    plain = sonar_kernels.ExpertAdamW([p1, p2], master_weights="remainder", **HYPER)
    without = {
        **saved,
        "state": {k: {n: t for n, t in v.items() if n != "remainder"} for k, v in saved["state"].items()},
    }
    plain.load_state_dict(without)
    assert all(not plain.state[p]["remainder"].any() for p in (p1, p2))


def _train_triton(fused: bool, steps: int, device: str):
    x, index, weights, w1, w2, grads = _inputs(device)
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    optimizer = sonar_kernels.ExpertAdamW([p1, p2], master_weights="remainder", fused_epilogue=fused, **HYPER)
    for grad_out in grads[:steps]:
        sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend="triton").backward(grad_out)
        optimizer.step()
    return (p1, p2), optimizer


def test_the_triton_epilogue_equals_its_split_path_and_torch_adamw_on_fp32_masters_within_its_arithmetic(
    device,
):
    # The wgrad epilogue and the split path (bitwise equal), against torch.optim.AdamW(fused=True) on fp32
    # masters fed the same gradients (the Triton backend's own backward of the masters' bf16 copies): the
    # AdamW arithmetics differ in the last bits (docs/design.md, "Arithmetic"), so the masters agree to fp32
    # rounding and the weights to their bf16 rounding of those masters.
    steps = 3
    (f1, f2), fused = _train_triton(True, steps, device)
    (s1, s2), split = _train_triton(False, steps, device)
    for a, b in ((f1, s1), (f2, s2)):
        assert torch.equal(a, b)
        for key in ("remainder", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fused.state[a][key], split.state[b][key]), key
    x, index, weights, w1, w2, grads = _inputs(device)
    masters = [torch.nn.Parameter(w.float()) for w in (w1, w2)]
    reference = torch.optim.AdamW(masters, **HYPER, fused=True)
    for grad_out in grads[:steps]:
        copies = [mw.split(m.detach())[0].requires_grad_() for m in masters]
        sonar_kernels.moe_mlp(x, index, weights, *copies, backend="triton").backward(grad_out)
        for m, copy in zip(masters, copies, strict=True):
            m.grad = copy.grad.float()
        reference.step()
    for p, m in zip((f1, f2), masters, strict=True):
        master = mw.merge(p.detach(), fused.state[p]["remainder"])
        assert rel_err(master, m.detach()) <= 1e-6
        assert torch.equal(p.detach().view(torch.int16), mw.split(master)[0].view(torch.int16))
        ulp = torch.finfo(torch.bfloat16).eps * m.detach().abs()
        assert bool(((p.detach().float() - m.detach()).abs() <= ulp).all())
        assert bool(fused.state[p]["remainder"].ne(0).any())


def test_the_options_it_does_not_take_are_refused():
    bf16 = torch.nn.Parameter(torch.zeros(2, 8, 32, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="keeps bf16 expert tensors"):
        sonar_kernels.ExpertAdamW([torch.nn.Parameter(torch.zeros(2, 8, 32))], master_weights="remainder")
    with pytest.raises(ValueError, match='None, "remainder" or "stochastic"'):
        sonar_kernels.ExpertAdamW([bf16], master_weights="fp32")
    with pytest.raises(TypeError, match="rounding_seed must be an int"):
        sonar_kernels.ExpertAdamW([bf16], master_weights="stochastic", rounding_seed=1.5)


def test_sonar_adamw_passes_it_to_the_expert_tensors_and_trains_the_dense_ones_as_torch():
    torch.manual_seed(0)
    experts = sonar_kernels.SonarExperts(4, 32, 32, backend="torch").to(torch.bfloat16)
    head = torch.nn.Linear(32, 32, dtype=torch.bfloat16)
    model = torch.nn.ModuleDict({"experts": experts, "head": head})
    optimizer = sonar_kernels.SonarAdamW(model, master_weights="remainder", **HYPER)
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]] * 2)
    weights = torch.full((8, 2), 0.5, dtype=torch.bfloat16)
    for _ in range(3):
        head(experts(x, index, weights)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert len(optimizer.expert_tensors) == 2
    for p in optimizer.expert_tensors:
        state = optimizer.state[p]
        assert p.dtype == torch.bfloat16 and p.grad is None and float(state["step"]) == 3.0
        assert state["exp_avg"].dtype == torch.float32
        # The master holds bits the bf16 weight does not: lr 1e-2 steps are below bf16's resolution.
        assert bool(state["remainder"].ne(0).any())
        assert not torch.equal(mw.merge(p.detach(), state["remainder"]), p.detach().float())
    assert "remainder" not in optimizer.state[head.weight]


def _train_stochastic(seed: int, steps: int = 6, backend: str = "torch", device: str = "cpu"):
    x, index, weights, w1, w2, grads = _inputs(device)
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    optimizer = sonar_kernels.ExpertAdamW([p1, p2], master_weights="stochastic", rounding_seed=seed, **HYPER)
    for grad_out in grads[:steps]:
        sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend=backend).backward(grad_out)
        optimizer.step()
    return (p1, p2), optimizer


def _stochastic_reference(backend: str, steps: int, seed: int = 7, device: str = "cpu"):
    """The rule fed the gradients ``backend`` computes without an optimizer: each step, AdamW on the bf16
    weights read as fp32 in the "fp64" arithmetic (rules.adamw.adamw_fp64, fp32 moments), then
    rules.master_weights.stochastic_round with the tensor's documented seed, the step and each element's
    offset."""

    x, index, weights, w1, w2, grads = _inputs(device)
    hyper = torch.tensor(
        [HYPER["lr"], *HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]],
        dtype=torch.float64,
        device=device,
    )
    tensors = [w1.clone(), w2.clone()]
    moments = [(torch.zeros(w.shape, device=device), torch.zeros(w.shape, device=device)) for w in tensors]
    for step, grad_out in enumerate(grads[:steps], start=1):
        copies = [w.clone().requires_grad_() for w in tensors]
        sonar_kernels.moe_mlp(x, index, weights, *copies, backend=backend).backward(grad_out)
        scalars = rules_adamw.adamw_scalars(torch.tensor(float(step), device=device), hyper)
        for ordinal, copy in enumerate(copies):
            p, m, v = rules_adamw.adamw_fp64(
                tensors[ordinal], copy.grad.float(), *moments[ordinal], scalars, hyper
            )
            tensors[ordinal] = mw.stochastic_round(
                p, mw.tensor_seed(seed, ordinal), step, mw.element_index(p)
            )
            moments[ordinal] = (m, v)
    return tensors, moments


@pytest.mark.parametrize("chunk_experts", [None, 1])
def test_stochastic_rounding_on_the_torch_backend_is_the_documented_rule_bitwise(chunk_experts, monkeypatch):
    # Whole, or one expert's chunk at a time, over 6 steps.
    from sonar_kernels.ops.torch_backend import mlp as torch_backend

    if chunk_experts is not None:
        monkeypatch.setattr(torch_backend, "WGRAD_CHUNK_BYTES", 64 * 96 * 2)
    (p1, p2), optimizer = _train_stochastic(seed=7, steps=6)
    tensors, moments = _stochastic_reference("torch", 6)
    for ordinal, (p, w, (m, v)) in enumerate(zip((p1, p2), tensors, moments, strict=True)):
        assert int(optimizer.state[p]["seed"]) == mw.tensor_seed(7, ordinal)
        assert torch.equal(p.detach().view(torch.int16), w.view(torch.int16))
        assert torch.equal(optimizer.state[p]["exp_avg"], m) and torch.equal(
            optimizer.state[p]["exp_avg_sq"], v
        )


def test_stochastic_rounding_is_the_same_in_two_runs_with_one_seed_and_differs_with_another():
    (a1, a2), first = _train_stochastic(seed=3)
    (b1, b2), _ = _train_stochastic(seed=3)
    (c1, _), _ = _train_stochastic(seed=4)
    assert torch.equal(a1.view(torch.int16), b1.view(torch.int16)) and torch.equal(a2, b2)
    assert not torch.equal(a1.view(torch.int16), c1.view(torch.int16))
    # A checkpoint keeps the seeds.
    restored = sonar_kernels.ExpertAdamW([a1, a2], master_weights="stochastic", rounding_seed=99, **HYPER)
    restored.load_state_dict(first.state_dict())
    assert all(int(restored.state[p]["seed"]) == int(first.state[p]["seed"]) for p in (a1, a2))


def test_converting_the_experts_away_from_bf16_is_refused_at_their_next_forward():
    experts = sonar_kernels.SonarExperts(4, 32, 32, backend="torch").to(torch.bfloat16)
    optimizer = sonar_kernels.ExpertAdamW(experts.parameters(), master_weights="remainder", **HYPER)
    experts.float()
    x = torch.randn(8, 32)
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]] * 2)
    with pytest.raises(TypeError, match=r"was converted to torch\.float32"):
        experts(x, index, torch.full((8, 2), 0.5))
    assert all(float(optimizer.state[p]["step"]) == 0.0 for p in experts.parameters())


def test_stochastic_rounding_in_the_triton_epilogue_equals_its_split_path_and_the_rule_bitwise(device):
    # Fused == split == the rule (the torch backend's arithmetic) fed the Triton backend's own gradients,
    # bitwise, over 3 steps: the "fp64" arithmetic on both backends (docs/design.md, "bf16 master weights").
    (f1, f2), fused = _train_stochastic(seed=7, steps=3, backend="triton", device=device)
    x, index, weights, w1, w2, grads = _inputs(device)
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    split = sonar_kernels.ExpertAdamW(
        [p1, p2], master_weights="stochastic", rounding_seed=7, fused_epilogue=False, **HYPER
    )
    for grad_out in grads[:3]:
        sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend="triton").backward(grad_out)
        split.step()
    tensors, moments = _stochastic_reference("triton", 3, device=device)
    for a, b, w, (m, v) in zip((f1, f2), (p1, p2), tensors, moments, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert torch.equal(a.detach().view(torch.int16), w.view(torch.int16))
        assert torch.equal(fused.state[a]["exp_avg"], m) and torch.equal(split.state[b]["exp_avg_sq"], v)


def test_malformed_master_states_are_refused_before_anything_is_written():
    from sonar_kernels.ops import library
    from sonar_kernels.specs import ExpertUpdate

    weight = torch.zeros(2, 8, 32, dtype=torch.bfloat16)
    moments = [torch.zeros(2, 8, 32), torch.zeros(2, 8, 32)]
    counters = [
        torch.zeros(()),
        torch.zeros(()),
        torch.zeros((), dtype=torch.int64),
        torch.zeros((), dtype=torch.int64),
    ]
    hyper = torch.tensor([1e-2, 0.9, 0.95, 1e-8, 0.1], dtype=torch.float64)
    grad = torch.ones_like(weight)
    # 8-bit moments: int8 and uint8 codes, then their fp32 block scales after the counters.
    codes = [torch.zeros(2, 8, 32, dtype=torch.int8), torch.zeros(2, 8, 32, dtype=torch.uint8)]
    scales = [torch.zeros(2, 8, 1), torch.zeros(2, 8, 1)]
    cases = [
        (
            [*moments, *counters, torch.zeros(32, dtype=torch.int16)],
            weight,
            ValueError,
            "remainder has shape",
        ),
        (
            [*moments, *counters, torch.tensor(3, dtype=torch.int32)],
            weight,
            ValueError,
            "int16 remainder or a 0-dim",
        ),
        ([*moments, *counters, torch.tensor(3)], weight.float(), TypeError, "for a bf16 weight"),
        (
            [*codes, *counters, *scales, torch.zeros(32, dtype=torch.int16)],
            weight,
            ValueError,
            "remainder has shape",
        ),
        (
            [*codes, *counters, *(t.half() for t in scales), torch.tensor(3)],
            weight,
            ValueError,
            "fp32 scales",
        ),
        ([*codes, *counters, *scales, torch.tensor(3)], weight.float(), TypeError, "for a bf16 weight"),
    ]
    for state, w, error, message in cases:
        before = [t.clone() for t in (w, *state)]
        with pytest.raises(error, match=message):
            library.expert_adamw_(w, grad, None, state, hyper, False, False)
        assert all(torch.equal(a, b) for a, b in zip(before, (w, *state), strict=True))
    with pytest.raises(ValueError, match="not both"):
        ExpertUpdate(exp_avg=moments[0], exp_avg_sq=moments[1], step=counters[0], hyper=hyper, grad_norm_sq=counters[1],
                     skipped=counters[2], grad_dtype=torch.bfloat16, remainder=torch.zeros(2, 8, 32, dtype=torch.int16),
                     seed=torch.tensor(1))  # fmt: skip
