"""8-bit moments with several processes (gloo on CPU): data-parallel experts, averaged over the group before
their 8-bit update, and expert-parallel experts, updated in the backward as on one process. The ranks agree
bit for bit (replicated weights and 8-bit state); FSDP2's sharded experts keep 8-bit state sharded like
them, equal to one process running the scheme on the unsharded tensor. Spawned ranks import this module: its work stays in functions."""

from __future__ import annotations

import pytest
import ranks
import torch
import torch.distributed as dist
from torch import nn

import sonar_kernels

H, I, E, TOP_K, T = 32, 32, 4, 2, 8
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STEPS = 2
STATE = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales", "step")

pytestmark = pytest.mark.timeout(180)


class Tiny(nn.Module):
    def __init__(self, num_experts=E, ep_group=None):
        super().__init__()
        self.embed = nn.Linear(H, H)
        self.router = nn.Linear(H, E, bias=False)
        self.experts = sonar_kernels.SonarExperts(num_experts, H, I, backend="torch", ep_group=ep_group)
        self.head = nn.Linear(H, H)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        weights, index = torch.softmax(self.router(h), dim=-1).topk(TOP_K, dim=-1)
        return self.head(h + self.experts(h, index, weights / weights.sum(-1, keepdim=True)))


def _batch(step, rank):
    generator = torch.Generator().manual_seed(3000 + 100 * step + rank)
    return 3 * torch.randn(T, H, generator=generator), torch.randn(T, H, generator=generator)


def _run(rank, model, optimizer, wrapped, out, name, steps=STEPS):
    for step in range(steps):
        x, y = _batch(step, rank)
        nn.functional.mse_loss(wrapped(x), y).backward()
        assert model.experts.gate_up_proj.grad is None and model.experts.down_proj.grad is None
        optimizer.step()
        optimizer.zero_grad()
    experts = [model.experts.gate_up_proj, model.experts.down_proj]
    torch.save(
        {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state": [{k: optimizer.state[p][k].clone() for k in STATE} for p in experts],
        },
        out / f"{name}-{rank}.pt",
    )


def _dp_rank(rank, world_size, out, steps=STEPS):
    torch.manual_seed(0)
    model = Tiny()
    optimizer = sonar_kernels.SonarAdamW(
        model, **HYPER, moments_dtype="8bit", data_parallel_group=dist.group.WORLD
    )
    _run(rank, model, optimizer, nn.parallel.DistributedDataParallel(model), out, f"dp{steps}", steps)


def _ep_rank(rank, world_size, out):
    torch.manual_seed(0)
    initial = Tiny().state_dict()
    model = Tiny(ep_group=dist.group.WORLD)  # E experts in all, E / world_size on each rank
    local = E // world_size
    model.load_state_dict(
        {
            k: v[rank * local : (rank + 1) * local] if k.startswith("experts.") else v
            for k, v in initial.items()
        }
    )
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, moments_dtype="8bit")
    _run(rank, model, optimizer, nn.parallel.DistributedDataParallel(model), out, "ep")


