"""reference.py against independent, naive formulations (loops over tokens and slots, float64)."""

import math

import pytest
import torch
import torch.nn.functional as F
from cases import CASES, Case
from numerics import rel_err, to_double

from sonar_kernels import reference


def naive_routing(top_k_index, E):
    """Rows in expert order, slots in increasing order within an expert; ids outside [0, E) dropped."""
    flat = top_k_index.reshape(-1).tolist()
    slots = [s for e in range(E) for s, i in enumerate(flat) if i == e]
    counts = [sum(1 for i in flat if i == e) for e in range(E)]
    return slots, counts


@pytest.mark.parametrize("case", CASES)
def test_routing_metadata_is_a_stable_sort_by_expert(case):
    _, index, *_ = case.make(torch.float32)
    top_k = case.top_k
    meta = reference.routing_metadata(index, case.E, block_m=4)
    slots, counts = naive_routing(index, case.E)
    n = len(slots)
    assert meta.expert_offsets.tolist() == [sum(counts[:e]) for e in range(case.E + 1)]
    assert meta.tile_offsets.tolist() == [sum(-(-c // 4) for c in counts[:e]) for e in range(case.E + 1)]
    assert meta.slot_of_row[:n].tolist() == slots
    assert meta.token_of_row[:n].tolist() == [s // top_k for s in slots]
    row_of_slot = [-1] * index.numel()
    for r, s in enumerate(slots):
        row_of_slot[s] = r
    assert meta.row_of_slot.tolist() == row_of_slot


def naive_moe_mlp(x, index, weights, w1, w2, activation):
    """out[t] = sum_j w[t, j] * W2[e] (act(W1[e, :I] x) * (W1[e, I:] x)), one slot at a time."""
    E, two_I, _ = w1.shape
    I = two_I // 2
    act = {
        "silu": F.silu,
        "gelu": F.gelu,
        # The tanh GELU written out (Hendrycks and Gimpel, 2016), independent of F.gelu(approximate="tanh").
        "gelu_tanh": lambda v: 0.5 * v * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3))),
    }[activation]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            if 0 <= e < E:
                h = act(w1[e, :I] @ x[t]) * (w1[e, I:] @ x[t])
                out[t] += weights[t, j] * (w2[e] @ h)
    return out


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("case", CASES[:4] + CASES[-3:-1])
def test_reference_float64_matches_naive_loop(case, activation):
    inputs = to_double(*case.make(torch.float32))
    out = reference.moe_mlp(*inputs, activation=activation)
    assert out.dtype == torch.float64
    assert rel_err(out, naive_moe_mlp(*inputs, activation)) < 1e-12


def test_reference_gradients_pass_gradcheck():
    # Small enough for finite differences over every weight entry (about 2 s): dropped slots (sentinels),
    # top-2, an expert left without tokens by the sentinels.
    x, index, w, w1, w2 = to_double(*Case(6, 8, 4, 4, 2, "sentinels").make(torch.float32))

    def f(x, w, w1, w2):
        return reference.moe_mlp(x, index, w, w1, w2)

    assert torch.autograd.gradcheck(f, tuple(t.requires_grad_() for t in (x, w, w1, w2)))
