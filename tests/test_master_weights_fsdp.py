"""bf16 master weights under FSDP2 (2 gloo ranks): the remainder and the stochastic rounding's state sharded
like the parameter, each shard updated from FSDP2's reduced gradient as one process updates the unsharded
tensor (docs/design.md, "bf16 master weights"). Spawned ranks import this module: its work stays in
functions."""

from __future__ import annotations

import pytest
import ranks
import torch
from test_moments_8bit_distributed import Tiny  # tests/'s own tiny MoE, H = I = 32, E = 4
from torch import nn

import sonar_kernels

H, E, T = 32, 4, 8
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STEPS = 3

pytestmark = pytest.mark.timeout(180)


def _batch(step, rank):
    generator = torch.Generator().manual_seed(4000 + 100 * step + rank)
    return (3 * torch.randn(T, H, generator=generator)).bfloat16(), torch.randn(
        T, H, generator=generator
    ).bfloat16()


def _fsdp_rank(rank, world_size, out, mode, moments):
    """Two bf16 FSDP2 models from one seed: SonarAdamW with ``mode`` master weights, and a reference whose
    dense parameters torch.optim.AdamW steps and whose expert tensors follow the documented rule on the
    unsharded tensors from FSDP2's reduced gradient: torch's fused AdamW on the fp32 master (a remainder,
    fp32 moments), or the "fp64" arithmetic (8-bit moments, stochastic rounding) and the master's split or
    the stochastic rounding at the tensor's seed, the step and each element's position."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from torch.optim.adamw import adamw

    from sonar_kernels.rules import adamw as rules_adamw
    from sonar_kernels.rules import master_weights as mw
    from sonar_kernels.rules import moments_8bit as q8

    mesh = init_device_mesh("cpu", (world_size,))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Tiny().bfloat16()
        fully_shard(model.experts, mesh=mesh)
        fully_shard(model, mesh=mesh)
        models.append(model)
    sonar_model, reference = models
    optimizer = sonar_kernels.SonarAdamW(
        sonar_model, **HYPER, master_weights=mode, moments_dtype=moments, rounding_seed=3
    )
    experts = [reference.experts.gate_up_proj, reference.experts.down_proj]
    owned = [sonar_model.experts.gate_up_proj, sonar_model.experts.down_proj]
    dense = [p for p in reference.parameters() if all(p is not q for q in experts)]
    dense_optimizer = torch.optim.AdamW(dense, **HYPER, fused=True)
    hyper = torch.tensor(
        [HYPER["lr"], *HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]], dtype=torch.float64
    )
    masters = [p.detach().full_tensor().float() for p in experts]
    if moments == "8bit":
        states = [(q8.quantize(torch.zeros(m.shape), "exp_avg"), q8.quantize(torch.zeros(m.shape), "exp_avg_sq"))
                  for m in masters]  # fmt: skip
    else:
        states = [(torch.zeros(m.shape), torch.zeros(m.shape)) for m in masters]
    seeds = [int(optimizer.state[p]["seed"]) for p in owned] if mode == "stochastic" else None
    for step in range(1, STEPS + 1):
        x, y = _batch(step, rank)
        for model in models:
            nn.functional.mse_loss(model(x).float(), y.float()).backward()
        optimizer.step()
        optimizer.zero_grad()
        dense_optimizer.step()
        scalars = rules_adamw.adamw_scalars(torch.tensor(float(step)), hyper)
        with torch.no_grad():
            for i, p in enumerate(experts):
                g = p.grad.full_tensor().float()
                if moments == "8bit":
                    new, m, v = q8.adamw_8bit_update(masters[i], g, *states[i], scalars, hyper)
                    states[i] = (m, v)
                elif mode == "remainder":  # torch's fused AdamW on the fp32 master
                    new, (m, v) = masters[i].clone(), states[i]
                    adamw(
                        [new], [g], [m], [v], [], [torch.tensor(float(step - 1))], fused=True, amsgrad=False,
                        beta1=HYPER["betas"][0], beta2=HYPER["betas"][1], lr=HYPER["lr"],
                        weight_decay=HYPER["weight_decay"], eps=HYPER["eps"], maximize=False,
                    )  # fmt: skip
                else:
                    new, m, v = rules_adamw.adamw_fp64(masters[i], g, *states[i], scalars, hyper)
                    states[i] = (m, v)
                if mode == "remainder":
                    masters[i], weight = new, mw.split(new)[0]
                else:
                    weight = mw.stochastic_round(new, seeds[i], step, mw.element_index(new))
                    masters[i] = weight.float()
                p.to_local().copy_(weight.chunk(world_size)[rank])
        reference.zero_grad()
    for (name, p), q in zip(sonar_model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(
            p.detach().full_tensor().view(torch.int16), q.detach().full_tensor().view(torch.int16)
        ), name
    for p, master in zip(owned, masters, strict=True):
        state = optimizer.state[p]
        assert float(state["step"]) == STEPS
        if mode == "remainder":
            remainder = state["remainder"]
            # Sharded as the parameter: each rank holds its experts' remainders.
            assert isinstance(remainder, DTensor) and remainder.placements == (Shard(0),)
            assert remainder.to_local().shape[0] == E // world_size
            # Each rank's shard (gloo gathers no int16): this rank's rows of the whole master.
            merged = mw.merge(p.detach().to_local(), remainder.to_local())
            assert torch.equal(merged.view(torch.int32), master.chunk(world_size)[rank].view(torch.int32))
            assert bool(remainder.to_local().ne(0).any())
    if mode == "remainder":  # fp32 masters given as DTensors of the parameter's placements
        shifted = [m + 2.0**-20 for m in masters]
        optimizer.load_fp32_masters(
            {p: DTensor.from_local(m.chunk(world_size)[rank], p.device_mesh, p.placements, run_check=False,
                                   shape=m.shape, stride=m.stride())
             for p, m in zip(owned, shifted, strict=True)}
        )  # fmt: skip
        for p, m in zip(owned, shifted, strict=True):
            merged = mw.merge(p.detach().to_local(), optimizer.state[p]["remainder"].to_local())
            assert torch.equal(merged, m.chunk(world_size)[rank])
        with pytest.raises(ValueError, match="DTensor of its placements"):
            optimizer.load_fp32_masters({owned[0]: shifted[0]})
    # A checkpoint restores the sharded remainder or seed exactly.
    saved = optimizer.state_dict()
    key = "remainder" if mode == "remainder" else "seed"
    before = optimizer.state[owned[1]][key]
    before = before.to_local().clone() if isinstance(before, DTensor) else before.clone()
    optimizer.state[owned[1]][key] = torch.zeros_like(optimizer.state[owned[1]][key])
    optimizer.load_state_dict(saved)
    after = optimizer.state[owned[1]][key]
    assert isinstance(after, DTensor) == (mode == "remainder")
    assert torch.equal(after.to_local() if isinstance(after, DTensor) else after, before)


@pytest.mark.parametrize(
    ("mode", "moments"),
    [("remainder", None), ("stochastic", None), ("remainder", "8bit"), ("stochastic", "8bit")],
)
def test_fsdp2_master_weights_equal_one_process_on_the_unsharded_tensor_bitwise(tmp_path, mode, moments):
    ranks.run(_fsdp_rank, 2, tmp_path, mode, moments)


def _refused_rank(rank, world_size, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    model = Tiny().bfloat16()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.experts, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
    fully_shard(model, mesh=mesh)
    # Stochastic rounding's counters follow a shard along the first dimension; a remainder any shard.
    with pytest.raises(ValueError, match="first dimension only"):
        sonar_kernels.SonarAdamW(model, **HYPER, master_weights="stochastic")
    sonar_kernels.SonarAdamW(model, **HYPER, master_weights="remainder")


def _sharded_skip_rank(rank, world_size, out, mode):
    """A NaN in rank 0's shard of the gradient only: every rank skips its shard's update (weight, remainder
    or seed, moments and step unchanged)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from sonar_kernels.ops import grad_update
    from sonar_kernels.ops.torch_backend import adamw as ops_adamw

    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(5)
    weight, grad = (torch.randn(E, 8, 64, generator=generator).bfloat16() for _ in range(2))
    grad[0, 3, 5] = float("nan")  # expert 0: rank 0's shard
    weight, grad, m, v = (
        distribute_tensor(t, mesh, [Shard(0)])
        for t in (weight, grad, torch.rand(E, 8, 64), torch.rand(E, 8, 64))
    )
    step, norm_sq, skipped = torch.tensor(3.0), torch.zeros(()), torch.zeros((), dtype=torch.int64)
    hyper = (1e-2, 0.9, 0.95, 1e-8, 0.1)
    before = [t.to_local().clone() for t in (weight, m, v)]
    if mode == "remainder":
        whole = torch.randint(-(2**15), 2**15, (E, 8, 64), dtype=torch.int16, generator=generator)
        remainder = DTensor.from_local(whole.chunk(world_size)[rank], mesh, [Shard(0)], run_check=False)
        kept = remainder.to_local().clone()
        ops_adamw.remainder_adamw_(
            weight, remainder, grad, m, v, step, hyper, norm_sq, skipped, foreach=False, fused=True
        )
        assert torch.equal(remainder.to_local(), kept)
    else:
        grad_update.stochastic_adamw_(
            weight, grad, None, [m, v, step, norm_sq, skipped, torch.zeros((), dtype=torch.int64), torch.tensor(9)],
            torch.tensor(hyper, dtype=torch.float64), grad_dtype=None, chunk_bytes=None,
        )  # fmt: skip
    assert all(torch.equal(a, t.to_local()) for a, t in zip(before, (weight, m, v), strict=True))
    assert float(step) == 3.0 and int(skipped) == 1 and float(norm_sq) == float("inf")


def test_fsdp2_stochastic_rounding_refuses_a_shard_along_another_dimension(tmp_path):
    ranks.run(_refused_rank, 2, tmp_path)


@pytest.mark.parametrize("mode", ["remainder", "stochastic"])
def test_a_sharded_update_skips_on_every_rank_when_one_shard_is_not_finite(tmp_path, mode):
    ranks.run(_sharded_skip_rank, 2, tmp_path, mode)
