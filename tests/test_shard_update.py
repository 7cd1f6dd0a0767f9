"""The Triton update of an FSDP2 shard (``ops/triton_backend/shard_update.py``: one launch per tensor per step) with 8-bit
moments, a bf16 remainder or stochastic rounding: shards updated one at a time (FSDP2's Shard(0), each with
its offset in the whole tensor) equal the whole tensor's update bit for bit, and that equals the torch rules
(``ops/torch_backend/fp64_update.py``), under the Triton interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from sonar_kernels.ops.torch_backend.fp64_update import adamw_8bit_, stochastic_adamw_
from sonar_kernels.ops.triton_backend.shard_update import shard_update_triton_
from sonar_kernels.rules.moments_8bit import scales_shape

E, R, C = 4, 6, 64  # 4 experts of [6, 64]: shards of 2 experts (2 ranks) and of 1 (4 ranks)
HYPER = torch.tensor([3e-2, 0.9, 0.95, 1e-8, 0.1], dtype=torch.float64)


def _state(kind, weight):
    """The update's tensor list (ops/torch_backend/fp64_update.py's order) with moments of one earlier step's size."""
    g = torch.Generator().manual_seed(7)
    counters = [
        torch.tensor(1.0),
        torch.zeros(()),
        torch.zeros((), dtype=torch.int64),
        torch.zeros((), dtype=torch.int32),
    ]
    if kind == "stochastic":
        moments = [
            0.01 * torch.randn(weight.shape, generator=g),
            1e-4 * torch.rand(weight.shape, generator=g),
        ]
        return moments[:2] + counters + [torch.tensor(1234, dtype=torch.int64)]
    m_codes = torch.randint(-127, 128, weight.shape, dtype=torch.int8, generator=g)
    v_codes = torch.randint(0, 256, weight.shape, dtype=torch.uint8, generator=g)
    m_scales = 0.01 * torch.rand(scales_shape(tuple(weight.shape)), generator=g)
    v_scales = 1e-4 * torch.rand(scales_shape(tuple(weight.shape)), generator=g)
    extra = []
    if kind == "8bit-remainder":
        extra = [torch.randint(-(2**15), 2**15, weight.shape, dtype=torch.int16, generator=g)]
    if kind == "8bit-stochastic":
        extra = [torch.tensor(99, dtype=torch.int64)]
    return [m_codes, v_codes, *counters, m_scales, v_scales, *extra]


def _moments(kind, state):
    return tuple(state[:2]) if kind == "stochastic" else (state[0], state[6], state[1], state[7])


def _triton(kind, weight, grad, state, first, last):
    """Experts first .. last - 1 as one shard: its local tensors, its stream offset."""
    local = [t[first:last] if t.dim() > 0 else t for t in state]
    extra = local[8:] if kind != "stochastic" else []
    remainder = extra[0] if kind == "8bit-remainder" else None
    seed = local[6] if kind == "stochastic" else (extra[0] if kind == "8bit-stochastic" else None)
    shard_update_triton_(
        weight[first:last], grad[first:last], _moments(kind, local), local, HYPER,
        decided=torch.tensor(False), remainder=remainder, seed=seed, index_base=first * weight[0].numel(),
    )  # fmt: skip


def _clone(state):
    return [t.clone() for t in state]


