"""Shapes and routings of the expert MLP tests, each naming the edge it covers."""

from dataclasses import dataclass

import pytest
import torch


@dataclass(frozen=True)
class Case:
    T: int
    H: int
    I: int
    E: int
    top_k: int
    routing: str = "topk"  # "topk" | "skip-experts" | "one-expert" | "sentinels"

    def make(self, dtype, weight_dtype=None, index_dtype=torch.int64, device="cpu"):
        """hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj (seeded by the caller)."""
        weight_dtype = weight_dtype or dtype
        T, H, I, E, k = self.T, self.H, self.I, self.E, self.top_k
        x = torch.randn(T, H).to(dtype)
        scores = torch.rand(T, E)
        if self.routing == "skip-experts":
            scores[:, ::2] = -1.0  # even experts never chosen
        index = scores.topk(k, dim=1).indices
        if self.routing == "one-expert":
            index = torch.full((T, k), E // 2)
        if self.routing == "sentinels":
            index[::3, 0] = -1  # dropped slots, as expert parallelism marks them
            index[1::4, -1] = E
        weights = torch.softmax(torch.randn(T, k), dim=1).to(dtype)
        w1 = (torch.randn(E, 2 * I, H) / H**0.5).to(weight_dtype)
        w2 = (torch.randn(E, H, I) / I**0.5).to(weight_dtype)
        return (
            x.to(device),
            index.to(index_dtype).to(device),
            weights.to(device),
            w1.to(device),
            w2.to(device),
        )


CASES = [
    # T = 1: a single token.
    pytest.param(Case(1, 32, 16, 4, 2), id="T1-H32-I16-E4-k2"),
    # T below one row tile (64 rows); H and I not multiples of 16.
    pytest.param(Case(5, 40, 24, 3, 2), id="T5-H40-I24-E3-k2"),
    # Odd H and I, prime E.
    pytest.param(Case(37, 33, 17, 7, 3), id="T37-H33-I17-E7-k3"),
    # top_k = 1, several row tiles in all.
    pytest.param(Case(150, 48, 32, 5, 1), id="T150-H48-I32-E5-k1"),
    # top_k = E: every token on every expert; an expert spans two row tiles.
    pytest.param(Case(70, 32, 16, 4, 4), id="T70-H32-I16-E4-k4"),
    # Experts with no tokens (every even expert).
    pytest.param(Case(40, 32, 20, 6, 2, "skip-experts"), id="T40-H32-I20-E6-k2-empty-experts"),
    # Every token on one expert: 130 rows, three row tiles, all other experts empty.
    pytest.param(Case(130, 32, 16, 5, 1, "one-expert"), id="T130-H32-I16-E5-k1-one-expert"),
    # Sentinel ids -1 and E mixed into top_k_index.
    pytest.param(Case(30, 32, 16, 5, 3, "sentinels"), id="T30-H32-I16-E5-k3-sentinels"),
    # H and I wider than one column tile (64), K loop over several blocks.
    pytest.param(Case(20, 96, 80, 3, 2), id="T20-H96-I80-E3-k2"),
    # Several wgrad tiles per expert (dW1 is [140, 136], dW2 [136, 70]; tiles of 128 x 64).
    pytest.param(Case(12, 136, 70, 3, 2), id="T12-H136-I70-E3-k2"),
]
