"""Expert parallelism with the dense layers on FSDP2 (docs/distributed.md, "Expert parallel with the dense
layers on FSDP2"), on gloo ranks: ``SonarExperts(ep_group=mesh["ep"])``, ``fully_shard_dense`` (the dense
layers and the root sharded, the expert tensors in ``ignored_params``), ``SonarAdamW(model)``; no expert
gradient in ``.grad``; against single-process training on the concatenated batch within the tolerance the
docs state for EP, bitwise against torch.optim.AdamW on the same layout, resumed bitwise from a DCP
checkpoint; and the refusals, before anything changes. Spawned ranks import this module: keep its work in
functions.
"""

from __future__ import annotations

import pytest
import ranks
import torch
import torch.distributed as dist
from numerics import rel_err
from test_distributed import EP_E, FUSED, MAX_NORM, STEPS, EPMoE, _assert_equal, _ep_batch, _ep_reference
from test_sonar_adamw import HYPER, H, I
from torch import nn

import sonar_kernels
from sonar_kernels.nn import fully_shard_dense

pytestmark = pytest.mark.timeout(180)


def _mesh(world_size, ep_size):
    from torch.distributed.device_mesh import init_device_mesh

    if ep_size == world_size:
        return init_device_mesh("cpu", (ep_size,), mesh_dim_names=("ep",))
    return init_device_mesh("cpu", (world_size // ep_size, ep_size), mesh_dim_names=("dp", "ep"))


def _build(backend, mesh, ep_size, mode="sonar"):
    """The model with this rank's experts of the single-process model's initial weights, sharded."""
    torch.manual_seed(0)
    initial = EPMoE("torch").state_dict()
    model = EPMoE(backend, ep_group=mesh["ep"])
    local, ep_rank = EP_E // ep_size, mesh["ep"].get_local_rank()
    model.load_state_dict(
        {
            k: v[ep_rank * local : (ep_rank + 1) * local] if k.startswith("experts.") else v
            for k, v in initial.items()
        }
    )
    dp = mesh["dp"] if "dp" in (mesh.mesh_dim_names or ()) else None
    fully_shard_dense(model, mesh, layers=[model.embed, model.head])
    # Built after sharding: it holds FSDP2's sharded dense parameters.
    if mode == "sonar":
        optimizer = sonar_kernels.SonarAdamW(model, **HYPER, max_grad_norm=MAX_NORM, data_parallel_group=dp)
    else:  # torch's fused AdamW takes DTensors or plain tensors in one call, not both
        dense = [p for name, p in model.named_parameters() if not name.startswith("experts.")]
        optimizer = _Both(
            torch.optim.AdamW(dense, **HYPER, **FUSED), torch.optim.AdamW(_experts(model), **HYPER, **FUSED)
        )
    return model, optimizer


class _Both:
    """Two torch.optim.AdamW as one: the dense (DTensor) parameters' and the experts'."""

    def __init__(self, dense, experts):
        self.parts = (dense, experts)
        self.state = {**dense.state}

    def step(self):
        for part in self.parts:
            part.step()
        self.state = {**self.parts[0].state, **self.parts[1].state}

    def zero_grad(self):
        for part in self.parts:
            part.zero_grad()


def _experts(model):
    return [model.experts.gate_up_proj, model.experts.down_proj]


def _step(model, optimizer, step, rank, ep_size, mode):
    x, y, mask = _ep_batch(step, rank, ep_size)
    nn.functional.mse_loss(model(x, mask), y).backward()
    if mode == "sonar":
        assert all(p.grad is None for p in _experts(model))  # updated in the backward, never kept
    else:
        dense = [p for name, p in model.named_parameters() if not name.startswith("experts.")]
        nn.utils.clip_grad_norm_(dense, MAX_NORM)
    optimizer.step()
    optimizer.zero_grad()


def _full(t):
    return t.full_tensor() if isinstance(t, dist.tensor.DTensor) else t


def _snapshot(model, optimizer):
    state = [{k: _full(v).clone() for k, v in optimizer.state[p].items()} for p in _experts(model)]
    params = {name: _full(p).detach().clone() for name, p in model.named_parameters()}
    return {"params": params, "state": state}


def _train_rank(rank, world_size, backend, ep_size, mode, out):
    mesh = _mesh(world_size, ep_size)
    model, optimizer = _build(backend, mesh, ep_size, mode)
    for step in range(STEPS):
        _step(model, optimizer, step, rank, ep_size, mode)
    result = _snapshot(model, optimizer) | {"ep_rank": mesh["ep"].get_local_rank()}
    torch.save(result, out / f"{mode}-{rank}.pt")


@pytest.mark.parametrize(
    ("backend", "world_size", "ep_size"),
    # EP x FSDP2 on 2 and 4 ranks; EP 2 x FSDP2 2 (the experts replicated over mesh["dp"], averaged there
    # before their update); the Triton backend (interpreter) on 2.
    [("torch", 2, 2), ("torch", 4, 4), ("torch", 4, 2), ("triton", 2, 2)],
    ids=["torch-ep2-fsdp2", "torch-ep4-fsdp4", "torch-ep2xdp2-fsdp4", "triton-ep2-fsdp2"],
)
def test_ep_with_fsdp2_dense_matches_single_process_training(tmp_path, backend, world_size, ep_size):
    # Uneven tokens per rank (5 + 4r), rank 0 routes nothing to expert 3, rank 1 nothing to its own experts.
    ranks.run(_train_rank, world_size, backend, ep_size, "sonar", tmp_path)
    single = _ep_reference(world_size, ep_size)
    single.pop("norms")
    local = EP_E // ep_size
    results = [torch.load(tmp_path / f"sonar-{r}.pt") for r in range(world_size)]
    for r, result in enumerate(results):
        assert all(float(s["step"]) == STEPS for s in result["state"])
        e = result["ep_rank"]
        for name, p in result["params"].items():
            expected = (
                single[name][e * local : (e + 1) * local] if name.startswith("experts.") else single[name]
            )
            # docs/distributed.md's EP tolerance (the combine's summation order, amplified by AdamW).
            assert rel_err(p, expected) <= 1e-4, (r, name)
        # Dense parameters (full tensors) on every rank and the replicas of the same experts: bit for bit.
        _assert_equal(result["params"], results[e]["params"], f"rank {r} against rank {e}")
    initial = dict(EPMoE("torch").named_parameters())
    assert rel_err(initial["experts.gate_up_proj"].detach(), single["experts.gate_up_proj"]) > 1e-2
    if ep_size == world_size and backend == "torch":
        # The same layout with torch.optim.AdamW (the experts' gradients in .grad, dense-only clipping).
        ranks.run(_train_rank, world_size, backend, ep_size, "standard", tmp_path)
        for r in range(world_size):
            standard = torch.load(tmp_path / f"standard-{r}.pt")
            _assert_equal(results[r]["params"], standard["params"], f"rank {r} against torch.optim.AdamW")
            for a, b in zip(results[r]["state"], standard["state"], strict=True):
                _assert_equal(a, b, f"rank {r} state")


def _create_dense_state(optimizer):
    """The dense parameters' AdamW state, by a step with zero gradients and lr 0 (what torch's
    get_state_dict does for an optimizer with no state): DCP loads into existing tensors."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in optimizer.dense_parameters():
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad()


def _checkpointed(model, optimizer, mesh):
    """Model and optimizer state, FQN-keyed (torch's get_state_dict), the expert tensors and their moments
    as DTensors sharded over mesh["ep"] (replicated over mesh["dp"]): each rank holds other experts under
    the same names, which DCP would otherwise save once, as if replicated (docs/distributed.md)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    model_state, optim_state = get_state_dict(model, optimizer)

    def wrap(name, t):
        if name.startswith("experts.") and isinstance(t, torch.Tensor) and t.dim() > 0:
            return DTensor.from_local(t, mesh, placements, run_check=False)
        return t

    model_state = {k: wrap(k, v) for k, v in model_state.items()}
    optim_state["state"] = {
        k: {n: wrap(k, t) for n, t in entry.items()} for k, entry in optim_state["state"].items()
    }
    return {"model": model_state, "optim": optim_state}


def _resume_rank(rank, world_size, ep_size, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.tensor import DTensor

    mesh = _mesh(world_size, ep_size)
    model, optimizer = _build("torch", mesh, ep_size)
    _step(model, optimizer, 0, rank, ep_size, "sonar")
    dcp.save(_checkpointed(model, optimizer, mesh), checkpoint_id=out / "checkpoint")
    for step in range(1, STEPS):
        _step(model, optimizer, step, rank, ep_size, "sonar")
    continuous = _snapshot(model, optimizer)
    # A fresh model and optimizer (new initial weights: the checkpoint must replace them).
    torch.manual_seed(1)
    resumed, resumed_optimizer = _build("torch", mesh, ep_size)
    with torch.no_grad():
        for p in _experts(resumed):
            p.normal_()
    _create_dense_state(resumed_optimizer)
    state = _checkpointed(resumed, resumed_optimizer, mesh)
    dcp.load(state, checkpoint_id=out / "checkpoint")

    def unwrap(name, t):
        return t.to_local() if name.startswith("experts.") and isinstance(t, DTensor) else t

    state["optim"]["state"] = {
        k: {n: unwrap(k, t) for n, t in e.items()} for k, e in state["optim"]["state"].items()
    }
    set_state_dict(
        resumed,
        resumed_optimizer,
        model_state_dict={k: unwrap(k, v) for k, v in state["model"].items()},
        optim_state_dict=state["optim"],
    )
    for step in range(1, STEPS):
        _step(resumed, resumed_optimizer, step, rank, ep_size, "sonar")
    after = _snapshot(resumed, resumed_optimizer)
    _assert_equal(after["params"], continuous["params"], f"rank {rank}: resumed against continuous")
    for a, b in zip(after["state"], continuous["state"], strict=True):
        _assert_equal(a, b, f"rank {rank} state: resumed against continuous")
    torch.save(after["params"], out / f"resumed-{rank}.pt")


@pytest.mark.parametrize(("world_size", "ep_size"), [(2, 2), (4, 2)], ids=["ep2-fsdp2", "ep2xdp2-fsdp4"])
def test_resume_from_a_dcp_checkpoint_is_bitwise(tmp_path, world_size, ep_size):
    ranks.run(_resume_rank, world_size, ep_size, tmp_path)
    first, second = (torch.load(tmp_path / f"resumed-{r}.pt") for r in (0, 1))
    # Different experts on the two ranks of mesh["ep"]: the checkpoint kept each rank's own.
    assert not torch.equal(first["experts.gate_up_proj"], second["experts.gate_up_proj"])


def _refusal_rank(rank, world_size, case, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    if case == "ep-indivisible":
        with pytest.raises(ValueError, match="must be divisible by the size of ep_group") as raised:
            sonar_kernels.SonarExperts(3, H, I, ep_group=mesh["ep"])
        (out / f"{case}-{rank}.txt").write_text(str(raised.value))
        return
    torch.manual_seed(0)
    model = EPMoE("torch", ep_group=mesh["ep"])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    if case == "experts-wrapped":
        fully_shard(model.experts, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif case == "root-holds-experts":  # fully_shard of the root without ignored_params
        fully_shard(model, mesh=mesh)
    elif case == "mesh-disagrees":  # the experts over both ranks, the mesh's ep dimension one rank wide
        mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "ep"))
        with pytest.raises(ValueError, match="disagree with the model's") as raised:
            fully_shard_dense(model, mesh)
    elif case == "no-ep-dim":
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match="named 'ep'") as raised:
            fully_shard_dense(model, mesh)
    elif case == "optimizer-before-sharding":  # it would hold the unsharded dense tensors: never trained
        optimizer = sonar_kernels.SonarAdamW(model, **HYPER)
        fully_shard_dense(model, mesh, layers=[model.embed, model.head])
        x, _, mask = _ep_batch(0, rank, world_size)
        with pytest.raises(RuntimeError, match="sharded by FSDP2 since") as raised:
            model(x, mask)
        assert all(float(s["step"]) == 0 for s in optimizer.state.values() if "step" in s)
        assert "fully_shard_dense" in str(raised.value) and "embed.weight" in str(raised.value)
    if case in ("experts-wrapped", "root-holds-experts"):
        optimizer = sonar_kernels.SonarAdamW(model, **HYPER)
        x, _, mask = _ep_batch(0, rank, world_size)
        with pytest.raises(ValueError, match="FSDP2 manages its expert tensors") as raised:
            model(x, mask)
        assert all(float(s["step"]) == 0 for s in optimizer.state.values() if "step" in s)
    elif case != "optimizer-before-sharding":
        from torch.distributed.fsdp import FSDPModule

        assert not any(isinstance(m, FSDPModule) for m in model.modules())  # nothing sharded
    for name, p in model.named_parameters():
        assert torch.equal(_full(p).detach(), before[name]), name
    (out / f"{case}-{rank}.txt").write_text(str(raised.value))


@pytest.mark.parametrize(
    "case",
    [
        "experts-wrapped",
        "root-holds-experts",
        "mesh-disagrees",
        "no-ep-dim",
        "ep-indivisible",
        "optimizer-before-sharding",
    ],
)
def test_bad_layouts_are_refused_before_anything_changes(tmp_path, case):
    ranks.run(_refusal_rank, 2, case, tmp_path)
    message = (tmp_path / f"{case}-0.txt").read_text()
    assert "ep_group" in message or "mesh" in message or "fully_shard_dense" in message


def _after_step_rank(rank, world_size, out):
    """Built after sharding, trained: the check ends with the first step (a later FSDP2 call on another
    module of the model does not concern it)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    model, optimizer = _build("torch", mesh, world_size)
    assert optimizer.managed.dense_source is not None
    _step(model, optimizer, 0, rank, world_size, "sonar")
    assert optimizer.managed.dense_source is None


def test_the_sharding_check_ends_with_the_first_step(tmp_path):
    ranks.run(_after_step_rank, 2, tmp_path)
