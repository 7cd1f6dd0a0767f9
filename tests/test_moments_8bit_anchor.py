"""8-bit moments against the anchor, torchao's AdamW8bit (docs/design.md, "8-bit moments", "Against
torchao's AdamW8bit"): the same 20 gradients fed to ExpertAdamW(moments_dtype="8bit") and to
torchao.optim.AdamW8bit give weights within a bound derived from the two schemes' code steps.

The bound is not fitted: it is computed, element by element, by interval arithmetic from each scheme's
map and block layout and from exact AdamW (float64, unquantized moments) on the same gradients. With
gradients that do not depend on the weights, each scheme's moments depend only on the gradients, so:

- exp_avg: exact ``m*_t = b1 m*_{t-1} + (1 - b1) g_t``; a scheme's update reads
  ``m^_t = b1 q_{t-1} + (1 - b1) g_t`` (its stored, quantized value of the previous step, then the fresh
  gradient: both schemes update the weight from the unquantized m^_t and store q_t = Q(m^_t)). With
  ``E_t`` a bound of ``|q_t - m*_t|``: ``|m^_t - m*_t| <= D_t = b1 E_{t-1}`` and
  ``E_t <= D_t + err_Q(m^_t)``, where ``err_Q`` is the nearest-entry error of the scheme's map at the
  block's scale: half the gap between the map's entries around ``|m^| / scale``, times the scale (the whole
  gap below the smallest entry of a map without zero, or beyond the last one). ``|m^|`` and the block's
  scale are known only within the interval ``|m*| +- D``: the gap is the largest the map has up to the
  interval's top (its normalized value at the smallest scale), times the largest scale. So the error of
  one step is carried on, shrinking by b1 each step (up to 1/(1 - b1) times one step's error in all).
- exp_avg_sq: the same with b2; the value read is at least ``(1 - b2) g_t ** 2`` (a stored code is >= 0).
- the update ``u = lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`` is monotone in m and in v: its extremes
  over the box ``m^ in m* +- D_m``, ``v^ in [max(v* - D_v, (1 - b2) g ** 2), v* + D_v]`` bound
  ``|u - u*|``; the weight's bound grows as ``W_t = (1 - lr wd) W_{t-1} + |u - u*|``.
- each rounding to fp32 (the schemes' arithmetic) adds a relative 2 ** -20 to every term, far above the
  few fp32 roundings per step (2 ** -24 each).

Both schemes must sit inside their own bound of exact AdamW, and so the two within the sum of both.
"""

from __future__ import annotations

import pytest
import torch
from torchao.optim import AdamW8bit, quant_utils  # the [test] extra

import sonar_kernels

SHAPE = (4, 64, 256)  # torchao quantizes tensors of >= 4096 elements in flat blocks of 256: here rows
STEPS = 20
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1
SLACK = 2.0**-20  # relative, per term and step: the fp32 roundings of the schemes' arithmetic

pytestmark = pytest.mark.timeout(300)


def _gradients() -> list[torch.Tensor]:
    """Rows whose scales spread over about 3 decades, entries over about 2 decades within a row, a
    mean that persists over steps: blocks hold small and large moments, as real expert gradients do."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.exp(1.5 * torch.randn(*SHAPE[:2], 1, generator=generator))
    mean = 0.3 * torch.randn(SHAPE, generator=generator)
    spread = torch.exp(torch.randn(SHAPE, generator=generator))
    return [(rows * (mean + spread * torch.randn(SHAPE, generator=generator))).float() for _ in range(STEPS)]


class Map:
    """A quantization map as a bound needs it: the largest error of one quantization, as a fraction of
    the block's scale, for normalized values up to ``n`` in magnitude (monotone in ``n``)."""

    def __init__(self, entries, signed: bool):
        entries = torch.as_tensor(sorted(float(e) for e in entries), dtype=torch.float64)
        low = -1.0 if signed else 0.0
        # Buckets between neighbouring entries (error: half the gap), and from the domain's ends to the
        # first and last entries (error: the whole distance).
        starts = torch.cat([torch.tensor([low]), entries])
        ends = torch.cat([entries, torch.tensor([1.0])])
        errors = torch.cat([entries[:1] - low, (entries[1:] - entries[:-1]) / 2, 1.0 - entries[-1:]])
        keep = ends > starts
        self.starts, self.ends, self.errors = starts[keep], ends[keep], errors[keep]
        self.signed = signed

    def error(self, n: torch.Tensor) -> torch.Tensor:
        """The largest error over the buckets that meet [-n, n] (signed) or [0, n]."""
        reach = self.starts[None, :] <= n.reshape(-1, 1)
        if self.signed:
            reach &= self.ends[None, :] >= -n.reshape(-1, 1)
        return torch.where(reach, self.errors[None, :], 0.0).amax(dim=1).reshape(n.shape)


def _our_maps() -> tuple[Map, Map]:
    """The documented maps (docs/design.md): exp_avg by magnitude {0} U {2 ** ((k - 127) / 8)}, signed by
    its own bit (the same error either sign); exp_avg_sq {2 ** ((c - 255) / 8)}, no zero."""
    k = torch.arange(1, 128, dtype=torch.float64)
    magnitudes = [0.0, *torch.exp2((k - 127) / 8).float().tolist()]
    levels = torch.exp2((torch.arange(256, dtype=torch.float64) - 255) / 8).float().tolist()
    return Map(magnitudes, signed=False), Map(levels, signed=False)


def _torchao_maps() -> tuple[Map, Map]:
    """torchao's dynamic-tree maps (bitsandbytes' dynamic map), signed for exp_avg, unsigned for
    exp_avg_sq, applied to the signed normalized value."""
    signed = quant_utils.create_dynamic_map(signed=True)
    unsigned = quant_utils.create_dynamic_map(signed=False)
    return Map(torch.tensor(signed).float().tolist(), True), Map(
        torch.tensor(unsigned).float().tolist(), False
    )