def _fsdp_rank(rank, world_size, out):
    """Two FSDP2 models from one seed: SonarAdamW with 8-bit moments, and a reference whose dense
    parameters torch.optim.AdamW steps and whose expert tensors one process's scheme (the torch ops of
    sonar_kernels/rules/moments_8bit.py) updates on the unsharded tensor from FSDP2's reduced gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from sonar_kernels.rules import adamw as rules_adamw
    from sonar_kernels.rules import moments_8bit as q8

    mesh = init_device_mesh("cpu", (world_size,))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Tiny()
        fully_shard(model.experts, mesh=mesh)
        fully_shard(model, mesh=mesh)
        models.append(model)
    sonar_model, reference = models
    optimizer = sonar_kernels.SonarAdamW(sonar_model, **HYPER, moments_dtype="8bit")
    experts = [reference.experts.gate_up_proj, reference.experts.down_proj]
    dense = [p for p in reference.parameters() if all(p is not q for q in experts)]
    dense_optimizer = torch.optim.AdamW(dense, **HYPER, fused=True)
    hyper = torch.tensor(
        [HYPER["lr"], *HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]], dtype=torch.float64
    )
    full = [p.detach().full_tensor() for p in experts]
    states = [
        (q8.quantize(torch.zeros(f.shape), "exp_avg"), q8.quantize(torch.zeros(f.shape), "exp_avg_sq"))
        for f in full
    ]
    for step in range(STEPS):
        x, y = _batch(step, rank)
        for model in models:
            nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        dense_optimizer.step()
        scalars = rules_adamw.adamw_scalars(torch.tensor(float(step + 1)), hyper)
        with torch.no_grad():
            for i, p in enumerate(experts):
                new, m, v = q8.adamw_8bit_update(full[i], p.grad.full_tensor(), *states[i], scalars, hyper)
                full[i], states[i] = new, (m, v)
                p.to_local().copy_(new.chunk(world_size)[rank])
        reference.zero_grad()
    for (name, p), q in zip(sonar_model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.detach().full_tensor(), q.detach().full_tensor()), name
    for p, (m, v) in zip(
        [sonar_model.experts.gate_up_proj, sonar_model.experts.down_proj], states, strict=True
    ):
        state = optimizer.state[p]
        for key, expected in zip(STATE[:4], (*m, *v), strict=True):
            t = state[key]
            # Sharded as the parameter: each rank holds its experts' codes and scales.
            assert isinstance(t, DTensor) and t.placements == (Shard(0),) and t.to_local().shape[0] == E // 2
            assert torch.equal(t.full_tensor(), expected), key
        assert float(state["step"]) == STEPS
    # A checkpoint restores the sharded 8-bit state exactly.
    saved = optimizer.state_dict()
    before = {
        k: t.full_tensor().clone()
        for k, t in optimizer.state[sonar_model.experts.down_proj].items()
        if k != "step"
    }
    state = optimizer.state[sonar_model.experts.down_proj]
    for key in before:  # new tensors: the saved state dict holds the live ones
        state[key] = torch.zeros_like(state[key])
    optimizer.load_state_dict(saved)
    after = optimizer.state[sonar_model.experts.down_proj]
    assert all(torch.equal(after[k].full_tensor(), t) for k, t in before.items())


def _fsdp_last_dim_rank(rank, world_size, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    model = Tiny()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.experts, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    fully_shard(model, mesh=mesh)
    with pytest.raises(ValueError, match="other than its last"):
        sonar_kernels.SonarAdamW(model, **HYPER, moments_dtype="8bit")


def _sharded_skip_rank(rank, world_size, out):
    """A non-finite entry in rank 0's shard of the gradient only: every rank skips its shard's update."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from sonar_kernels.ops import grad_update
    from sonar_kernels.ops.torch_backend import fp64_update
    from sonar_kernels.rules import moments_8bit as q8

    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(5)
    weight, grad = (torch.randn(E, 8, 64, generator=generator) for _ in range(2))
    grad[0, 3, 5] = float("nan")  # expert 0: rank 0's shard
    shard = [distribute_tensor(t, mesh, [Shard(0)]) for t in (weight, grad)]
    state = [
        distribute_tensor(t, mesh, [Shard(0)])
        for t in (
            *q8.quantize(torch.rand(E, 8, 64), "exp_avg"),
            *q8.quantize(torch.rand(E, 8, 64), "exp_avg_sq"),
        )
    ]
    m_codes, m_scales, v_codes, v_scales = state
    step, norm_sq, skipped = torch.tensor(3.0), torch.zeros(()), torch.zeros((), dtype=torch.int64)
    before = [t.full_tensor().clone() for t in (shard[0], *state)]
    hyper = torch.tensor([1e-2, 0.9, 0.95, 1e-8, 0.1], dtype=torch.float64)
    # The torch backend's driver refuses a shard (its skip would not be the whole tensor's); nothing changes.
    with pytest.raises(ValueError, match=r"runs through sonar_kernels\.ops\.grad_update"):
        fp64_update.adamw_8bit_(shard[0], shard[1], None, [m_codes, v_codes, step, norm_sq, skipped, torch.zeros((), dtype=torch.int64), m_scales, v_scales],
                                hyper, grad_dtype=None, chunk_bytes=None)  # fmt: skip
    grad_update.adamw_8bit_(shard[0], shard[1], None, [m_codes, v_codes, step, norm_sq, skipped, torch.zeros((), dtype=torch.int64), m_scales, v_scales],
                   hyper, grad_dtype=None, chunk_bytes=None)  # fmt: skip
    assert all(torch.equal(a, t.full_tensor()) for a, t in zip(before, (shard[0], *state), strict=True))
    assert float(step) == 3.0 and int(skipped) == 1 and float(norm_sq) == float("inf")
    # A finite gradient: each rank updates its shard; the norm is the whole gradient's.
    grad[0, 3, 5] = 0.0
    shard[1] = distribute_tensor(grad, mesh, [Shard(0)])
    grad_update.adamw_8bit_(shard[0], shard[1], None, [m_codes, v_codes, step, norm_sq, skipped, torch.zeros((), dtype=torch.int64), m_scales, v_scales],
                   hyper, grad_dtype=None, chunk_bytes=None)  # fmt: skip
    assert float(step) == 4.0 and int(skipped) == 1
    torch.testing.assert_close(norm_sq, torch.linalg.vector_norm(grad).square(), rtol=1e-6, atol=0)
    assert not torch.equal(before[0], shard[0].full_tensor())


