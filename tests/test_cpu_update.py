"""The CPU's C update (sonar_kernels/ops/torch_backend/cpu_update.py) gives the bits of the rule op by op
(sonar_kernels/rules/update.py's adamw_update_), with 8-bit moments for every master kind and gradient dtype
and with exact moments and stochastic rounding, on random inputs
with the edge values the rule treats apart (signed zeros, subnormals, huge values, blocks of zeros, every
code of both tables) and on the quantizer's ties and thresholds; the driver (ops/torch_backend/fp64_update.py) takes it;
a build that fails warns once and leaves the rule; a build without AVX2 (the portable selects) agrees."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
import torch

from sonar_kernels.ops.torch_backend import cpu_update
from sonar_kernels.ops.torch_backend.fp64_update import adamw_8bit_, stochastic_adamw_
from sonar_kernels.rules import master_weights as mw
from sonar_kernels.rules import moments_8bit as q8
from sonar_kernels.rules.adamw import adamw_scalars
from sonar_kernels.rules.update import adamw_update_

SHAPE = (3, 8, 128)
HYPER = [1e-3, 0.9, 0.999, 1e-8, 0.01]
KINDS = [
    pytest.param("none", torch.float32, torch.float32, id="fp32-weight"),
    pytest.param("none", torch.float32, torch.bfloat16, id="fp32-weight-bf16-grad"),
    pytest.param("none", torch.bfloat16, torch.float32, id="bf16-weight"),
    pytest.param("remainder", torch.bfloat16, torch.bfloat16, id="remainder"),
    pytest.param("remainder", torch.bfloat16, torch.float32, id="remainder-fp32-grad"),
    pytest.param("stochastic", torch.bfloat16, torch.bfloat16, id="stochastic"),
]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def _problem(master, weight_dtype, grad_dtype, seed, grad=None, shape=SHAPE):
    """(weight, grad, moments, extra): edge values in the weight, the gradient and the moments; codes drawn
    over both whole tables; ``grad`` given: that gradient."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen)
    weight.view(-1)[:10] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.0, -3.0, 1e30, -1e-30, 1e38, -2e-45])
    if grad is None:
        grad = torch.randn(shape, generator=gen) * 1e-2
        grad.view(-1)[10:20] = torch.tensor([0.0, -0.0, 1e-40, 5.0, -5.0, 1e-20, 0.0, 2.0, 1e18, -3e-39])
        grad[0, 0, :32] = 0.0  # a block of zeros
    grad = grad.to(grad_dtype)
    m_codes = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
    v_codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    m_scales = torch.rand(q8.scales_shape(shape), generator=gen) * 1e-2
    v_scales = torch.rand(q8.scales_shape(shape), generator=gen) * 1e-4
    m_scales.view(-1)[:3] = torch.tensor([0.0, 1e-40, 3e38])
    v_scales.view(-1)[:3] = torch.tensor([0.0, 1e-42, 1e30])
    extra = {}
    if master == "remainder":
        bits = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int32)
        bits.view(-1)[:4] = -(2**15)  # ties of the split
        extra["remainder"] = bits.to(torch.int16)
    elif master == "stochastic":
        extra.update(seed=torch.tensor(mw.tensor_seed(7, 3)), step=torch.tensor(5.0))
    return weight.to(weight_dtype), grad, (m_codes, m_scales, v_codes, v_scales), extra


def _both(weight, grad, moments, extra, hyper, first_index=1000):
    """(rule's, C's) (weight, moments..., remainder) after one update from the same state."""
    scalars = adamw_scalars(torch.tensor(5.0), hyper)
    out = []
    for use_c in (False, True):
        w = weight.clone()
        held = tuple(t.clone() for t in moments)
        more = {k: t.clone() for k, t in extra.items()}
        if use_c:
            assert cpu_update.adamw_8bit_cpu_(w, grad, held, scalars, hyper, first_index=first_index, **more)
        else:
            index = {"first_index": torch.tensor(first_index)} if "seed" in more else {}
            adamw_update_(
                w, grad, held, scalars, hyper, None, q8.tables(), grad_dtype=grad.dtype, **more, **index
            )
        out.append((w, *held, *([more["remainder"]] if "remainder" in more else [])))
    return out


