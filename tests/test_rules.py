"""The composed update rule (sonar_kernels/rules/update.py) compiled by torch.compile gives the bits of the
same rule run op by op, for every state kind; a compiler that fails leaves the rule op by op, with one
warning. The op-by-op rule itself is checked against independent references in test_moments_8bit.py,
test_master_weights*.py and test_expert_clipping.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from sonar_kernels.rules import compiled as compiled_rules
from sonar_kernels.rules import master_weights as mw
from sonar_kernels.rules import moments_8bit as q8
from sonar_kernels.rules.adamw import adamw_scalars
from sonar_kernels.rules.update import adamw_update, adamw_update_, remainder_merge, remainder_split_

# [E, R, C] of exactly the size from which the rule is compiled.
SHAPE = (4, 64, compiled_rules.COMPILE_MIN_ELEMENTS // (4 * 64))


def _state(moments: str, master: str, weight_dtype: torch.dtype, clip: bool, seed: int):
    """(weight, grad, moments, hyper, master kwargs) with the edge values the rules treat apart: signed
    zeros, subnormals, a block of zeros, remainders at a tie."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(SHAPE, generator=gen)
    weight.view(-1)[:8] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.0, -3.0, 1e30, -1e-30])
    grad = torch.randn(SHAPE, generator=gen) * 1e-2
    grad.view(-1)[8:16] = torch.tensor([0.0, -0.0, 1e-40, 5.0, -5.0, 1e-20, 0.0, 2.0])
    grad[0, 0, :32] = 0.0
    grad = grad.to(torch.bfloat16).float() if weight_dtype == torch.bfloat16 else grad
    m = torch.randn(SHAPE, generator=gen) * 1e-3
    v = torch.rand(SHAPE, generator=gen) * 1e-5
    m[0, 0, :32] = 0.0
    v[0, 0, :32] = 0.0
    v.view(-1)[64:72] = 1e-42
    if moments == "8bit":
        state = (*q8.quantize(m, "exp_avg"), *q8.quantize(v, "exp_avg_sq"))
    else:
        dtype = torch.float32 if moments == "fp32" else torch.bfloat16
        state = (m.to(dtype), v.to(dtype))
    hyper = [1e-3, 0.9, 0.999, 1e-8, 0.01] + ([4.0, 0.5] if clip else [])
    hyper = torch.tensor(hyper, dtype=torch.float64)
    extra = {}
    if master == "remainder":
        bits = torch.randint(-(2**15), 2**15, SHAPE, generator=gen, dtype=torch.int32)
        bits.view(-1)[:4] = -(2**15)  # ties of the split
        extra["remainder"] = bits.to(torch.int16)
        weight = weight.to(torch.bfloat16)
    elif master == "stochastic":
        extra.update(seed=torch.tensor(mw.tensor_seed(7, 3)), step=torch.tensor(5.0))
        if moments == "fp32":  # each element's counter given, or the first one's (a contiguous slice)
            extra["index"] = torch.arange(weight.numel(), dtype=torch.int64).reshape(SHAPE) + 1000
        else:
            extra["first_index"] = torch.tensor(1000)
        weight = weight.to(torch.bfloat16)
    else:
        weight = weight.to(weight_dtype)
    return weight, grad, state, hyper, extra


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (signed zeros and NaN payloads count)."""
    return a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


# One graph each (a cold compilation is seconds, paid by the suite): every moments kind and master kind,
# clipping on half of them, both weight dtypes of the plain kind. 8-bit moments with stochastic rounding
# compile the stages of these (the 8-bit math of the remainder kind without its merge, the stochastic store
# of the exact kinds).
KINDS = [
    ("8bit", "none", torch.float32, False),
    ("8bit", "none", torch.bfloat16, True),
    ("8bit", "remainder", torch.bfloat16, True),
    ("fp32", "stochastic", torch.bfloat16, True),
    ("bf16", "stochastic", torch.bfloat16, False),
]


@pytest.mark.parametrize("moments,master,weight_dtype,clip", KINDS)
def test_the_compiled_rule_gives_the_bits_of_the_rule_op_by_op(
    moments, master, weight_dtype, clip, monkeypatch
):
    monkeypatch.setenv("SONAR_KERNELS_COMPILE", "1")
    assert not (adamw_update.moments._failed or adamw_update.master._failed)
    scalars = adamw_scalars(
        torch.tensor(5.0), torch.tensor([1e-3, 0.9, 0.999, 1e-8, 0.01], dtype=torch.float64)
    )
    tables = q8.tables()
    for found in (False, True):
        runs = []
        for compiled in (False, True):
            weight, grad, state, hyper, extra = _state(moments, master, weight_dtype, clip, seed=0)
            before = [t.clone() for t in (weight, *state, *extra.values())]
            args = (weight, grad, state, scalars, hyper, torch.tensor(found), tables)
            kwargs = {"grad_dtype": weight_dtype if master == "none" else torch.bfloat16, **extra}
            if compiled:
                assert adamw_update.wanted(weight.numel(), weight.device)
                count = adamw_update(True, *args, **kwargs)
            else:
                count = adamw_update_(*args, **kwargs)
            after = [weight, *state, *extra.values()]
            runs.append((after, count))
            if found:  # a skipped update changes nothing
                for b, a in zip(before, after, strict=True):
                    assert _same_bits(a, b)
                assert int(count) == 0
        (eager, eager_count), (fast, fast_count) = runs
        for a, b in zip(eager, fast, strict=True):
            assert _same_bits(a, b)
        assert int(eager_count) == int(fast_count)
        if clip and not found:
            assert int(fast_count) > 0  # the spike rule fired: the clipped path is exercised
    # compiled, not fallen back
    assert not (adamw_update.moments._failed or adamw_update.master._failed)
    assert adamw_update.moments._seen and (master == "none" or adamw_update.master._seen)


def test_the_compiled_merge_and_split_give_the_bits_of_the_rules():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(SHAPE, generator=gen).to(torch.bfloat16)
    weight.view(-1)[:4] = torch.tensor([0.0, -0.0, 0.0, -0.0])
    remainder = torch.randint(-(2**15), 2**15, SHAPE, generator=gen, dtype=torch.int32).to(torch.int16)
    remainder.view(-1)[:4] = torch.tensor([-5, 5, -(2**15), 7], dtype=torch.int16)  # stale across a zero
    assert remainder_merge.wanted(weight.numel(), weight.device)
    master = remainder_merge(True, weight, remainder)
    assert _same_bits(master, mw.merge(weight, remainder))
    master = master * 1.0001 - 1e-3
    master.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-40, -3.0])
    bits = master.view(torch.int32).view(-1)
    bits[4:8] = (bits[4:8] & ~0xFFFF) | 0x8000  # exact ties of the split
    new_weight, new_remainder = torch.empty_like(weight), torch.empty_like(remainder)
    remainder_split_(True, master, new_weight, new_remainder)
    expected = mw.split(master)
    assert _same_bits(new_weight, expected[0]) and _same_bits(new_remainder, expected[1])


def test_a_failing_compiler_leaves_the_rule_op_by_op_with_one_warning(monkeypatch):
    rule = compiled_rules.CompiledRule(adamw_update_, lambda *args, **kwargs: ())

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", lambda *a, **k: broken)
    monkeypatch.setenv("SONAR_KERNELS_COMPILE", "1")
    scalars = adamw_scalars(
        torch.tensor(1.0), torch.tensor([1e-3, 0.9, 0.999, 1e-8, 0.0], dtype=torch.float64)
    )
    results = []
    for use in (rule, None):
        weight, grad, state, hyper, _ = _state("8bit", "none", torch.float32, False, seed=1)
        args = (weight, grad, state, scalars, hyper[:5], torch.tensor(False), q8.tables())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if use is None:
                adamw_update_(*args, grad_dtype=torch.float32)
            else:
                use(True, *args, grad_dtype=torch.float32)
                use(True, *args, grad_dtype=torch.float32)  # no second warning
                weight, grad, state, hyper, _ = _state("8bit", "none", torch.float32, False, seed=1)
                args = (weight, grad, state, scalars, hyper[:5], torch.tensor(False), q8.tables())
                use(True, *args, grad_dtype=torch.float32)
        if use is not None:
            messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            assert len(messages) == 1 and "no C++ compiler" in messages[0] and "op by op" in messages[0]
        results.append((weight, *state))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_a_call_the_rule_refuses_raises_its_own_error_not_a_compiler_warning(monkeypatch):
    monkeypatch.setenv("SONAR_KERNELS_COMPILE", "1")
    rule = compiled_rules.CompiledRule(adamw_update_, lambda *args, **kwargs: ())
    weight, grad, state, hyper, _ = _state("8bit", "none", torch.float32, False, seed=2)
    scalars = torch.zeros(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError):  # codes of a shape the blocks cannot hold
            rule(True, weight, grad, (state[0][..., :31], *state[1:]), scalars, hyper,
                 torch.tensor(False), q8.tables(), grad_dtype=torch.float32)  # fmt: skip
    assert not rule._failed


def test_under_a_dispatch_mode_or_a_compiler_trace_the_rule_runs_op_by_op(monkeypatch):
    # torch's MemTracker and FakeTensorMode are dispatch modes: they must see each op of the rule, which
    # compiled code does not dispatch; a compiler tracing the caller traces the rule's ops into its graph.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    monkeypatch.setenv("SONAR_KERNELS_COMPILE", "1")
    device = torch.device("cpu")
    assert adamw_update.wanted(SHAPE[0] * SHAPE[1] * SHAPE[2], device)
    with Seen():
        assert not adamw_update.wanted(SHAPE[0] * SHAPE[1] * SHAPE[2], device)
        assert not remainder_merge.wanted(SHAPE[0] * SHAPE[1] * SHAPE[2], device)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not adamw_update.wanted(SHAPE[0] * SHAPE[1] * SHAPE[2], device)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert not adamw_update.wanted(SHAPE[0] * SHAPE[1] * SHAPE[2], torch.device("meta"))
    assert not adamw_update.wanted(SHAPE[0] * SHAPE[1] * SHAPE[2] - 1, device)  # below the threshold
    monkeypatch.setenv("SONAR_KERNELS_COMPILE", "0")
    assert not adamw_update.wanted(SHAPE[0] * SHAPE[1] * SHAPE[2], device)
