"""The bf16 master-weight rules of sonar_kernels/rules/master_weights.py against independent references:
the 16-bit remainder's split (nearest, a tie away from zero) and merge, against a numpy float64 choice of
the nearest bf16 neighbour; stochastic rounding's unbiasedness against a float64 expectation with a bound
from the binomial standard error; its counter-based stream against a pure-Python hash."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from sonar_kernels.kernels import master_weights as kernels
from sonar_kernels.ops.torch_backend import adamw as ops_adamw
from sonar_kernels.rules import master_weights as mw


def _finite_patterns(n: int, seed: int = 0) -> torch.Tensor:
    """fp32 values from random bit patterns (every exponent, both signs, denormals), finite only."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=generator, dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32)
    return values[torch.isfinite(values)]


def _nearest_bf16_away(master: torch.Tensor) -> np.ndarray:
    """The reference: master's two bf16 neighbours (truncated toward zero, and the next magnitude) chosen
    by their float64 distance, a tie to the larger magnitude. Returns the bf16 bit patterns (uint16)."""
    bits = master.numpy().view(np.uint32).astype(np.uint64)
    low = (bits >> 16).astype(np.uint64)  # toward zero: the sign kept, magnitude truncated
    high = low + 1  # the next magnitude (same sign); 0x7F80 is inf, as rounding to nearest gives
    value = master.numpy().astype(np.float64)

    def as_float(pattern):
        # The pattern after bf16's largest magnitude (0x7F80, inf) counts as 2 ** 128, where IEEE rounding
        # to nearest puts it: a value at or beyond the largest + half its ulp rounds to inf.
        value = (pattern << 16).astype(np.uint32).view(np.float32).astype(np.float64)
        return np.where(np.isinf(value), np.sign(value) * 2.0**128, value)

    to_low, to_high = np.abs(value - as_float(low)), np.abs(value - as_float(high))
    return np.where(to_high <= to_low, high, low).astype(np.uint16)


def test_split_is_the_nearest_bf16_with_ties_away_from_zero_and_merge_inverts_it():
    master = _finite_patterns(400_000)
    weight, remainder = mw.split(master)
    assert weight.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    expected = _nearest_bf16_away(master)
    assert np.array_equal(weight.view(torch.int16).numpy().view(np.uint16), expected)
    assert torch.equal(mw.merge(weight, remainder).view(torch.int32), master.view(torch.int32))
    # torch's cast rounds ties to even: the same bits everywhere but at the ties.
    ties = remainder == -(2**15)
    assert torch.equal(weight[~ties].view(torch.int16), master[~ties].to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_exact_ties_round_away_from_zero_and_round_trip(sign):
    # bf16 values with an even and an odd last mantissa bit, each plus half its ulp (an exact tie), in
    # normal and denormal ranges.
    base = torch.tensor([1.0, 1.0078125, 3.0, 2.0**-130, 2.0**-126, 6.5e4], dtype=torch.bfloat16)
    bits = base.view(torch.int16).to(torch.int32) << 16 | 0x8000
    master = (sign * bits.view(torch.float32)).contiguous()
    weight, remainder = mw.split(master)
    assert bool((remainder == -(2**15)).all())
    # Away from zero: the next bf16 magnitude.
    assert torch.equal(
        weight.float().abs(), torch.nextafter(base, torch.tensor(float("inf"), dtype=torch.bfloat16)).float()
    )
    assert torch.equal(mw.merge(weight, remainder).view(torch.int32), master.view(torch.int32))
    even = base.view(torch.int16) % 2 == 0
    # torch's cast keeps the even ones (ties to even): the documented difference.
    assert torch.equal(master[even].to(torch.bfloat16).abs().view(torch.int16), base[even].view(torch.int16))


def test_split_and_merge_refuse_other_dtypes():
    with pytest.raises(TypeError, match="fp32"):
        mw.split(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="int16 remainder"):
        mw.merge(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int32))