def test_a_sharded_8bit_update_skips_on_every_rank_when_one_shard_is_not_finite(tmp_path):
    ranks.run(_sharded_skip_rank, 2, tmp_path)


def _load(tmp_path, name, world_size=2):
    return [torch.load(tmp_path / f"{name}-{r}.pt") for r in range(world_size)]


def test_data_parallel_ranks_agree_bitwise_with_8bit_moments(tmp_path):
    ranks.run(_dp_rank, 2, tmp_path)
    first, second = _load(tmp_path, f"dp{STEPS}")
    for name, p in first["params"].items():
        assert torch.equal(p, second["params"][name]), name
    for a, b in zip(first["state"], second["state"], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in STATE)
        assert a["exp_avg_codes"].dtype == torch.int8 and float(a["step"]) == STEPS


def test_expert_parallel_ranks_agree_on_the_dense_weights_with_8bit_moments(tmp_path):
    ranks.run(_ep_rank, 2, tmp_path)
    first, second = _load(tmp_path, "ep")
    for name, p in first["params"].items():
        if not name.startswith("experts."):
            assert torch.equal(p, second["params"][name]), name
    for result in (first, second):
        assert all(
            float(s["step"]) == STEPS and s["exp_avg_sq_codes"].dtype == torch.uint8 for s in result["state"]
        )
    # Each rank's experts trained (they moved from the initial weights) with their own 8-bit state.
    assert not torch.equal(first["params"]["experts.gate_up_proj"], second["params"]["experts.gate_up_proj"])


def test_fsdp2_8bit_update_equals_one_process_on_the_unsharded_tensor_bitwise(tmp_path):
    ranks.run(_fsdp_rank, 2, tmp_path)


def test_fsdp2_sharding_the_last_dimension_is_refused_with_8bit_moments(tmp_path):
    ranks.run(_fsdp_last_dim_rank, 2, tmp_path)


def _single_process_reference(steps):
    """One process: each rank's gradient computed apart, averaged as DDP averages (divided by 2, then
    summed), the dense parameters stepped by torch.optim.AdamW (SonarAdamW's fused default) and the expert
    tensors by the 8-bit scheme's torch ops (sonar_kernels/rules/moments_8bit.py)."""
    from sonar_kernels.rules import adamw as rules_adamw
    from sonar_kernels.rules import moments_8bit as q8

    torch.manual_seed(0)
    model = Tiny()
    experts = [model.experts.gate_up_proj, model.experts.down_proj]
    dense = [p for p in model.parameters() if all(p is not q for q in experts)]
    optimizer = torch.optim.AdamW(dense, **HYPER, fused=True)
    hyper = torch.tensor(
        [HYPER["lr"], *HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]], dtype=torch.float64
    )
    states = [
        (q8.quantize(torch.zeros(p.shape), "exp_avg"), q8.quantize(torch.zeros(p.shape), "exp_avg_sq"))
        for p in experts
    ]
    for step in range(steps):
        grads = []
        for rank in range(2):
            model.zero_grad()
            x, y = _batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads, strict=True):
            p.grad = g0 / 2 + g1 / 2
        optimizer.step()
        scalars = rules_adamw.adamw_scalars(torch.tensor(float(step + 1)), hyper)
        with torch.no_grad():
            for i, p in enumerate(experts):
                new_p, m, v = q8.adamw_8bit_update(p, p.grad, *states[i], scalars, hyper)
                p.copy_(new_p)
                states[i] = (m, v)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, states


def test_data_parallel_8bit_update_equals_one_process_on_the_averaged_gradient(tmp_path):
    # The experts' gradients are averaged as DDP averages the dense ones (divided by 2, then summed), so
    # every parameter and the 8-bit state equal one process's, bit for bit.
    ranks.run(_dp_rank, 2, tmp_path)
    first = _load(tmp_path, f"dp{STEPS}")[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run (tests/ranks.py): GEMMs reduce in a thread-count order
    try:
        params, states = _single_process_reference(STEPS)
    finally:
        torch.set_num_threads(threads)
    for name, p in params.items():
        assert torch.equal(first["params"][name], p), name
    for got, (m, v) in zip(first["state"], states, strict=True):
        assert all(torch.equal(got[k], t) for k, t in zip(STATE[:4], (*m, *v), strict=True))
