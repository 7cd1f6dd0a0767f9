"""bf16 master weights (a remainder, or stochastic rounding) with every moments option: bf16 and 8-bit
moments beside the fp32 ones of tests/test_master_weights_optim.py (docs/design.md, "bf16 master weights").

The reference is the documented rule composed from the scheme's own pieces, fed the gradients each backend
computes from the current bf16 weights: the master merged from the weight and its remainder
(``rules.master_weights.merge``) or the bf16 weight read as fp32; AdamW (torch.optim.AdamW on an fp32 copy
for a remainder with bf16 moments, the "fp64" arithmetic for everything with 8-bit moments or stochastic
rounding); the moments rounded to bf16 or requantized (``rules.moments_8bit.quantize``); the master split
again or rounded stochastically at the tensor's seed, the step and each element's offset.
"""

import pytest
import torch
from cases import Case
from numerics import rel_err

import sonar_kernels
from sonar_kernels.rules import adamw as rules_adamw
from sonar_kernels.rules import master_weights as mw
from sonar_kernels.rules import moments_8bit as q8

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# W1 [E, 64, 96], W2 [E, 96, 32]: last dimensions of whole 8-bit blocks.
SHAPE = Case(16, 96, 32, 4, 2)
SEED = 7
COMBOS = [
    ("remainder", torch.bfloat16),
    ("remainder", "8bit"),
    ("stochastic", torch.bfloat16),
    ("stochastic", "8bit"),
]


def _inputs(steps: int):
    torch.manual_seed(0)
    x, index, weights, w1, w2 = SHAPE.make(torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(SHAPE.T, SHAPE.H, generator=generator).to(torch.bfloat16) for _ in range(steps)]
    return x, index, weights, w1, w2, grads


def _train(mode, moments, steps, backend="torch", fused=True):
    x, index, weights, w1, w2, grads = _inputs(steps)
    params = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
    optimizer = sonar_kernels.ExpertAdamW(
        params, master_weights=mode, moments_dtype=moments, rounding_seed=SEED, fused_epilogue=fused, **HYPER
    )
    for grad_out in grads:
        sonar_kernels.moe_mlp(x, index, weights, *params, backend=backend).backward(grad_out)
        optimizer.step()
    return params, optimizer


def _moments_of(state: dict, moments) -> tuple:
    if moments == "8bit":
        return tuple(
            state[f"{key}_{part}"] for key in ("exp_avg", "exp_avg_sq") for part in ("codes", "scales")
        )
    return state["exp_avg"], state["exp_avg_sq"]


def _rule_start(tensors, moments):
    """The rule's state before its first step for ``tensors`` (the bf16 weights): the [5] fp64
    hyperparameters, zero remainders, zero moments (bf16 or fp32, or 8-bit codes and scales), and for a
    remainder with exact moments torch.optim.AdamW(fused=True) on fp32 masters (ExpertAdamW's default on the
    CPU), the bf16 weights their first values."""
    hyper = torch.tensor(
        [HYPER["lr"], *HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]], dtype=torch.float64
    )
    remainders = [torch.zeros(w.shape, dtype=torch.int16) for w in tensors]
    if moments == "8bit":
        state = [(*q8.quantize(torch.zeros(w.shape), "exp_avg"), *q8.quantize(torch.zeros(w.shape), "exp_avg_sq"))
                 for w in tensors]  # fmt: skip
    else:
        state = [(torch.zeros(w.shape, dtype=moments), torch.zeros(w.shape, dtype=moments)) for w in tensors]
    masters = [torch.nn.Parameter(w.float()) for w in tensors]
    return hyper, remainders, state, masters, torch.optim.AdamW(masters, **HYPER, fused=True)


def _rule(mode, moments, steps, backend):
    """(the bf16 weights, their remainders or None, their moments as _moments_of gives them) after
    ``steps`` steps of the documented rule, fed the gradients ``backend`` computes from the rule's own
    bf16 weights."""
    x, index, weights, w1, w2, grads = _inputs(steps)
    tensors = [w1.clone(), w2.clone()]
    hyper, remainders, state, masters, torch_adamw = _rule_start(tensors, moments)
    for step, grad_out in enumerate(grads, start=1):
        copies = [w.clone().requires_grad_() for w in tensors]
        sonar_kernels.moe_mlp(x, index, weights, *copies, backend=backend).backward(grad_out)
        scalars = rules_adamw.adamw_scalars(torch.tensor(float(step)), hyper)
        for ordinal, copy in enumerate(copies):
            g = copy.grad.float()
            if mode == "remainder" and moments == torch.bfloat16:
                masters[ordinal].grad = g
                torch_adamw.step()  # the other tensor has no gradient this call
                masters[ordinal].grad = None
                reference = torch_adamw.state[masters[ordinal]]
                for key in ("exp_avg", "exp_avg_sq"):
                    reference[key].copy_(reference[key].bfloat16())
                p = masters[ordinal].detach()
                state[ordinal] = (reference["exp_avg"].bfloat16(), reference["exp_avg_sq"].bfloat16())
            else:
                start = (
                    mw.merge(tensors[ordinal], remainders[ordinal])
                    if mode == "remainder"
                    else tensors[ordinal]
                )
                if moments == "8bit":
                    mc, ms, vc, vs = state[ordinal]
                    p, m, v = q8.adamw_8bit_update(start, g, (mc, ms), (vc, vs), scalars, hyper)
                    state[ordinal] = (*m, *v)
                else:
                    m, v = (t.float() for t in state[ordinal])
                    p, m, v = rules_adamw.adamw_fp64(start, g, m, v, scalars, hyper)
                    state[ordinal] = (m.to(moments), v.to(moments))
            if mode == "remainder":
                tensors[ordinal], remainders[ordinal] = mw.split(p.float())
            else:
                tensors[ordinal] = mw.stochastic_round(
                    p, mw.tensor_seed(SEED, ordinal), step, mw.element_index(p)
                )
    return tensors, (remainders if mode == "remainder" else None), state


