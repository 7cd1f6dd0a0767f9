"""bf16 expert weights trained with fp32 precision: ``master_weights="remainder"`` and ``"stochastic"``
(docs/usage.md, "bf16 master weights"; the rules: docs/design.md, "bf16 master weights").

    python examples/master_weights_bf16.py

The expert weights stay the model's plain bf16 tensors (what the GEMMs, transformers and checkpoints read).
With ``"remainder"`` the optimizer keeps an int16 remainder per element (``state[p]["remainder"]``, 2 bytes)
that completes the bf16 weight to an fp32 master: bits(master) = bits(weight) * 2**16 + remainder, the
weight being the master rounded to nearest (a tie away from zero). AdamW runs on that master, so on the
torch backend (a CPU) the master follows torch.optim.AdamW on fp32 master weights bit for bit. With
``"stochastic"`` there is no master: each update is rounded to bf16 stochastically, unbiased, with a
stream keyed by ``rounding_seed``, the step and the element, so a run repeats with the same seed.

What it checks, on one bf16 SonarExperts layer trained for a few steps:

- remainder: after every step the master rebuilt from (weight, remainder) by the formula above equals the
  fp32 master of torch.optim.AdamW(fused=True), bit for bit, fed the same bf16 gradients (its forward reads
  its masters rounded to bf16 by the same rule), and so do exp_avg and exp_avg_sq;
- stochastic: two runs with one seed give the same bits, and a run with another seed other bits.

It also prints how far each run's bf16 weights end from the fp32 masters: for the remainder only the final
rounding to bf16 (about 2**-9 relative), for plain bf16 training (no master: every update rounded to
nearest) and stochastic rounding that plus the rounding of every update (stochastic rounding is unbiased,
so its advantage shows over many steps, not ten).
"""

import torch

import sonar_kernels

E, H, I, TOP_K, T = 4, 32, 16, 2, 24
STEPS = 10
HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}


def bf16_nearest(master: torch.Tensor) -> torch.Tensor:
    """The fp32 ``master`` rounded to the nearest bf16, a tie away from zero: bits(weight) =
    floor((bits(master) + 2**15) / 2**16). (torch's ``.to(torch.bfloat16)`` rounds a tie to even.)"""
    bits = master.view(torch.int32).to(torch.int64)
    return ((bits + 2**15) >> 16).to(torch.int16).view(torch.bfloat16)


def master_of(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a bf16 ``weight`` and its int16 ``remainder``: bits = bits(weight) * 2**16 +
    remainder."""
    bits = (weight.view(torch.int16).to(torch.int32) << 16) + remainder.to(torch.int32)
    return bits.view(torch.float32)


def batch(step: int):
    """Tokens, a router's choice and a target for ``step``."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(T, H, generator=generator).to(torch.bfloat16)
    weights, index = torch.randn(T, E, generator=generator).softmax(dim=-1).topk(TOP_K, dim=-1)
    return x, index, weights.to(torch.bfloat16), torch.randn(T, H, generator=generator)


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).square().mean()


def bf16_layer() -> sonar_kernels.SonarExperts:
    torch.manual_seed(0)
    return sonar_kernels.SonarExperts(E, H, I, dtype=torch.bfloat16)  # backend "auto": torch on a CPU


def train(master_weights, rounding_seed=0, reference=None) -> sonar_kernels.SonarExperts:
    """``STEPS`` steps of a bf16 layer with SonarAdamW(master_weights=...); with ``reference`` (fp32 masters
    and their torch.optim.AdamW) each step is checked against it bit for bit."""
    layer = bf16_layer()
    optimizer = sonar_kernels.SonarAdamW(
        layer, **HYPER, master_weights=master_weights, rounding_seed=rounding_seed
    )
    for step in range(STEPS):
        x, index, weights, target = batch(step)
        loss_of(layer(x, index, weights), target).backward()  # the update runs here, on the masters
        optimizer.step()
        optimizer.zero_grad()
        if reference is not None:
            masters, adamw = reference
            adamw_step(masters, adamw, step)
            if not follows(layer, optimizer, masters, adamw):
                raise SystemExit(f"step {step + 1}: the remainder's master differs from the fp32 run")
    return layer


def follows(layer, optimizer, masters, adamw) -> bool:
    """Whether each bf16 weight and its remainder (int16, 2 bytes an element) make the fp32 master of
    torch.optim.AdamW, bit for bit, the weight being that master rounded to nearest, and the moments are
    torch.optim.AdamW's."""
    for p, m in zip(layer.parameters(), masters, strict=True):
        state, want = optimizer.state[p], adamw.state[m]
        remainder = state["remainder"]
        if remainder.dtype != torch.int16 or remainder.shape != p.shape:
            return False
        if not torch.equal(master_of(p.detach(), remainder).view(torch.int32), m.detach().view(torch.int32)):
            return False
        if not torch.equal(p.detach().view(torch.int16), bf16_nearest(m.detach()).view(torch.int16)):
            return False
        if not all(torch.equal(state[key], want[key]) for key in ("exp_avg", "exp_avg_sq")):
            return False
    return True


def adamw_step(masters, adamw, step: int) -> None:
    """One step of torch.optim.AdamW(fused=True) on fp32 masters: the forward reads bf16 copies (the
    masters rounded to nearest), whose bf16 gradients, as fp32, update the masters."""
    x, index, weights, target = batch(step)
    copies = [bf16_nearest(m.detach()).requires_grad_() for m in masters]
    loss_of(sonar_kernels.moe_mlp(x, index, weights, *copies), target).backward()
    for m, copy in zip(masters, copies, strict=True):
        m.grad = copy.grad.float()
    adamw.step()
    adamw.zero_grad()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normwise relative difference ||a - b|| / ||b||."""
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def main() -> None:
    masters = [torch.nn.Parameter(p.detach().float()) for p in bf16_layer().parameters()]
    adamw = torch.optim.AdamW(masters, **HYPER, fused=True)
    remainder = train("remainder", reference=(masters, adamw))  # raises at the first differing step

    stochastic = [train("stochastic", rounding_seed=seed) for seed in (7, 7, 8)]
    repeats = all(
        torch.equal(p, q) for p, q in zip(stochastic[0].parameters(), stochastic[1].parameters(), strict=True)
    )
    differs = any(
        not torch.equal(p, q)
        for p, q in zip(stochastic[0].parameters(), stochastic[2].parameters(), strict=True)
    )
    plain = train(None)  # bf16 weights and bf16 moments, no master

    if not (repeats and differs):
        raise SystemExit(
            f"stochastic rounding: same seed same bits {repeats}, other seed other bits {differs}"
        )
    distance = {
        name: max(rel_err(p, m) for p, m in zip(layer.parameters(), masters, strict=True))
        for name, layer in (("plain bf16", plain), ("stochastic", stochastic[0]), ("remainder", remainder))
    }
    print(
        f'bf16 experts, {STEPS} steps: master_weights="remainder" equals torch.optim.AdamW on fp32 masters '
        f"bitwise at every step (2 extra bytes per parameter); stochastic: one seed repeats bitwise: {repeats}, "
        f"another differs: {differs}; bf16 weights from the fp32 masters: "
        + ", ".join(f"{name} {value:.1e}" for name, value in distance.items())
    )


if __name__ == "__main__":
    main()