def _block_max(t: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block maximum, blocks of ``block`` along the flattened last dimension."""
    blocks = t.reshape(-1, block)
    return blocks.amax(dim=1, keepdim=True).expand_as(blocks).reshape(t.shape)


def _quantization_error(value: torch.Tensor, deviation: torch.Tensor, qmap: Map, block: int) -> torch.Tensor:
    """A bound of |Q(x) - x| for every x within ``value +- deviation`` (magnitudes), blocks of ``block``."""
    top = value.abs() + deviation
    bottom = (value.abs() - deviation).clamp(min=0.0)
    scale_hi, scale_lo = _block_max(top, block), _block_max(bottom, block)
    n = torch.where(scale_lo > 0, top / scale_lo.clamp(min=1e-300), 1.0).clamp(max=1.0)
    return scale_hi * qmap.error(n) * (1 + SLACK) + SLACK * top


def _bound(gradients: list[torch.Tensor], maps: tuple[Map, Map], block: int):
    """Exact AdamW's weight change (float64, from weight 0) and a bound of a scheme's distance to it."""
    beta1, beta2 = BETAS
    m_star = torch.zeros(SHAPE, dtype=torch.float64)
    v_star = torch.zeros_like(m_star)
    w_star = torch.zeros_like(m_star)  # the weights' change: the initial weight scaled plus this
    e_m, e_v, w_bound = (torch.zeros_like(m_star) for _ in range(3))
    decay = 1 - LR * WD
    for t, g in enumerate(gradients, start=1):
        g = g.double()
        m_star = beta1 * m_star + (1 - beta1) * g
        v_star = beta2 * v_star + (1 - beta2) * g * g
        d_m = beta1 * e_m * (1 + SLACK) + SLACK * m_star.abs()
        d_v = beta2 * e_v * (1 + SLACK) + SLACK * v_star
        e_m = d_m + _quantization_error(m_star, d_m, maps[0], block)
        e_v = d_v + _quantization_error(v_star, d_v, maps[1], block)
        step_size, root = LR / (1 - beta1**t), (1 - beta2**t) ** 0.5

        def update(m, v, step_size=step_size, root=root):
            return step_size * m / (v.sqrt() / root + EPS)

        v_lo = torch.maximum(v_star - d_v, (1 - beta2) * g * g * (1 - SLACK))
        v_hi = v_star + d_v
        m_hi, m_lo = m_star + d_m, m_star - d_m
        u_star = update(m_star, v_star)
        u_max = update(m_hi, torch.where(m_hi > 0, v_lo, v_hi))
        u_min = update(m_lo, torch.where(m_lo > 0, v_hi, v_lo))
        w_star = decay * w_star - u_star
        w_bound = decay * w_bound + torch.maximum(u_max - u_star, u_star - u_min) * (1 + SLACK)
        w_bound += SLACK * (u_max.abs() + u_min.abs())
    return w_star, w_bound


def _run_ours(weight: torch.Tensor, gradients, lr: float = LR) -> torch.Tensor:
    p = torch.nn.Parameter(weight.clone())
    optimizer = sonar_kernels.ExpertAdamW(
        [p], lr=lr, betas=BETAS, eps=EPS, weight_decay=WD * LR / lr, moments_dtype="8bit"
    )
    for g in gradients:
        p.grad = g.clone()
        optimizer.step()
    assert float(optimizer.state[p]["step"]) == STEPS and p.grad is None
    return p.detach()


def _run_torchao(weight: torch.Tensor, gradients) -> torch.Tensor:
    p = torch.nn.Parameter(weight.clone())
    optimizer = AdamW8bit([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for g in gradients:
        p.grad = g.clone()
        optimizer.step()
    assert type(optimizer.state[p]["exp_avg"]).__name__ == "OptimState8bit"  # quantized, not a fallback
    return p.detach()


@pytest.fixture(scope="module")
def runs():
    gradients = _gradients()
    weight = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    ours, torchao = _run_ours(weight, gradients), _run_torchao(weight, gradients)
    decayed = weight.double() * (1 - LR * WD) ** STEPS
    exact, ours_bound = _bound(gradients, _our_maps(), block=32)
    _, torchao_bound = _bound(gradients, _torchao_maps(), block=256)
    return {
        "ours": ours.double(), "torchao": torchao.double(), "exact": decayed + exact, "start": weight.double(),
        "ours_bound": ours_bound, "torchao_bound": torchao_bound,
    }  # fmt: skip


def test_each_scheme_is_within_its_bound_of_exact_adamw(runs):
    for name in ("ours", "torchao"):
        distance = (runs[name] - runs["exact"]).abs()
        assert bool((distance <= runs[f"{name}_bound"]).all()), (
            name,
            float((distance / runs[f"{name}_bound"]).max()),
        )


def test_the_8bit_state_and_torchao_adamw8bit_give_weights_within_the_bound(runs):
    distance = (runs["ours"] - runs["torchao"]).abs()
    bound = runs["ours_bound"] + runs["torchao_bound"]
    assert bool((distance <= bound).all()), float((distance / bound).max())


def test_the_bound_is_broken_by_a_run_with_another_learning_rate(runs):
    # The bound is a worst case (a deterministic rounding can hold an average up to a code step over
    # 1 - beta away from exact: docs/design.md), far above the typical distance, yet not vacuous: the
    # same scheme with lr 1.5x (the same decay lr * wd) leaves it.
    gradients = _gradients()
    other = _run_ours(runs["start"].float(), gradients, lr=1.5 * LR).double()
    assert bool(((other - runs["exact"]).abs() > runs["ours_bound"]).any())