def _assert_equal_to_rule(params, optimizer, rule, moments):
    tensors, remainders, state = rule
    for ordinal, p in enumerate(params):
        assert torch.equal(p.detach().view(torch.int16), tensors[ordinal].view(torch.int16))
        if remainders is not None:
            assert torch.equal(optimizer.state[p]["remainder"], remainders[ordinal])
        else:
            assert int(optimizer.state[p]["seed"]) == mw.tensor_seed(SEED, ordinal)
        for got, want in zip(_moments_of(optimizer.state[p], moments), state[ordinal], strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("chunk_experts", [None, 1])
@pytest.mark.parametrize(("mode", "moments"), COMBOS)
def test_the_torch_backend_follows_the_documented_rule_bitwise(mode, moments, chunk_experts, monkeypatch):
    # Whole, or one expert's gradient per chunk, over 6 steps.
    from sonar_kernels.ops.torch_backend import mlp as torch_backend

    if chunk_experts is not None:
        monkeypatch.setattr(torch_backend, "WGRAD_CHUNK_BYTES", 64 * 96 * 2)
    params, optimizer = _train(mode, moments, 6)
    _assert_equal_to_rule(params, optimizer, _rule(mode, moments, 6, "torch"), moments)
    for p in params:
        assert p.dtype == torch.bfloat16 and p.grad is None and float(optimizer.state[p]["step"]) == 6
        if mode == "remainder":  # the master holds bits the bf16 weight does not
            assert bool(optimizer.state[p]["remainder"].ne(0).any())


@pytest.mark.parametrize(("mode", "moments"), COMBOS)
def test_the_triton_epilogue_equals_its_split_path_and_the_rule(mode, moments):
    # Fused == split bitwise; against the rule fed the Triton backend's own gradients: bitwise in the
    # "fp64" arithmetic (8-bit moments, stochastic rounding), which both backends follow; a remainder with
    # bf16 moments takes the device's AdamW arithmetic ("fp64" on the CPU) where the rule runs torch's
    # fp32 AdamW: the masters agree to fp32 rounding (docs/design.md, "Arithmetic").
    steps = 3
    fused_params, fused = _train(mode, moments, steps, backend="triton")
    split_params, split = _train(mode, moments, steps, backend="triton", fused=False)
    for a, b in zip(fused_params, split_params, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        for key, value in fused.state[a].items():
            assert torch.equal(value, split.state[b][key]), key
    rule = _rule(mode, moments, steps, "triton")
    if (mode, moments) != ("remainder", torch.bfloat16):
        _assert_equal_to_rule(fused_params, fused, rule, moments)
        return
    tensors, remainders, state = rule
    for ordinal, p in enumerate(fused_params):
        master = mw.merge(p.detach(), fused.state[p]["remainder"])
        want = mw.merge(tensors[ordinal], remainders[ordinal])
        assert rel_err(master, want) <= 1e-6
        for got, reference in zip(_moments_of(fused.state[p], moments), state[ordinal], strict=True):
            assert got.dtype == torch.bfloat16 and rel_err(got.float(), reference.float()) <= 2**-8


@pytest.mark.parametrize(("mode", "moments"), COMBOS)
def test_a_skipped_update_leaves_weight_master_and_moments_untouched(mode, moments):
    # A gradient with a NaN: the update is skipped as a whole on both backends (weight, remainder or seed,
    # moments, step unchanged; the skip counted).
    for backend in ("torch", "triton"):
        params, optimizer = _train(mode, moments, 2, backend=backend)
        before = [p.detach().clone() for p in params]
        states = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in params]
        x, index, weights, *_ = _inputs(0)
        grad_out = torch.full((SHAPE.T, SHAPE.H), float("nan"), dtype=torch.bfloat16)
        sonar_kernels.moe_mlp(x, index, weights, *params, backend=backend).backward(grad_out)
        optimizer.step()
        for p, was, state in zip(params, before, states, strict=True):
            assert torch.equal(p.detach().view(torch.int16), was.view(torch.int16)), backend
            for key, value in state.items():
                assert torch.equal(optimizer.state[p][key], value), (backend, key)
        assert int(optimizer.expert_skipped_updates()) == len(params), backend


@pytest.mark.parametrize(("mode", "moments"), COMBOS)
def test_a_checkpoint_resumes_bitwise(mode, moments):
    steps = 4
    params, optimizer = _train(mode, moments, steps)
    x, index, weights, w1, w2, grads = _inputs(steps)
    resumed = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
    first = sonar_kernels.ExpertAdamW(
        resumed, master_weights=mode, moments_dtype=moments, rounding_seed=SEED, **HYPER
    )
    for grad_out in grads[:2]:
        sonar_kernels.moe_mlp(x, index, weights, *resumed, backend="torch").backward(grad_out)
        first.step()
    saved = first.state_dict()
    second = sonar_kernels.ExpertAdamW(
        resumed, master_weights=mode, moments_dtype=moments, rounding_seed=SEED + 1, **HYPER
    )  # the saved seeds win over a new rounding_seed
    second.load_state_dict(saved)
    for grad_out in grads[2:]:
        sonar_kernels.moe_mlp(x, index, weights, *resumed, backend="torch").backward(grad_out)
        second.step()
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        for key, value in optimizer.state[a].items():
            assert torch.equal(second.state[b][key], value), key


def test_a_torch_adamw_run_on_fp32_weights_resumes_with_its_masters_bitwise():
    # torch.optim.AdamW trains fp32 weights 3 steps; its state_dict and the fp32 weights load into an
    # ExpertAdamW on the bf16 copies (load_state_dict, load_fp32_masters); both go on 3 more steps, torch's
    # on fp32 masters whose documented bf16 rounding the forward reads: the masters stay bitwise equal.
    x, index, weights, w1, w2, grads = _inputs(6)
    masters = [torch.nn.Parameter(w.float()) for w in (w1, w2)]
    reference = torch.optim.AdamW(masters, **HYPER, fused=True)

    def reference_step(grad_out):
        copies = [mw.split(m.detach())[0].requires_grad_() for m in masters]
        sonar_kernels.moe_mlp(x, index, weights, *copies, backend="torch").backward(grad_out)
        for m, copy in zip(masters, copies, strict=True):
            m.grad = copy.grad.float()
        reference.step()

    for grad_out in grads[:3]:
        reference_step(grad_out)
    params = [torch.nn.Parameter(m.detach().bfloat16()) for m in masters]  # torch's cast: ties to even
    optimizer = sonar_kernels.ExpertAdamW(params, master_weights="remainder", **HYPER)
    optimizer.load_state_dict(reference.state_dict())
    optimizer.load_fp32_masters({p: m.detach() for p, m in zip(params, masters, strict=True)})
    for grad_out in grads[3:]:
        reference_step(grad_out)
        sonar_kernels.moe_mlp(x, index, weights, *params, backend="torch").backward(grad_out)
        optimizer.step()
        for p, m in zip(params, masters, strict=True):
            master = mw.merge(p.detach(), optimizer.state[p]["remainder"])
            assert torch.equal(master.view(torch.int32), m.detach().view(torch.int32))
    assert float(optimizer.state[params[0]]["step"]) == 6


def test_load_fp32_masters_refuses_before_writing_anything():
    p = torch.nn.Parameter(torch.randn(2, 8, 32).bfloat16())
    q = torch.nn.Parameter(torch.randn(2, 8, 32).bfloat16())
    optimizer = sonar_kernels.ExpertAdamW([p, q], master_weights="remainder")
    before = p.detach().clone()
    good = torch.randn(2, 8, 32)
    for bad, error in (
        (torch.randn(2, 8, 16), ValueError),
        (torch.randn(2, 8, 32).double(), TypeError),
        (torch.full((2, 8, 32), float("inf")), ValueError),
    ):
        with pytest.raises(error, match="load_fp32_masters"):
            optimizer.load_fp32_masters([(p, good), (q, bad)])
        assert torch.equal(p.detach(), before) and not optimizer.state[p]["remainder"].any()
    with pytest.raises(ValueError, match="not an expert tensor"):
        optimizer.load_fp32_masters({torch.nn.Parameter(good.bfloat16()): good})
    with pytest.raises(ValueError, match="master_weights=None"):
        sonar_kernels.ExpertAdamW([p]).load_fp32_masters({p: good})
    stochastic = sonar_kernels.ExpertAdamW([p], master_weights="stochastic")
    stochastic.load_fp32_masters({p: good})
    assert torch.equal(p.detach(), good.bfloat16())