def _lowbias32(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_random_stream_is_the_documented_hash():
    index = torch.arange(0, 5000, dtype=torch.int64) * 7919 + 3
    for seed, step in ((0, 1), (1234, 77), (2**31 + 5, 2**32 + 9)):
        stream = _lowbias32(_lowbias32(seed) ^ (step & 0xFFFFFFFF))
        expected = [_lowbias32(i ^ stream) >> 16 for i in index.tolist()]
        assert mw.random_bits(seed, step, index).tolist() == expected


def test_stochastic_rounding_is_unbiased_for_one_element_over_steps_and_for_a_tensor():
    ulp = 2.0**-7  # bf16's spacing in [1, 2)
    for fraction in (0.3, 0.5, 0.9, 1 / 65536):
        master = torch.tensor([1.0 + fraction * ulp], dtype=torch.float32)
        exact = float(master.double())  # fp32 holds it exactly
        p = (exact - 1.0) / ulp
        n = 20_000
        steps = torch.arange(1, n + 1)  # the same element (index 0) at n steps
        draws = mw.stochastic_round(
            master.expand(n), seed=5, step=steps, index=torch.zeros(n, dtype=torch.int64)
        )
        draws = draws.double()
        assert bool(((draws == 1.0) | (draws == 1.0 + ulp)).all())
        bound = 4 * ulp * (p * (1 - p) / n) ** 0.5 + ulp / n  # 4 binomial standard errors
        assert abs(float(draws.mean()) - exact) <= bound, fraction
    # A tensor of one value, one step: its elements draw independently.
    master = torch.full((200_000,), -3.0 - 0.25 * 2.0**-6, dtype=torch.float32)  # bf16 ulp 2^-6 in [2, 4)
    rounded = mw.stochastic_round(master, seed=1, step=3).double()
    p = 0.25
    bound = 4 * 2.0**-6 * (p * (1 - p) / master.numel()) ** 0.5
    assert abs(float(rounded.mean()) - float(master[0].double())) <= bound


def test_stochastic_rounding_is_exact_on_bf16_values_reproducible_and_keyed_by_seed_and_step():
    exact = torch.randn(4096).to(torch.bfloat16).float()
    assert torch.equal(mw.stochastic_round(exact, seed=9, step=1).float(), exact)
    master = torch.randn(4096)
    once = mw.stochastic_round(master, seed=9, step=1)
    assert torch.equal(once.view(torch.int16), mw.stochastic_round(master, seed=9, step=1).view(torch.int16))
    for other in (mw.stochastic_round(master, seed=10, step=1), mw.stochastic_round(master, seed=9, step=2)):
        assert not torch.equal(once.view(torch.int16), other.view(torch.int16))
    # Each draw is one of the two neighbours.
    down = mw.split(master)[0].float()
    truncated = (master.view(torch.int32) & ~0xFFFF).view(torch.float32)
    away = torch.nextafter(
        truncated.to(torch.bfloat16), torch.where(master < 0, -1.0, 1.0).mul(float("inf")).to(torch.bfloat16)
    ).float()
    assert bool(((once.float() == truncated) | (once.float() == away)).all())
    assert down.shape == master.shape
    assert bool(mw.stochastic_round(torch.tensor([float("nan")]), seed=0, step=1).isnan().all())


@triton.jit
def _rules_kernel(
    master_ptr, weight_ptr, remainder_ptr, merged_ptr, rounded_ptr, seed, step, n, BLOCK: tl.constexpr
):  # fmt: skip
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    master = tl.load(master_ptr + offsets, mask=mask, other=0.0)
    weight_bits, remainder = kernels.split_tile(master)
    tl.store(weight_ptr + offsets, weight_bits, mask=mask)
    tl.store(remainder_ptr + offsets, remainder, mask=mask)
    tl.store(merged_ptr + offsets, kernels.merge_tile(weight_bits, remainder), mask=mask)
    bits16 = kernels.random_bits(seed.to(tl.uint32), step.to(tl.uint32), offsets.to(tl.uint32))
    tl.store(rounded_ptr + offsets, kernels.stochastic_round_tile(master, bits16), mask=mask)


def test_the_kernels_rules_equal_the_torch_ops_bitwise(device):
    # Random patterns (every exponent), the exact ties of both signs, bf16 values, and the largest
    # magnitudes (which round to inf); the stream at a seed and a step above 2**31.
    ties = (
        torch.tensor([1.0, 3.0, -1.0078125, 2.0**-130], dtype=torch.bfloat16)
        .view(torch.int16)
        .to(torch.int32)
        << 16
        | 0x8000
    ).view(torch.float32)
    master = torch.cat([_finite_patterns(5000, seed=3), ties, torch.randn(64).to(torch.bfloat16).float(),
                        torch.tensor([3.4e38, -3.4e38, 0.0, -0.0])]).to(device)  # fmt: skip
    n = master.numel()
    weight = torch.empty(n, dtype=torch.int16, device=device)
    remainder, rounded = torch.empty_like(weight), torch.empty_like(weight)
    merged = torch.empty_like(master)
    seed, step = 2**32 + 77, 2**31 + 5
    _rules_kernel[(triton.cdiv(n, 1024),)](
        master, weight, remainder, merged, rounded, seed % 2**32, step, n, BLOCK=1024
    )
    want_weight, want_remainder = mw.split(master)
    assert torch.equal(weight, want_weight.view(torch.int16))
    assert torch.equal(remainder, want_remainder)
    assert torch.equal(merged.view(torch.int32), master.view(torch.int32))
    assert torch.equal(rounded, mw.stochastic_round(master, seed, step).view(torch.int16))


@pytest.mark.parametrize("fused", [True, None])
def test_the_remainders_adamw_is_torch_adamw_on_fp32_master_weights_bitwise(fused):
    # 20 steps with bf16 gradients: the merged master equals torch.optim.AdamW (the same flags) run on an
    # fp32 master whose bf16 copy, rounded by the documented rule, is what a forward would read; a step
    # with a non-finite gradient leaves everything as it was, as torch's fused AdamW (found_inf) does.
    generator = torch.Generator().manual_seed(0)
    master = torch.randn(4, 16, 32, generator=generator)
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    reference = torch.nn.Parameter(master.clone())
    optimizer = torch.optim.AdamW([reference], **hyper, fused=fused)
    weight, remainder = mw.split(master)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    step, norm_sq, skipped = torch.zeros(()), torch.zeros(()), torch.zeros((), dtype=torch.int64)
    values = (hyper["lr"], *hyper["betas"], hyper["eps"], hyper["weight_decay"])
    for i in range(20):
        grad = torch.randn(master.shape, generator=generator).to(torch.bfloat16)
        if i == 7:
            grad[1, 2, 3] = float("inf")
            before = [t.clone() for t in (weight, remainder, exp_avg, exp_avg_sq, step)]
        ops_adamw.remainder_adamw_(weight, remainder, grad, exp_avg, exp_avg_sq, step, values, norm_sq, skipped,
                            foreach=None, fused=fused)  # fmt: skip
        if i == 7:
            after = (weight, remainder, exp_avg, exp_avg_sq, step)
            assert all(
                torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                for a, b in zip(before, after, strict=True)
            )
            assert int(skipped) == 1
            continue
        reference.grad = grad.float()
        optimizer.step()
        assert torch.equal(
            mw.merge(weight, remainder).view(torch.int32), reference.detach().view(torch.int32)
        ), i
        assert torch.equal(weight.view(torch.int16), mw.split(reference.detach())[0].view(torch.int16))
    assert torch.equal(exp_avg, optimizer.state[reference]["exp_avg"])
    assert float(step) == 19.0


@triton.jit
def _merge_kernel(weight_ptr, remainder_ptr, merged_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    merged = kernels.merge_tile(
        tl.load(weight_ptr + offsets, mask=mask), tl.load(remainder_ptr + offsets, mask=mask)
    )
    tl.store(merged_ptr + offsets, merged, mask=mask)


def test_a_stale_remainder_on_a_signed_zero_merges_to_the_zero_not_to_nan(device):
    # Pairs split never gives (a weight zeroed outside the optimizer, its old remainder kept): a remainder
    # that would cross the sign merges to the weight itself, on both implementations; the rest as usual.
    zeros = torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0, -1.0], dtype=torch.bfloat16)
    remainder = torch.tensor([-1, -32768, 5, 7, -3, -3], dtype=torch.int16)
    merged = mw.merge(zeros, remainder)
    want = torch.tensor([0.0, -0.0], dtype=torch.float32)
    assert torch.equal(merged[:2].view(torch.int32), want.view(torch.int32))
    assert bool(torch.isfinite(merged).all())
    assert merged[2] > 0 and merged[3] < 0 and abs(float(merged[4]) - 1.0) < 2**-16
    out = torch.empty(6, dtype=torch.float32, device=device)
    _merge_kernel[(1,)](zeros.view(torch.int16).to(device), remainder.to(device), out, 6, BLOCK=8)
    assert torch.equal(out.cpu().view(torch.int32), merged.view(torch.int32))