@pytest.mark.parametrize("master, weight_dtype, grad_dtype", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_c_update_gives_the_bits_of_the_rule(master, weight_dtype, grad_dtype, seed, monkeypatch):
    monkeypatch.setenv("SONAR_KERNELS_COMPILE", "1")
    weight, grad, moments, extra = _problem(master, weight_dtype, grad_dtype, seed)
    rule, c = _both(weight, grad, moments, extra, torch.tensor(HYPER, dtype=torch.float64))
    assert not _same_bits(rule[0], weight)  # the update moved the weight
    names = ["weight", "m_codes", "m_scales", "v_codes", "v_scales", "remainder"][: len(rule)]
    for name, a, b in zip(names, rule, c, strict=True):
        assert _same_bits(a, b), (name, (a != b).sum().item())


@pytest.mark.parametrize(
    "grad_dtype, moments_dtype",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)],
    ids=["bf16-grad", "fp32-grad", "bf16-moments"],
)
def test_the_c_stochastic_update_with_exact_moments_gives_the_bits_of_the_rule(grad_dtype, moments_dtype):
    weight, grad, _, extra = _problem("stochastic", torch.bfloat16, grad_dtype, 6)
    gen = torch.Generator().manual_seed(6)
    moments = (1e-3 * torch.randn(SHAPE, generator=gen), 1e-6 * torch.rand(SHAPE, generator=gen))
    moments[0].view(-1)[:6] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e20, -1e-30])
    moments[1].view(-1)[:4] = torch.tensor([0.0, 1e-42, 1e30, 3e-39])
    moments = tuple(t.to(moments_dtype) for t in moments)
    hyper = torch.tensor(HYPER, dtype=torch.float64)
    scalars = adamw_scalars(torch.tensor(5.0), hyper)
    out = []
    for use_c in (False, True):
        w, held = weight.clone(), tuple(t.clone() for t in moments)
        if use_c:
            assert cpu_update.adamw_stochastic_cpu_(w, grad, held, scalars, hyper, first_index=77, **extra)
        else:
            adamw_update_(w, grad, held, scalars, hyper, None, q8.tables(), grad_dtype=grad_dtype,
                          first_index=torch.tensor(77), **extra)  # fmt: skip
        out.append((w, *held))
    assert not _same_bits(out[0][0], weight)
    for name, a, b in zip(["weight", "exp_avg", "exp_avg_sq"], *out, strict=True):
        assert _same_bits(a, b), (name, (a != b).sum().item())


def _quantizer_probes() -> torch.Tensor:
    """fp32 values n in [0, 1]: every table entry of exp_avg and their neighbours, the midpoints of
    adjacent entries (ties where representable) and their neighbours, the mantissa thresholds at many
    exponents, the ends (below the smallest entry, subnormals, zero, 1), and random values."""
    table = q8.exp_avg_magnitudes().numpy()
    probes = [table]
    up, down = np.float32(2.0), np.float32(0.0)
    for lo, hi in itertools.pairwise(table):
        mid = np.float32((np.float64(lo) + np.float64(hi)) / 2)
        probes += [np.array([mid, np.nextafter(mid, up), np.nextafter(mid, down), np.nextafter(lo, up)])]
    for exponent in [0, -1, -5, -15, -16, -17, -20, -31, -32, -33, -126, -140]:
        f = np.arange(1 << 23, 1 << 24, 997, dtype=np.float64) / (1 << 23)
        probes.append((f * 2.0**exponent).astype(np.float32))
    probes.append(np.array([0.0, 1.0, 1e-45, 2.0**-16, 2.0**-15.75, 2.0**-16.5], dtype=np.float32))
    probes.append(np.random.default_rng(0).random(1 << 14, dtype=np.float32) ** 8)
    # the edges of the AVX2 quantizer's 16 mantissa intervals [1 + j / 16, 1 + (j + 1) / 16) and their
    # neighbours, and the mantissas all ones and all zeros, at exponents where the codes differ
    edges = np.array([1 + j / 16 for j in range(16)] + [2 - 2.0**-23], dtype=np.float32)
    edges = np.concatenate([edges, np.nextafter(edges, up), np.nextafter(edges, down)])
    probes += [edges * np.float32(2.0**exponent) for exponent in (0, -1, -7, -16, -17, -31, -32)]
    values = torch.from_numpy(np.concatenate(probes).astype(np.float32))
    values = values[(values <= 1.0)]
    return values


