"""The overflow bound of an update's gradient on the Triton backend (sonar_kernels/ops/triton_backend/update_bound.py): the
layer's magnitudes pass against torch's max |x| of each operand, and each update's flag against the torch
expression it replaces (sonar_kernels/ops/arithmetic.py, overflow_possible) on the same operands: random, huge,
NaN, inf, an expert without rows, all-zero and empty inputs, every expert tensor's operand set, with and
without the gradient of earlier micro-batches. The flag decides only whether the exact check pass runs;
tests/test_nonfinite.py shows the skipped updates themselves."""

from unittest import mock

import pytest
import torch

from sonar_kernels.kernels.update_bound import COLUMNS, TABLE
from sonar_kernels.ops.arithmetic import overflow_possible
from sonar_kernels.ops.triton_backend import update_bound
from sonar_kernels.ops.triton_backend.update_bound import (
    ENTRY_LIMITS,
    OPERAND_LIMITS,
    layer_magnitudes,
    magnitude_rows,
    magnitudes_numel,
    overflow_flag,
)
from sonar_kernels.specs import EXPERT_TENSORS

BF16_MAX = torch.finfo(torch.bfloat16).max
FP16_MAX = torch.finfo(torch.float16).max


def _rows(magnitudes: torch.Tensor) -> torch.Tensor:
    """The pass's rows of a layer's magnitudes buffer (past the flags' table)."""
    return magnitudes[TABLE:].view(-1, COLUMNS)


def _largest(t: torch.Tensor) -> torch.Tensor:
    """max |t| in fp32, a NaN counted as inf (0 for an empty t): what the pass computes, from torch."""
    if t.numel() == 0:
        return torch.zeros(())
    t = t.float().abs()
    return torch.where(torch.isnan(t), float("inf"), t).amax()


