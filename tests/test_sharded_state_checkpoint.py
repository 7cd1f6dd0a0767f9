"""FSDP2-sharded expert state with 8-bit moments, a 16-bit remainder or stochastic rounding (bf16 master
weights) through a torch.distributed.checkpoint (DCP) save and load (torch's get_state_dict and
set_state_dict), on 2 gloo ranks: a run resumed from the checkpoint after its first step ends with the
weights and every state tensor of the run without a break, bit for bit (docs/distributed.md, "FSDP2").
Spawned ranks import this module: its work stays in functions."""

from __future__ import annotations

import pytest
import ranks
import torch
from test_ep_fsdp2 import _create_dense_state  # the dense moments DCP loads into
from torch import nn

import sonar_kernels

H, I, E, TOP_K, T = 32, 32, 4, 2, 8
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STEPS = 3
MODES = {
    "exact": (torch.float32, {}),
    "8bit": (torch.float32, {"moments_dtype": "8bit"}),
    "remainder": (torch.bfloat16, {"master_weights": "remainder"}),
    "remainder-8bit": (torch.bfloat16, {"master_weights": "remainder", "moments_dtype": "8bit"}),
    "stochastic-8bit": (torch.bfloat16, {"master_weights": "stochastic", "moments_dtype": "8bit"}),
}

pytestmark = pytest.mark.timeout(180)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(H, H)
        self.router = nn.Linear(H, E, bias=False)
        self.experts = sonar_kernels.SonarExperts(E, H, I, backend="torch")
        self.head = nn.Linear(H, H)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        weights, index = torch.softmax(self.router(h), dim=-1).topk(TOP_K, dim=-1)
        return self.head(h + self.experts(h, index, weights / weights.sum(-1, keepdim=True)))


def _batch(step, rank, dtype):
    generator = torch.Generator().manual_seed(5000 + 100 * step + rank)
    x, y = 3 * torch.randn(T, H, generator=generator), torch.randn(T, H, generator=generator)
    return x.to(dtype), y.to(dtype)


def _build(mesh, mode, seed):
    from torch.distributed.fsdp import fully_shard

    dtype, options = MODES[mode]
    torch.manual_seed(seed)
    model = Tiny().to(dtype)
    fully_shard(model.experts, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, sonar_kernels.SonarAdamW(model, **HYPER, **options)


def _step(model, optimizer, step, rank, dtype):
    x, y = _batch(step, rank, dtype)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def _snapshot(model, optimizer):
    """Every parameter (this rank's shard) and every state tensor of the optimizer, as local tensors."""

    def local(t):
        return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()

    params = {n: local(p) for n, p in model.named_parameters()}
    state = {
        n: {k: local(v) for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)}
        for n, p in model.named_parameters()
    }
    return params, state


def _resume_rank(rank, world_size, mode, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    dtype = MODES[mode][0]
    model, optimizer = _build(mesh, mode, seed=0)
    _step(model, optimizer, 0, rank, dtype)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=out / "checkpoint")
    for step in range(1, STEPS):
        _step(model, optimizer, step, rank, dtype)
    params, state = _snapshot(model, optimizer)
    # A fresh model (other initial weights) and optimizer: the checkpoint must replace both.
    resumed, resumed_optimizer = _build(mesh, mode, seed=1)
    _create_dense_state(resumed_optimizer)
    model_state, optim_state = get_state_dict(resumed, resumed_optimizer)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=out / "checkpoint")
    set_state_dict(
        resumed, resumed_optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    for step in range(1, STEPS):
        _step(resumed, resumed_optimizer, step, rank, dtype)
    resumed_params, resumed_state = _snapshot(resumed, resumed_optimizer)
    torch.save(
        {"continuous": (params, state), "resumed": (resumed_params, resumed_state)}, out / f"{mode}-{rank}.pt"
    )


@pytest.mark.parametrize("mode", [m for m in MODES if m != "exact"])
def test_sharded_state_resumes_from_a_dcp_checkpoint_bit_for_bit(tmp_path, mode):
    ranks.run(_resume_rank, 2, mode, tmp_path)
    keys = {
        "8bit": {"step", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales"},
        "remainder": {"step", "exp_avg", "exp_avg_sq", "remainder"},
        "remainder-8bit": {
            "step", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales", "remainder",
        },
        "stochastic-8bit": {
            "step", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales", "seed",
        },
    }[mode]  # fmt: skip
    shards = []
    for rank in range(2):
        saved = torch.load(tmp_path / f"{mode}-{rank}.pt")
        (params, state), (resumed_params, resumed_state) = saved["continuous"], saved["resumed"]
        for name, p in params.items():
            assert torch.equal(resumed_params[name], p), (rank, name)
            for key, value in state[name].items():
                assert torch.equal(resumed_state[name][key], value), (rank, name, key)
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            assert set(state[name]) == keys, (name, set(state[name]))
            assert state[name]["step"].item() == STEPS
        shards.append(params["experts.gate_up_proj"])
    # Each rank resumed its own shard (a checkpoint that kept one shard for both would not be told apart
    # by the comparison above only if the shards were equal).
    assert not torch.equal(shards[0], shards[1])


def _refused_rank(rank, world_size, mode, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))
    dtype = MODES[mode][0]
    model, optimizer = _build(mesh, mode, seed=0)
    _step(model, optimizer, 0, rank, dtype)
    saved = optimizer.state_dict()
    # The same state with full (unsharded) tensors, as an unsharded run's state_dict() holds them; the
    # values do not matter, it must be refused before any is loaded.
    full = {
        "param_groups": saved["param_groups"],
        "state": {
            i: {k: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, DTensor) else v for k, v in s.items()}
            for i, s in saved["state"].items()
        },
    }
    before = _snapshot(model, optimizer)
    with pytest.raises(ValueError, match=r"parameter 0 is a tensor, .* must be a DTensor with placements"):
        optimizer.load_state_dict(full)
    # And the other way: the sharded state into an unsharded model's optimizer.
    torch.manual_seed(0)
    plain = Tiny().to(dtype)
    plain_optimizer = sonar_kernels.SonarAdamW(
        plain, **HYPER, **MODES[mode][1], data_parallel_group=torch.distributed.group.WORLD
    )
    _step(plain, plain_optimizer, 0, rank, dtype)
    plain_before = _snapshot(plain, plain_optimizer)
    with pytest.raises(ValueError, match=r"parameter 0 is a DTensor with placements .* a plain tensor"):
        plain_optimizer.load_state_dict(saved)
    torch.save(
        {
            "sharded": (before, _snapshot(model, optimizer)),
            "plain": (plain_before, _snapshot(plain, plain_optimizer)),
        },
        out / f"{rank}.pt",
    )


@pytest.mark.parametrize("mode", ["exact", "8bit"])
def test_a_state_dict_sharded_otherwise_is_refused_before_anything_changes(tmp_path, mode):
    """optimizer.load_state_dict with full tensors for FSDP2 shards (or shards for plain tensors): torch's
    Optimizer.load_state_dict would replace the whole state, dense and expert, and fail later; refused first."""
    ranks.run(_refused_rank, 2, mode, tmp_path)
    for rank in range(2):
        saved = torch.load(tmp_path / f"{rank}.pt")
        for (params, state), (params_after, state_after) in saved.values():
            for name, p in params.items():
                assert torch.equal(params_after[name], p), (rank, name)
                assert state_after[name].keys() == state[name].keys(), (rank, name)
                for key, value in state[name].items():
                    assert torch.equal(state_after[name][key], value), (rank, name, key)
