"""8-bit AdamW moments (sonar_kernels/rules/moments_8bit.py) against an independent float64 implementation of
the documented scheme (docs/design.md, "8-bit moments"), written here in numpy: the code tables, the
quantization with its tie rule, the dequantization and one AdamW update from given codes, scales and
gradient."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from cases import Case

from sonar_kernels import ops
from sonar_kernels.kernels.moments_8bit import quantize_tile
from sonar_kernels.ops.triton_backend import moments_8bit as ops_8bit
from sonar_kernels.rules import adamw as rules_adamw
from sonar_kernels.rules import moments_8bit as q8

BLOCK = 32


# --- the reference ------------------------------------------------------------------------------------


def f32(x):
    """Round float64 values to float32 (once, to nearest even)."""
    return np.asarray(x, dtype=np.float64).astype(np.float32)


def exact_pow2_eighth(j: int) -> np.float32:
    """fp32(2 ** (j / 8)) rounded from a value good to far more bits than fp64 (Fraction arithmetic on an
    fp64 estimate refined by Newton's method on x**8 = 2**j)."""
    whole, frac = divmod(j, 8)
    x = Fraction(2.0 ** (frac / 8))
    for _ in range(3):  # Newton on f(x) = x^8 - 2^frac
        x = x - (x**8 - 2**frac) / (8 * x**7)
    value = x * Fraction(2) ** whole
    below = np.float32(float(value))  # within an ulp; pick the nearest of the neighbours exactly
    candidates = [np.nextafter(below, np.float32(-np.inf)), below, np.nextafter(below, np.float32(np.inf))]
    return min(candidates, key=lambda c: abs(Fraction(float(c)) - value))


def ref_tables():
    magnitudes = np.array([0.0] + [exact_pow2_eighth(k - 127) for k in range(1, 128)], dtype=np.float32)
    levels = np.array([exact_pow2_eighth(c - 255) for c in range(256)], dtype=np.float32)
    return {"exp_avg": magnitudes, "exp_avg_sq": levels}


TABLES = ref_tables()


def ref_quantize(x: np.ndarray, kind: str):
    """(codes, scales) by the documented rule, element by element: the nearest table entry to
    n = fp32(|x| / scale), an exact tie to the smaller magnitude."""
    table = TABLES[kind].astype(np.float64)
    blocks = x.astype(np.float64).reshape(*x.shape[:-1], -1, BLOCK)
    scales = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        n = np.where(scales > 0, f32(np.abs(blocks) / scales).astype(np.float64), 0.0)
    # |n - t| of two fp32 values is exact in fp64 for the entries next to n (close exponents), which are the
    # only candidates; argmin takes the first of equal distances: the smaller magnitude.
    best = np.argmin(np.abs(n[..., None] - table), axis=-1)
    codes = np.where((blocks < 0) & (kind == "exp_avg"), -best, best)
    dtype = np.int8 if kind == "exp_avg" else np.uint8
    return codes.astype(dtype).reshape(x.shape), f32(scales[..., 0])


def ref_dequantize(codes: np.ndarray, scales: np.ndarray, kind: str) -> np.ndarray:
    table = TABLES[kind].astype(np.float64)
    c = codes.astype(np.int64)
    values = np.sign(c) * table[np.abs(c)] if kind == "exp_avg" else table[c]
    blocks = values.reshape(*codes.shape[:-1], -1, BLOCK) * scales.astype(np.float64)[..., None]
    return f32(blocks).reshape(codes.shape)


def ref_round(p32: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """fp32 -> ``dtype`` (round to nearest even), back as fp32 values."""
    if dtype == torch.float32:
        return p32
    if dtype == torch.float16:
        return p32.astype(np.float16).astype(np.float32)
    bits = p32.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def ref_update(p, g, m_state, v_state, step, hyper, weight_dtype):
    """The documented update in float64 with its fp32 rounding points; returns (p in the weight's dtype as
    fp32 values, m's (codes, scales), v's (codes, scales))."""
    lr, beta1, beta2, eps, wd = (float(h) for h in hyper)
    bc1 = f32(1.0 - beta1**step)
    bc2 = f32(1.0 - beta2**step)
    step_size = f32(lr / float(bc1))
    bc2_sqrt = f32(math.sqrt(float(bc2)))
    p = p.astype(np.float32)
    if wd != 0.0:
        p = f32(p.astype(np.float64) - (lr * wd) * p.astype(np.float64))
    m = ref_dequantize(*m_state, "exp_avg").astype(np.float64)
    v = ref_dequantize(*v_state, "exp_avg_sq").astype(np.float64)
    g = g.astype(np.float64)
    m = f32(beta1 * m + ((1.0 - beta1) * g))
    v = f32(beta2 * v + ((1.0 - beta2) * g) * g)
    root = f32(np.sqrt(v.astype(np.float64)))  # a correctly rounded fp32 square root
    denom = f32(f32(root.astype(np.float64) / float(bc2_sqrt)).astype(np.float64) + eps)
    p = f32(
        p.astype(np.float64) - f32(f32(float(step_size) * m.astype(np.float64)) / denom.astype(np.float64))
    )
    return ref_round(p, weight_dtype), ref_quantize(m, "exp_avg"), ref_quantize(v, "exp_avg_sq")


# --- the tests ------------------------------------------------------------------------------------------


def test_the_tables_are_the_documented_powers_of_two():
    assert np.array_equal(q8.exp_avg_magnitudes().numpy(), TABLES["exp_avg"])
    assert np.array_equal(q8.exp_avg_sq_levels().numpy(), TABLES["exp_avg_sq"])
    assert TABLES["exp_avg"][127] == 1.0 and TABLES["exp_avg_sq"][255] == 1.0
    assert np.all(np.diff(TABLES["exp_avg"]) > 0) and np.all(np.diff(TABLES["exp_avg_sq"]) > 0)


def _values(seed: int, shape=(3, 4 * BLOCK)) -> np.ndarray:
    """fp32 values over many decades, with the blocks the scheme must handle: all zeros, zeros beside
    non-zeros, one huge entry among tiny ones, denormal magnitudes."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-8, 3, shape)).astype(np.float32)
    x[0, :BLOCK] = 0.0
    x[0, BLOCK : BLOCK + 5] = 0.0
    x[1, :BLOCK] = np.float32(1e-9)
    x[1, 7] = np.float32(3e30)
    x[2, :BLOCK] = (rng.standard_normal(BLOCK) * 1e-41).astype(np.float32)  # denormal
    return x


@pytest.mark.parametrize("kind", q8.KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_and_dequantize_equal_the_reference(kind, seed):
    x = _values(seed)
    if kind == "exp_avg_sq":
        x = np.abs(x)
    codes, scales = q8.quantize(torch.from_numpy(x), kind)
    ref_codes, ref_scales = ref_quantize(x, kind)
    assert np.array_equal(codes.numpy(), ref_codes)
    assert np.array_equal(scales.numpy(), ref_scales)
    assert np.array_equal(
        q8.dequantize(codes, scales, kind).numpy(), ref_dequantize(ref_codes, ref_scales, kind)
    )


@pytest.mark.parametrize("kind", q8.KINDS)
def test_an_exact_tie_goes_to_the_smaller_magnitude(kind):
    table = TABLES[kind].astype(np.float64)
    mids = [(a + b) / 2 for a, b in itertools.pairwise(table)]
    ties = [m for m in mids if float(np.float32(m)) == m][: BLOCK - 1]  # midpoints fp32 holds exactly
    assert len(ties) >= 8, len(ties)
    block = np.zeros(BLOCK, dtype=np.float32)
    block[0] = 1.0  # scale 1: the normalized values are the values
    block[1 : 1 + len(ties)] = ties
    sign = -1.0 if kind == "exp_avg" else 1.0
    x = (block * np.float32(sign))[None, :]
    codes, _ = q8.quantize(torch.from_numpy(x), kind)
    expected = [np.searchsorted(table, t) - 1 for t in ties]  # the entry below each midpoint
    got = np.abs(codes.numpy().astype(np.int64)[0, 1 : 1 + len(ties)])
    assert got.tolist() == expected
    # Just above a tie: the larger magnitude.
    above = x.copy()
    above[0, 1 : 1 + len(ties)] = np.nextafter(above[0, 1 : 1 + len(ties)], np.float32(sign * np.inf))
    codes, _ = q8.quantize(torch.from_numpy(above), kind)
    assert np.abs(codes.numpy().astype(np.int64)[0, 1 : 1 + len(ties)]).tolist() == [e + 1 for e in expected]


def test_a_small_second_moment_is_never_read_back_as_zero():
    x = np.zeros((1, BLOCK), dtype=np.float32)
    x[0, 0] = 1.0
    x[0, 1] = 1e-30
    codes, scales = q8.quantize(torch.from_numpy(x), "exp_avg_sq")
    values = q8.dequantize(codes, scales, "exp_avg_sq")
    assert values[0, 1] > 0 and values[0, 2] > 0  # the smallest level, not 0
    assert q8.dequantize(*q8.quantize(torch.zeros(1, BLOCK), "exp_avg_sq"), "exp_avg_sq").eq(0).all()


def test_a_last_dimension_not_a_multiple_of_the_block_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        q8.quantize(torch.zeros(2, 48), "exp_avg")
    with pytest.raises(ValueError, match="kind must be one of"):
        q8.quantize(torch.zeros(2, 32), "exp_avg_cubed")


@pytest.mark.parametrize("step", [1, 7, 1000])
def test_the_scalars_equal_the_reference(step):
    hyper = torch.tensor([3e-3, 0.9, 0.999, 1e-8, 0.1], dtype=torch.float64)
    scalars = rules_adamw.adamw_scalars(torch.tensor(float(step)), hyper)
    bc1, bc2 = f32(1.0 - 0.9**step), f32(1.0 - 0.999**step)
    assert scalars.dtype == torch.float32
    assert scalars[0].item() == float(f32(3e-3 / float(bc1)))
    assert scalars[1].item() == float(f32(math.sqrt(float(bc2))))


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_updates_equal_the_reference_step_after_step(weight_dtype, weight_decay):
    rng = np.random.default_rng(3)
    shape = (2, 3, 2 * BLOCK)
    p = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(weight_dtype)
    m_state = q8.quantize(torch.zeros(shape), "exp_avg")
    v_state = q8.quantize(torch.zeros(shape), "exp_avg_sq")
    hyper = torch.tensor([1e-2, 0.9, 0.999, 1e-8, weight_decay], dtype=torch.float64)
    ref = (p.float().numpy(), tuple(t.numpy() for t in m_state), tuple(t.numpy() for t in v_state))
    for step in range(1, 5):
        g = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 1, shape)).astype(np.float32)
        g[0, 0, :BLOCK] = 0.0  # a block without gradient
        if weight_dtype != torch.float32:
            g = torch.from_numpy(g).to(weight_dtype).float().numpy()  # rounded to the gradient dtype
        scalars = rules_adamw.adamw_scalars(torch.tensor(float(step)), hyper)
        new_p, m_state, v_state = q8.adamw_8bit_update(
            p, torch.from_numpy(g), m_state, v_state, scalars, hyper
        )
        p = new_p.to(weight_dtype)
        ref = ref_update(ref[0], g, ref[1], ref[2], step, hyper.tolist(), weight_dtype)
        assert np.array_equal(p.float().numpy(), ref[0]), step
        for got, want in ((m_state, ref[1]), (v_state, ref[2])):
            assert np.array_equal(got[0].numpy(), want[0]) and np.array_equal(got[1].numpy(), want[1]), step


# --- the Triton kernels: the same bits as the torch ops -------------------------------------------------


def _state(shape, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    m = q8.quantize(torch.randn(shape, generator=g) * 1e-3, "exp_avg")
    v = q8.quantize(torch.rand(shape, generator=g) * 1e-6, "exp_avg_sq")
    return tuple(t.to(device) for t in m), tuple(t.to(device) for t in v)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_split_kernel_equals_the_torch_update(weight_dtype, device):
    shape = (3, 40, 96)  # 96 columns: the last column tile of the kernel is partial
    torch.manual_seed(0)
    p = torch.randn(shape).to(weight_dtype).to(device)
    m, v = _state(shape, 1, device)
    hyper = torch.tensor([1e-2, 0.9, 0.999, 1e-8, 0.1], dtype=torch.float64, device=device)
    for step in range(1, 4):
        g = (torch.randn(shape) * 10 ** (torch.rand(shape) * 6 - 5)).to(weight_dtype).to(device)
        scalars = rules_adamw.adamw_scalars(torch.tensor(float(step), device=device), hyper)
        want_p, want_m, want_v = q8.adamw_8bit_update(p, g.float(), m, v, scalars, hyper)
        ops_8bit.adamw_8bit_triton_(p, g, m, v, scalars, torch.zeros((), device=device), hyper)
        assert torch.equal(p, want_p.to(weight_dtype)), step
        assert all(torch.equal(a, b) for a, b in zip(m + v, want_m + want_v, strict=True)), step
    # A set skip flag leaves everything as it was.
    before = [t.clone() for t in (p, *m, *v)]
    ops_8bit.adamw_8bit_triton_(p, g, m, v, scalars, torch.ones((), device=device), hyper)
    assert all(torch.equal(a, b) for a, b in zip((p, *m, *v), before, strict=True))


def _update(weight, state, step, hyper, fused):
    (mc, ms), (vc, vs) = state
    return ops.AdamWUpdate(
        exp_avg=mc, exp_avg_sq=vc, step=step, hyper=hyper, grad_dtype=weight.dtype, fused=fused,
        grad_norm_sq=torch.zeros((), device=weight.device), skipped=torch.zeros((), dtype=torch.int64, device=weight.device),
        exp_avg_scales=ms, exp_avg_sq_scales=vs,
    )  # fmt: skip


@pytest.mark.usefixtures("wgrad_tiles_of_the_8bit_update")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_epilogue_equals_the_split_path_and_the_torch_update(dtype, device):
    # H = 96: W1 [E, 64, 96] has a partial column tile of the wgrad kernel (64 + 32 columns).
    torch.manual_seed(0)
    x, index, weights, w1, w2 = Case(16, 96, 32, 2, 2).make(dtype, device=device)
    hyper = torch.tensor([1e-2, 0.9, 0.999, 1e-8, 0.1], dtype=torch.float64, device=device)
    runs = {}
    for variant in ("fused", "split", "torch"):
        weights_now = [w1.clone(), w2.clone()]
        states = [_state(w.shape, 5 + i, device) for i, w in enumerate(weights_now)]
        steps = [torch.zeros((), device=device) for _ in weights_now]
        for step in range(2):
            grad_out = torch.randn(16, 96, generator=torch.Generator().manual_seed(step)).to(dtype).to(device)
            _, hpre, meta = ops.moe_mlp_fwd(x, index, weights, *weights_now, "silu")
            if variant == "torch":
                grads = ops.moe_mlp_bwd(grad_out, x, weights, *weights_now, hpre, meta, "silu", (True,) * 4)
                for w, state, s, g in zip(weights_now, states, steps, grads[2:4], strict=True):
                    s.add_(1)
                    scalars = rules_adamw.adamw_scalars(s, hyper)
                    new_p, m, v = q8.adamw_8bit_update(w, g.float(), *state, scalars, hyper)
                    w.copy_(new_p.to(dtype))
                    for held, new in zip(state[0] + state[1], m + v, strict=True):
                        held.copy_(new)
            else:
                updates = [
                    _update(w, state, s, hyper, variant == "fused")
                    for w, state, s in zip(weights_now, states, steps, strict=True)
                ]
                ops.moe_mlp_bwd(
                    grad_out, x, weights, *weights_now, hpre, meta, "silu", (True,) * 4,
                    gate_up_proj_update=updates[0], down_proj_update=updates[1],
                )  # fmt: skip
        runs[variant] = [
            t.clone() for w, state in zip(weights_now, states, strict=True) for t in (w, *state[0], *state[1])
        ]
    for name, tensors in runs.items():
        for a, b in zip(tensors, runs["torch"], strict=True):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("fused", [True, False])
def test_a_skipped_update_leaves_codes_scales_and_step_unchanged(fused, device):
    torch.manual_seed(0)
    x, index, weights, w1, w2 = Case(16, 32, 32, 2, 2).make(torch.float32, device=device)
    hyper = torch.tensor([1e-2, 0.9, 0.999, 1e-8, 0.0], dtype=torch.float64, device=device)
    state = _state(w2.shape, 3, device)
    update = _update(w2, state, torch.zeros((), device=device), hyper, fused)
    before = [t.clone() for t in (w2, *state[0], *state[1])]
    out, hpre, meta = ops.moe_mlp_fwd(x, index, weights, w1, w2, "silu")
    grad_out = torch.ones_like(out)
    grad_out[3, 5] = float("inf")
    ops.moe_mlp_bwd(
        grad_out, x, weights, w1, w2, hpre, meta, "silu", (False, False, False, True), down_proj_update=update
    )
    assert all(torch.equal(a, b) for a, b in zip((w2, *state[0], *state[1]), before, strict=True))
    assert (
        float(update.step) == 0.0 and int(update.skipped) == 1 and float(update.grad_norm_sq) == float("inf")
    )


@triton.jit
def _quantize_kernel(
    x_ptr, codes_ptr, scales_ptr, table_ptr, SIGNED: tl.constexpr, SIZE: tl.constexpr, STEPS: tl.constexpr,
    ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr, CLOSED_FORM: tl.constexpr,
):  # fmt: skip
    # BLOCK is a parameter: a compiled kernel cannot read a plain Python global (the interpreter can).
    rows = tl.arange(0, ROWS)
    x = tl.load(x_ptr + rows[:, None] * COLS + tl.arange(0, COLS)[None, :])
    codes, scales = quantize_tile(x, table_ptr, SIGNED, SIZE, STEPS, ROWS, COLS, CLOSED_FORM)
    tl.store(codes_ptr + rows[:, None] * COLS + tl.arange(0, COLS)[None, :], codes)
    tl.store(scales_ptr + rows[:, None] * (COLS // BLOCK) + tl.arange(0, COLS // BLOCK)[None, :], scales)


@pytest.mark.parametrize("closed_form", [False, True], ids=["search", "closed-form"])
@pytest.mark.parametrize("kind", q8.KINDS)
def test_the_kernels_quantization_equals_the_torch_one_ties_included(kind, closed_form, device):
    # Both of the kernel's quantizers (the binary search, the closed form) against the torch rule, on
    # random values, every exact tie, zero, the block's maximum and normalized values that are subnormal.
    x = _values(0, shape=(4, 4 * BLOCK))
    table = TABLES[kind].astype(np.float64)
    ties = [m for m in ((a + b) / 2 for a, b in itertools.pairwise(table)) if float(np.float32(m)) == m]
    x[2, :BLOCK] = [1.0, 1e-40, 1.4e-45, 2.0**-126, 2.0**-127, 0.0, *(2.0 ** -np.arange(1, BLOCK - 5))]
    x[3, :] = 0.0
    x[3, 0] = 1.0
    x[3, 1 : 1 + min(len(ties), 4 * BLOCK - 1)] = ties[: 4 * BLOCK - 1]
    if kind == "exp_avg_sq":
        x = np.abs(x)
    else:
        x[3, 1::2] *= -1.0
    values = torch.from_numpy(x).to(device)
    signed = kind == "exp_avg"
    codes = torch.empty(x.shape, dtype=torch.int8 if signed else torch.uint8, device=device)
    scales = torch.empty(x.shape[0], x.shape[1] // BLOCK, device=device)
    size = 128 if signed else 256
    table_slice = q8.tables(device)[:128] if signed else q8.tables(device)[128:]
    _quantize_kernel[(1,)](
        values, codes, scales, table_slice, signed, size, size.bit_length(), 4, 4 * BLOCK, BLOCK, closed_form
    )
    want_codes, want_scales = q8.quantize(values, kind)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)


def test_the_closed_form_thresholds_are_the_rules():
    # The kernel's constexpr thresholds fp32(2 ** (r / 8)) are the torch rule's, bit for bit.
    from sonar_kernels.kernels import moments_8bit as k8

    kernel = [getattr(k8, f"EIGHTH_{r}").value for r in range(1, 8)]
    assert kernel == q8._EIGHTHS[1:]
    assert kernel == [float(torch.tensor(2.0 ** (r / 8), dtype=torch.float64).float()) for r in range(1, 8)]


def test_a_transposed_layout_and_a_bias_are_refused_before_any_update(device):
    # The Triton epilogue's blocks lie along the wgrad's columns: a transposed layout's weight is not
    # contiguous along them, and a bias's columns are one; refused before anything is written.
    w2t = torch.randn(2, 32, 64, device=device)  # [E, I, H]: the transposed layout's down_proj
    hyper = torch.tensor([1e-2, 0.9, 0.999, 1e-8, 0.0], dtype=torch.float64, device=device)
    state = _state(w2t.shape, 3, device)
    update = _update(w2t, state, torch.zeros((), device=device), hyper, True)
    with pytest.raises(ValueError, match="contiguous along the wgrad's columns"):
        ops.triton_backend.wgrad.check_wgrad("down_proj", w2t, update, None, "concatenated_transposed")
    bias = torch.zeros(2, 32, device=device)
    bias_update = _update(bias, _state(bias.shape, 4, device), torch.zeros((), device=device), hyper, True)
    with pytest.raises(ValueError, match="a bias keeps exact moments"):
        ops.triton_backend.wgrad.check_wgrad("down_proj_bias", bias, bias_update, None)
    assert float(update.step) == 0.0