def test_the_c_quantizer_gives_the_rules_codes_at_ties_thresholds_and_ends(monkeypatch):
    # beta1 = beta2 = 0: the new exp_avg is the gradient itself and exp_avg_sq its square; each block holds
    # 1.0 (scale 1: n = |g|) and 31 probes, half of them negated.
    monkeypatch.setenv("SONAR_KERNELS_COMPILE", "1")
    probes = _quantizer_probes()
    rows = math.ceil(probes.numel() / 31)
    body = torch.zeros(rows * 31)
    body[: probes.numel()] = probes
    grad = torch.cat([torch.ones(rows, 1), body.reshape(rows, 31)], dim=1)
    grad[1::2, 1:] *= -1
    weight, grad, moments, extra = _problem(
        "none", torch.float32, torch.float32, 2, grad=grad, shape=(rows, 32)
    )
    hyper = torch.tensor([1e-3, 0.0, 0.0, 1e-8, 0.0], dtype=torch.float64)
    rule, c = _both(weight, grad, moments, extra, hyper)
    assert rule[1].unique().numel() == 255  # every exp_avg code
    for name, a, b in zip(["weight", "m_codes", "m_scales", "v_codes", "v_scales"], rule, c, strict=True):
        assert _same_bits(a, b), (name, (a != b).sum().item())


@pytest.mark.parametrize("native", [True, False], ids=["avx2", "portable"])
def test_the_c_update_gives_the_rules_bits_for_non_finite_moments(native, monkeypatch):
    # A NaN or an infinite gradient entry (the driver skips such updates; the C update alone does not):
    # a block whose new largest magnitude is NaN (the rule's scale NaN, not above 0: every n is 0), one
    # whose largest is infinite (inf / inf: the default NaN), and -inf, for both builds.
    monkeypatch.setenv("SONAR_KERNELS_COMPILE", "1")
    if not native:
        monkeypatch.setattr(cpu_update, "FLAGS", tuple(f for f in cpu_update.FLAGS if f != "-march=native"))
    monkeypatch.setattr(cpu_update, "_library", None)
    monkeypatch.setattr(cpu_update, "_failed", False)
    weight, grad, moments, extra = _problem("none", torch.float32, torch.float32, 8)
    flat = grad.view(-1)
    flat[32 * 3 + 5] = float("nan")
    flat[32 * 4 + 7], flat[32 * 4 + 9] = float("inf"), 1.0
    flat[32 * 5 + 1] = -float("inf")
    flat[32 * 6 : 32 * 7] = float("nan")
    rule, c = _both(weight, grad, moments, extra, torch.tensor(HYPER, dtype=torch.float64))
    assert rule[2].view(-1)[3:7].isnan().any() and rule[2].view(-1)[3:7].isinf().any()  # the scales
    for name, a, b in zip(["weight", "m_codes", "m_scales", "v_codes", "v_scales"], rule, c, strict=True):
        assert _same_bits(a, b), (name, (a != b).sum().item())