def _bits(t):
    """A weight's bits: bf16 as int16 (NaN payloads and -0.0 compared too), fp32 as it is."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _problem(kind):
    """(weight, gradient, state) of ``kind``: fp32 weights for 8-bit moments alone, else bf16."""
    torch.manual_seed(0)
    dtype = torch.float32 if kind == "8bit" else torch.bfloat16
    weight = torch.randn(E, R, C).to(dtype)
    return weight, torch.randn(E, R, C).to(dtype), _state(kind, weight)


@pytest.mark.parametrize("kind", ["8bit", "8bit-remainder", "8bit-stochastic", "stochastic"])
@pytest.mark.parametrize("shards", [2, 4])
def test_sharded_update_equals_the_whole_tensors_and_the_torch_rule(kind, shards):
    torch.manual_seed(0)
    dtype = torch.float32 if kind == "8bit" else torch.bfloat16
    weight = torch.randn(E, R, C).to(dtype)
    grad = torch.randn(E, R, C).to(dtype)
    state = _state(kind, weight)
    whole_w, whole_s = weight.clone(), _clone(state)
    _triton(kind, whole_w, grad, whole_s, 0, E)  # one launch on the whole tensor
    sharded_w, sharded_s = weight.clone(), _clone(state)
    per = E // shards
    for rank in range(shards):  # each rank's launch on its own shard (same step and skip on every rank)
        part = _clone(sharded_s)
        part[2:6] = [t.clone() for t in state[2:6]]
        _triton(kind, sharded_w, grad, part, rank * per, (rank + 1) * per)
        for t, u in zip(sharded_s, part, strict=True):
            if t.dim() > 0:
                t[rank * per : (rank + 1) * per] = u[rank * per : (rank + 1) * per]
        sharded_s[2:6] = part[2:6]
    rule_w, rule_s = weight.clone(), _clone(state)
    update = stochastic_adamw_ if kind == "stochastic" else adamw_8bit_
    update(rule_w, grad, None, rule_s, HYPER, grad_dtype=dtype, chunk_bytes=None)
    assert not torch.equal(whole_w, weight)  # the update moved the weight
    for name, a, b in [("weight", sharded_w, whole_w), ("weight vs rule", whole_w, rule_w)]:
        assert torch.equal(
            a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
            b.view(torch.int16) if b.dtype == torch.bfloat16 else b,
        ), name
    for i, (a, b, c) in enumerate(zip(sharded_s, whole_s, rule_s, strict=True)):
        if i in (3, 5):  # grad_norm_sq: the caller's; clipped: per launch
            continue
        assert torch.equal(a, b), (kind, "sharded against whole", i)
        assert torch.equal(b, c), (kind, "whole against the torch rule", i)


@pytest.mark.parametrize("kind", ["8bit", "stochastic"])
def test_a_skipped_shard_update_changes_nothing_but_the_skip_count(kind):
    # decided (the whole gradient has a non-finite entry): weight, moments, step, clipped unchanged; skipped + 1.
    weight, grad, state = _problem(kind)
    before_w, before_s = weight.clone(), _clone(state)
    seed = state[6] if kind == "stochastic" else None
    shard_update_triton_(
        weight, grad, _moments(kind, state), state, HYPER, decided=torch.tensor(True), seed=seed, index_base=0
    )
    assert torch.equal(_bits(weight), _bits(before_w))
    for i, (a, b) in enumerate(zip(state, before_s, strict=True)):
        if i == 4:
            assert int(a) == int(b) + 1
        else:
            assert torch.equal(a, b), i


@pytest.mark.parametrize("kind", ["8bit", "stochastic"])
def test_a_clipped_shard_update_equals_the_torch_rule_count_included(kind):
    # The spike rule (hyperparameters [7]: spike_threshold 1.5, grad_scale 1): the whole tensor's launch
    # against the torch rule, the weight, the state and the count of entries the rule replaced.
    weight, grad, state = _problem(kind)
    grad = (3.0 * grad.float()).to(grad.dtype)
    dtype = grad.dtype
    hyper = torch.cat([HYPER, torch.tensor([1.5, 1.0], dtype=torch.float64)])
    rule_w, rule_s = weight.clone(), _clone(state)
    seed = state[6] if kind == "stochastic" else None
    shard_update_triton_(
        weight,
        grad,
        _moments(kind, state),
        state,
        hyper,
        decided=torch.tensor(False),
        seed=seed,
        index_base=0,
    )
    update = stochastic_adamw_ if kind == "stochastic" else adamw_8bit_
    update(rule_w, grad, None, rule_s, hyper, grad_dtype=dtype, chunk_bytes=None)
    assert int(rule_s[5]) > 0  # the rule replaced entries: counts compared, not zeros
    assert torch.equal(_bits(weight), _bits(rule_w))
    for i, (a, b) in enumerate(zip(state, rule_s, strict=True)):
        if i == 3:  # grad_norm_sq: the caller's
            continue
        assert torch.equal(a.long() if i == 5 else a, b.long() if i == 5 else b), i