def _operands(T, H, top_k, E, scale, dtype, generator, poison=None, counts=None):
    """(X, dO, top_k_weights, the dHpre kernel's [n, 2] maxima, expert_offsets): random values times
    ``scale`` (a power of two per tensor), ``poison`` ("nan" / "inf") written into dO."""
    x = (torch.randn(T, H, generator=generator) * scale[0]).to(dtype)
    grad_out = (torch.randn(T, H, generator=generator) * scale[1]).to(dtype)
    weights = torch.rand(T, top_k, generator=generator) * scale[2]
    absmax = torch.rand(11, 2, generator=generator) * scale[3]
    if poison is not None and T > 0:
        grad_out[T // 2, H - 1] = float(poison)
    if counts is None:
        counts = torch.randint(0, 2 * T + 1, (E,), generator=generator)
        counts[E // 2] = 0  # an expert without rows
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0)
    return x, grad_out, weights, absmax, offsets


def _torch_flag(name, operands, grad_in, entry_limit, operand_limit):
    """overflow_possible on the operands' magnitudes as ops/triton_backend/wgrad.py computed them before the kernels."""
    x, grad_out, weights, absmax, offsets = operands
    most_rows = (offsets[1:] - offsets[:-1]).amax().float()
    largest_a, largest_dhpre = absmax.amax(0) if absmax.numel() else torch.zeros(2)
    down = name.startswith("down_proj")
    p_max = _largest(weights) * _largest(grad_out) if down else largest_dhpre
    q_max = {"down_proj": largest_a, "gate_up_proj": _largest(x), "up_proj": _largest(x)}.get(
        name, torch.ones(())
    )
    return overflow_possible((p_max, q_max, most_rows), grad_in, entry_limit, operand_limit)


def _kernel_flags(operands, grad_in, entry_limit, operand_limit, own_launch=False):
    """Each expert tensor's flag from the layer's magnitudes: read from the table (with grad_in: the
    update's own launch), or with ``own_launch`` every one from its own launch."""
    x, grad_out, weights, absmax, offsets = operands
    magnitudes = layer_magnitudes(x, grad_out, weights, absmax, offsets)
    with mock.patch.object(update_bound, "ENTRY_LIMITS", () if own_launch else update_bound.ENTRY_LIMITS):
        return {
            name: overflow_flag(magnitudes, name, grad_in, entry_limit, operand_limit)
            for name in EXPERT_TENSORS
        }


# T below the pass's row block; T over several blocks, one per program; more blocks than programs (the pass
# held to 4 programs: each takes several blocks); odd H over the column block; top_k 1 and 3; E prime.
SHAPES = [
    pytest.param(5, 24, 1, 3, None, id="T5-H24-k1-E3"),
    pytest.param(40, 300, 3, 7, None, id="T40-H300-k3-E7"),
    pytest.param(210, 8, 2, 5, 4, id="T210-H8-k2-E5-4programs"),
]


@pytest.mark.parametrize(("T", "H", "top_k", "E", "programs"), SHAPES)
@pytest.mark.parametrize("poison", [None, "nan", "inf"])
def test_magnitudes_are_each_operands_largest(T, H, top_k, E, programs, poison, monkeypatch):
    if programs is not None:
        monkeypatch.setattr(update_bound, "MAX_PROGRAMS", programs)
    generator = torch.Generator().manual_seed(T + H)
    operands = _operands(T, H, top_k, E, (1.0, 2.0**40, 3.0, 0.5), torch.bfloat16, generator, poison)
    x, grad_out, weights, absmax, offsets = operands
    magnitudes = layer_magnitudes(x, grad_out, weights, absmax, offsets)
    assert magnitudes.shape == (magnitudes_numel(T),)
    assert _rows(magnitudes).shape[0] == magnitude_rows(T) == (programs or magnitude_rows(T))
    expected = torch.stack(
        [
            *absmax.amax(0),
            _largest(weights),
            _largest(grad_out),
            _largest(x),
            (offsets[1:] - offsets[:-1]).amax().float(),
        ]
    )
    got = _rows(magnitudes).amax(0)
    assert torch.equal(got, expected), (got, expected)
    assert bool(torch.isinf(got[3])) == (poison is not None)


def test_magnitudes_read_strided_and_broadcast_grad_out():
    # dO of out.sum(): stride 0 in both dims; X a column slice; the weights transposed.
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(33, 64, generator=generator)[:, ::2]
    weights = torch.rand(3, 33, generator=generator).t()
    grad_out = torch.full((), -7.5).expand(33, 32)
    offsets = torch.tensor([0, 40, 40, 99], dtype=torch.int32)
    magnitudes = _rows(layer_magnitudes(x, grad_out, weights, None, offsets)).amax(0)
    expected = torch.tensor([0.0, 0.0, float(_largest(weights)), 7.5, float(_largest(x)), 59.0])
    assert torch.equal(magnitudes, expected), magnitudes


@pytest.mark.parametrize("own_launch", [False, True], ids=["table", "own-launch"])
def test_flag_is_the_torch_expressions_on_random_magnitudes(own_launch):
    # Magnitudes over 2**-20 .. 2**40 against each pair of limits: both decisions occur. The flags the
    # layer's table holds (grad_in: the update's own launch), or every flag from its own launch.
    generator = torch.Generator().manual_seed(2)
    decisions = {0.0: 0, 1.0: 0}
    for case in range(24):
        scale = tuple(float(2.0 ** torch.randint(-20, 41, (), generator=generator)) for _ in range(4))
        counts = torch.randint(
            0, 2 ** int(torch.randint(1, 20, (), generator=generator)), (5,), generator=generator
        )
        operands = _operands(12, 40, 2, 5, scale, torch.float32, generator, counts=counts)
        entry_limit = (2.0**63, FP16_MAX, 128.0)[case % 3]
        operand_limit = OPERAND_LIMITS[case % 3 if case % 2 else (case + 1) % 3]
        grad_in = None if case % 4 else torch.randn(3, 4, generator=generator) * scale[0]
        flags = _kernel_flags(operands, grad_in, entry_limit, operand_limit, own_launch)
        for name, flag in flags.items():
            expected = _torch_flag(name, operands, grad_in, entry_limit, operand_limit)
            assert flag.shape == () and flag.dtype == torch.float32
            assert torch.equal(flag, expected), (case, name, flag, expected)
            decisions[float(flag)] += 1
    assert min(decisions.values()) > 10, decisions


@pytest.mark.parametrize(
    "case", ["nan", "inf", "grad_in-nan", "all-zero", "all-zero-inf", "empty", "huge-weights"]
)
def test_flag_on_edge_inputs(case):
    # A NaN or inf anywhere: 1.0 for every tensor whose operands meet it (as the torch expression: NaN
    # compares false). All zero: 0.0. No tokens: nothing bounds a gradient above 0. A weight beyond fp16.
    generator = torch.Generator().manual_seed(3)
    T = 0 if case == "empty" else 9
    poison = {"nan": "nan", "inf": "inf", "all-zero-inf": "inf"}.get(case)
    scale = (0.0, 0.0, 0.0, 0.0) if case.startswith("all-zero") else (1.0, 1.0, 1.0, 1.0)
    if case == "huge-weights":
        scale = (1.0, 1.0, 2.0**17, 1.0)
    operands = _operands(T, 16, 2, 4, scale, torch.float32, generator, poison)
    if T == 0:  # the dHpre kernel did not run: no maxima
        operands = (*operands[:3], torch.zeros(0, 2), operands[4])
    grad_in = torch.tensor([1.0, float("nan")]) if case == "grad_in-nan" else None
    flags = _kernel_flags(operands, grad_in, 2.0**63, FP16_MAX)
    expected = {name: _torch_flag(name, operands, grad_in, 2.0**63, FP16_MAX) for name in EXPERT_TENSORS}
    for name in EXPERT_TENSORS:
        assert torch.equal(flags[name], expected[name]), (name, flags[name], expected[name])
    down = float(flags["down_proj"])
    assert down == {"all-zero": 0.0, "empty": 0.0, "grad_in-nan": 1.0, "huge-weights": 1.0}.get(case, 1.0)
    if case in ("nan", "inf", "all-zero-inf"):  # dO: the down projection's operand, not the gate/up's
        assert float(flags["gate_up_proj"]) == 0.0 and float(flags["gate_up_proj_bias"]) == 0.0


def _boundary(flag_of, low: float, high: float) -> torch.Tensor:
    """The largest fp32 p in [low, high) whose torch flag is 0.0 (flag_of(low) 0.0, flag_of(high) 1.0)."""
    lo, hi = torch.tensor(low), torch.tensor(high)
    while torch.nextafter(lo, hi) != hi:
        mid = ((lo.double() + hi.double()) / 2).float()
        mid = torch.nextafter(lo, hi) if mid in (lo, hi) else mid
        lo, hi = (mid, hi) if float(flag_of(mid)) == 0.0 else (lo, mid)
    return lo


@pytest.mark.parametrize(
    ("limit", "operand_limit"), [(128.0, BF16_MAX), (2.0**63, FP16_MAX)], ids=["entry", "operand"]
)
def test_flag_at_the_last_fp32_step_of_the_limit(limit, operand_limit):
    # dHpre's largest p next to where the torch expression turns (the entry limit through total * 1.03, or
    # the operand limit through p * 1.01): the kernel's flag at the last 0.0 and the first 1.0.
    offsets = torch.tensor([0, 3, 3, 5], dtype=torch.int32)  # 3 rows at most, an expert without rows
    x, grad_out, weights = torch.ones(2, 4), torch.ones(2, 4), torch.ones(2, 1)

    def flag_of(p, kernel=False):
        absmax = torch.stack([torch.ones(()), p]).view(1, 2)
        operands = (x, grad_out, weights, absmax, offsets)
        if kernel:  # from the table, and from the update's own launch
            return [
                _kernel_flags(operands, None, limit, operand_limit, own)["gate_up_proj_bias"]
                for own in (0, 1)
            ]
        return _torch_flag("gate_up_proj_bias", operands, None, limit, operand_limit)

    last = _boundary(flag_of, 1.0, min(limit, operand_limit))
    first = torch.nextafter(last, torch.tensor(float("inf")))
    assert float(flag_of(last)) == 0.0 and float(flag_of(first)) == 1.0
    assert [float(f) for f in flag_of(last, kernel=True)] == [0.0, 0.0]
    assert [float(f) for f in flag_of(first, kernel=True)] == [1.0, 1.0]


def test_a_flag_of_the_table_is_a_view_that_starts_16_bytes_aligned():
    # The check pass reads it through a pointer the JIT specialises on 16-byte alignment: every flag of the
    # table keeps the check pass's compiled variant.
    assert ENTRY_LIMITS == (2.0**63, FP16_MAX, 128.0)
    generator = torch.Generator().manual_seed(4)
    operands = _operands(6, 8, 2, 3, (1.0, 1.0, 1.0, 1.0), torch.float32, generator)
    magnitudes = layer_magnitudes(*operands)
    for entry_limit in ENTRY_LIMITS:
        for operand_limit in OPERAND_LIMITS:
            for name in EXPERT_TENSORS:
                flag = overflow_flag(magnitudes, name, None, entry_limit, operand_limit)
                assert flag.shape == () and flag.data_ptr() % 16 == 0
                assert flag.untyped_storage().data_ptr() == magnitudes.untyped_storage().data_ptr()
                assert torch.equal(flag, _torch_flag(name, operands, None, entry_limit, operand_limit))