def test_the_driver_takes_the_c_stochastic_update_with_the_rules_bits(monkeypatch):
    # exact moments with stochastic rounding through ops/torch_backend/fp64_update.py's stochastic_adamw_ (32 K elements)
    monkeypatch.setattr(cpu_update, "MIN_BLOCKS_PER_THREAD", 16)
    assert cpu_update.available(), "the test machine has a C compiler"
    calls, results = [], []
    for compile_flag in ("1", "0"):
        monkeypatch.setenv("SONAR_KERNELS_COMPILE", compile_flag)
        weight, grad, _, extra = _problem(
            "stochastic", torch.bfloat16, torch.bfloat16, 7, shape=(2, 16, 1024)
        )
        gen = torch.Generator().manual_seed(7)
        state = [
            1e-3 * torch.randn(weight.shape, generator=gen),
            1e-6 * torch.rand(weight.shape, generator=gen),
        ]
        state += [*_counters(), extra["seed"]]
        library = _Spy(cpu_update._library, calls, "sonar_adamw_stochastic") if compile_flag == "1" else None
        monkeypatch.setattr(cpu_update, "_library", library or cpu_update._library)
        stochastic_adamw_(weight, grad, None, state, torch.tensor(HYPER, dtype=torch.float64),
                          grad_dtype=torch.bfloat16, chunk_bytes=None, index_base=4096)  # fmt: skip
        results.append((weight, *state))
    assert len(calls) == min(torch.get_num_threads(), 1024 // 16)
    for a, b in zip(*results, strict=True):
        assert _same_bits(a, b)


def test_the_driver_takes_the_c_update_with_the_rules_bits(monkeypatch):
    # A tensor as large as the compiled rule takes (ops/torch_backend/fp64_update.py), split among 2 threads: the driver
    # runs the C update (counted), and its result is the rule's op by op (SONAR_KERNELS_COMPILE=0).
    monkeypatch.setattr(cpu_update, "MIN_BLOCKS_PER_THREAD", 16)
    calls = []
    original = cpu_update._library.sonar_adamw_8bit if cpu_update.available() else None
    assert original is not None, "the test machine has a C compiler"
    results = []
    for compile_flag in ("1", "0"):
        monkeypatch.setenv("SONAR_KERNELS_COMPILE", compile_flag)
        weight, grad, moments, extra = _problem(
            "stochastic", torch.bfloat16, torch.bfloat16, 3, shape=(2, 16, 1024)
        )
        m_codes, m_scales, v_codes, v_scales = moments
        state = [m_codes, v_codes, *_counters(), m_scales, v_scales, extra["seed"]]
        monkeypatch.setattr(
            cpu_update,
            "_library",
            _Spy(cpu_update._library, calls) if compile_flag == "1" else cpu_update._library,
        )
        adamw_8bit_(weight, grad, None, state, torch.tensor(HYPER, dtype=torch.float64), grad_dtype=torch.bfloat16,
                    chunk_bytes=None, index_base=4096)  # fmt: skip
        results.append((weight, *state))
    assert len(calls) == min(torch.get_num_threads(), 1024 // 16)  # one chunk of 1024 blocks, split
    for a, b in zip(*results, strict=True):
        assert _same_bits(a, b)


def _counters():
    """step, grad_norm_sq, skipped, clipped (ops/torch_backend/fp64_update.py's state list at 2 to 5)."""
    return [
        torch.tensor(4.0),
        torch.zeros(()),
        torch.zeros((), dtype=torch.int64),
        torch.zeros((), dtype=torch.int32),
    ]


class _Spy:
    """A library whose calls of ``name`` are recorded."""

    def __init__(self, library, calls, name="sonar_adamw_8bit"):
        self._library, self._calls, self._name = library, calls, name

    def __getattr__(self, name):
        fn = getattr(self._library, name)
        if name != self._name:
            return fn

        def call(*args):
            self._calls.append(args[:2])
            return fn(*args)

        return call


def test_a_build_that_fails_warns_once_and_leaves_the_rule(monkeypatch):
    monkeypatch.setenv("SONAR_KERNELS_COMPILE", "1")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(cpu_update, "_library", None)
    monkeypatch.setattr(cpu_update, "_failed", False)
    weight, grad, moments, _ = _problem("none", torch.float32, torch.float32, 4)
    hyper = torch.tensor(HYPER, dtype=torch.float64)
    scalars = adamw_scalars(torch.tensor(5.0), hyper)
    before = [weight.clone(), *(t.clone() for t in moments)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not cpu_update.adamw_8bit_cpu_(weight, grad, moments, scalars, hyper)
        assert not cpu_update.adamw_8bit_cpu_(weight, grad, moments, scalars, hyper)  # no second warning
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "could not be built" in messages[0] and "compiled rule" in messages[0]
    for a, b in zip([weight, *moments], before, strict=True):  # nothing changed
        assert _same_bits(a, b)
    # the driver then runs the compiled rule: the bits of the rule op by op (SONAR_KERNELS_COMPILE=0)
    results = []
    for compile_flag in ("1", "0"):
        monkeypatch.setenv("SONAR_KERNELS_COMPILE", compile_flag)
        weight, grad, moments, _ = _problem("none", torch.float32, torch.float32, 4, shape=(2, 16, 1024))
        state = [moments[0], moments[2], *_counters(), moments[1], moments[3]]
        adamw_8bit_(weight, grad, None, state, hyper, grad_dtype=torch.float32, chunk_bytes=None)
        results.append((weight, *state))
    for a, b in zip(*results, strict=True):
        assert _same_bits(a, b)


def test_a_build_without_avx2_gives_the_same_bits(monkeypatch):
    # The portable selects of cpu_update.c (no -march=native: x86-64's baseline, no AVX2 permutation).
    monkeypatch.setenv("SONAR_KERNELS_COMPILE", "1")
    monkeypatch.setattr(cpu_update, "FLAGS", tuple(f for f in cpu_update.FLAGS if f != "-march=native"))
    monkeypatch.setattr(cpu_update, "_library", None)
    monkeypatch.setattr(cpu_update, "_failed", False)
    probes = _quantizer_probes()[:4000]
    for master, weight_dtype, grad_dtype in [
        ("none", torch.float32, torch.float32),
        ("remainder", torch.bfloat16, torch.bfloat16),
    ]:
        weight, grad, moments, extra = _problem(master, weight_dtype, grad_dtype, 5)
        grad.view(-1)[64 : 64 + 2000] = probes[:2000].to(grad_dtype)
        rule, c = _both(weight, grad, moments, extra, torch.tensor(HYPER, dtype=torch.float64))
        for a, b in zip(rule, c, strict=True):
            assert _same_bits(a, b)


@pytest.mark.parametrize(
    "entries, skipped",
    [
        pytest.param([1.0, -3.0], False, id="usual"),
        pytest.param([2.0**63, -(2.0**63)], False, id="at-the-limit"),  # norm above it: the pass decides
        pytest.param([2.0**62] * 5, False, id="norm-beyond-entries-within"),
        pytest.param([2.0**63 * (1 + 2.0**-7)], True, id="beyond-the-limit"),  # bf16 holds it
        pytest.param([float("inf")], True, id="inf"),
        pytest.param([float("nan")], True, id="nan"),
        pytest.param([1e30, float("nan")], True, id="nan-beside-huge"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_skip_read_from_the_norm_is_the_max_pass_decision(entries, skipped, dtype, monkeypatch):
    # ops/common.py's skip_decided: the driver's skip from the gradient's norm where the norm decides it,
    # else the pass over the gradient; the same decision as that pass in every case, and no pass when the
    # norm is below the limit.
    from sonar_kernels.ops import common
    from sonar_kernels.rules.adamw import grad_limit

    limit = grad_limit(torch.float32)
    grad = 1e-3 * torch.randn(4096, generator=torch.Generator().manual_seed(9))
    grad[100 : 100 + len(entries)] = torch.tensor(entries)
    grad = grad.to(dtype)
    passes = []
    real = common.inf_norm
    monkeypatch.setattr(common, "inf_norm", lambda x: passes.append(1) or real(x))
    norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
    decided = common.skip_decided(grad, norm, limit)
    assert decided.dtype == torch.bool and decided.shape == ()
    assert bool(decided) == skipped == bool(~(real(grad) <= limit))
    assert len(passes) == (0 if bool(norm < limit) else 1)
    assert bool(norm < limit) == (max(abs(e) for e in entries) < 2.0**62)
