"""One tolerance table, keyed by dtype, and the normwise error used by every numerical test."""

import torch

# Normwise relative error ||a - b|| / ||b|| against a float64 evaluation of reference.py on the same
# (already rounded) inputs. fp32: the bound. bf16 and fp16: the forward rounds four times (Hpre,
# the activation, the expert output, the combined output), so the bound is 4u, u the unit roundoff
# (bf16 2^-8, fp16 2^-11).
TOLERANCE = {
    torch.float32: 1e-5,
    torch.bfloat16: 4 * 2.0**-8,
    torch.float16: 4 * 2.0**-11,
}

# Against reference.py evaluated in the same dtype (the same rounding points): only the order of the fp32
# sums differs, which flips a few elements by one ulp. u/8 for bf16, u/2 for fp16 (finer, more flips).
SAME_ROUNDING_TOLERANCE = {
    torch.float32: 1e-5,
    torch.bfloat16: 2.0**-11,
    torch.float16: 2.0**-12,
}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, b = actual.detach().double(), expected.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(torch.float64).tiny))


def assert_close(actual, expected, dtype, what="output", tolerances=TOLERANCE):
    """Normwise check at tolerances[dtype]; on failure report relative and max abs errors."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values (an unwritten element reads as NaN)"
    err = rel_err(actual, expected)
    max_abs = (
        float((actual.detach().double() - expected.detach().double()).abs().max()) if actual.numel() else 0.0
    )
    tol = tolerances[dtype]
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.2e} ({dtype}); max abs error {max_abs:.3e}"
    return err


def to_double(*tensors):
    return tuple(t.double() if t.is_floating_point() else t for t in tensors)


def assert_same_run(a, b):
    """Two runs (model, optimizer) hold the same bits: every parameter, and every tensor of every parameter's
    optimizer state with the same keys (``step``, the moments, the lagged clipping coefficient ...)."""
    (model_a, optimizer_a), (model_b, optimizer_b) = a, b
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q), f"{name}: {(p.float() - q.float()).abs().max()}"
    saved_a, saved_b = optimizer_a.state_dict(), optimizer_b.state_dict()
    assert saved_a["state"].keys() == saved_b["state"].keys()
    for index, state in saved_a["state"].items():
        assert state.keys() == saved_b["state"][index].keys(), index
        for key, value in state.items():
            other = saved_b["state"][index][key]
            assert value.dtype == other.dtype and torch.equal(value, other), f"state {index} {key}"
