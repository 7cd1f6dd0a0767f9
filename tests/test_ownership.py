"""Who updates an expert tensor in the backward: explicit state of the optimizer and the tensor (no
global table), robust to new tensor objects (assign loads, casts, DTensor), one owner and one hook per
tensor, released with the optimizer."""

import gc

import pytest
import torch

import sonar_kernels
from sonar_kernels import specs

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# The references' flags: SonarAdamW's default flags (foreach=None, fused=None) run torch's fused AdamW on
# the CPU.
FUSED = {"fused": True}


def _hooks(p: torch.Tensor) -> int:
    return len(getattr(p, "_post_accumulate_grad_hooks", None) or {})


class Tiny(torch.nn.Module):
    """A router, SonarExperts (torch backend) and a dense head."""

    def __init__(self, seed=0, backend="torch"):
        super().__init__()
        torch.manual_seed(seed)
        self.router = torch.nn.Linear(16, 4)
        self.experts = sonar_kernels.SonarExperts(4, 16, 8, backend=backend)
        self.head = torch.nn.Linear(16, 16)

    def forward(self, x):
        weights, index = torch.softmax(self.router(x), -1).topk(2, dim=-1)
        return self.head(self.experts(x, index, weights.to(x.dtype)))


def _batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 16, generator=generator)


def _train(model, optimizer, steps=2):
    for step in range(steps):
        model(_batch(step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _experts(model):
    return [model.experts.gate_up_proj, model.experts.down_proj]


def test_the_newest_optimizer_owns_the_experts_and_each_tensor_has_one_hook():
    model = Tiny()
    first = sonar_kernels.SonarAdamW(model, **HYPER)
    scheduler = torch.optim.lr_scheduler.StepLR(first, 1)  # holds the first optimizer  # noqa: F841
    second = sonar_kernels.SonarAdamW(model, **HYPER)
    third = sonar_kernels.SonarAdamW(model, **HYPER)
    for p in _experts(model):
        assert _hooks(p) == 1
        assert sonar_kernels.optim.expert_optimizer(p) is third
        assert not any(q is p for q in first.expert_tensors) and not any(
            q is p for q in second.expert_tensors
        )
    _train(model, third, 1)
    for p in _experts(model):
        assert float(third.state[p]["step"]) == 1.0 and p.grad is None
        assert float(first.state[p]["step"]) == 0.0


def test_hooks_and_updates_are_removed_when_the_optimizer_is_collected():
    model = Tiny()
    optimizer = sonar_kernels.ExpertAdamW(model.experts.parameters(), **HYPER)
    assert all(_hooks(p) == 1 and specs.update_of(p) is not None for p in _experts(model))
    del optimizer
    gc.collect()
    assert all(_hooks(p) == 0 and specs.update_of(p) is None for p in _experts(model))
    # Without an owner the experts get ordinary gradients.
    model(_batch(0)).sum().backward()
    assert all(p.grad is not None for p in _experts(model))


@pytest.mark.parametrize("optimizer_class", ["SonarAdamW", "ExpertAdamW"])
def test_a_dropped_optimizer_is_released_by_reference_counting_alone(optimizer_class):
    # No reference cycle through the optimizer's ownership tables (optim/managed.py holds it weakly): with
    # the cyclic collector off, dropping the newest owner removes its hooks and updates at once and the
    # older owner takes the experts back.
    model = Tiny()
    older = sonar_kernels.SonarAdamW(model, **HYPER)
    kind = getattr(sonar_kernels, optimizer_class)
    newer = kind(model if optimizer_class == "SonarAdamW" else list(model.experts.parameters()), **HYPER)
    assert all(sonar_kernels.optim.expert_optimizer(p) is newer for p in _experts(model))
    gc.collect()
    gc.disable()
    try:
        del newer
        assert all(
            sonar_kernels.optim.expert_optimizer(p) is older and _hooks(p) == 1 for p in _experts(model)
        )
        del older
        assert all(_hooks(p) == 0 and specs.update_of(p) is None for p in _experts(model))
    finally:
        gc.enable()


@pytest.mark.parametrize("optimizer_class", ["SonarAdamW", "ExpertAdamW"])
def test_a_newer_owner_collected_gives_the_experts_back_to_the_older_one(optimizer_class):
    # An optimizer built over the experts and dropped (a throwaway, a failed set-up) must not leave them
    # without an owner: the older optimizer trains on as if the newer one had never been built (equal
    # bits to a model that only ever had the older one; with clipping, so experts kept out of the dense
    # norm matters).
    kind = getattr(sonar_kernels, optimizer_class)

    def build(model):
        target = model if optimizer_class == "SonarAdamW" else list(model.parameters())
        extra = {"max_grad_norm": 0.05} if optimizer_class == "SonarAdamW" else {}
        return kind(target, **HYPER, **extra)

    reference_model, model = Tiny(), Tiny()
    reference_optimizer, optimizer = build(reference_model), build(model)
    _train(reference_model, reference_optimizer, 1)
    _train(model, optimizer, 1)
    newer = build(model)
    del newer
    gc.collect()
    for p in _experts(model):
        assert sonar_kernels.optim.expert_optimizer(p) is optimizer and _hooks(p) == 1
    for step in (1, 2):
        for m, o in ((reference_model, reference_optimizer), (model, optimizer)):
            m(_batch(step)).square().mean().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), reference_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert all(float(optimizer.state[p]["step"]) == 3.0 for p in _experts(model))


@pytest.mark.parametrize("given", ["model", "parameters"])
def test_after_an_assign_load_the_new_expert_tensors_are_managed(given):
    model = Tiny()
    state = {k: v.clone() for k, v in Tiny(seed=1).state_dict().items()}
    model.load_state_dict(state, assign=True)
    optimizer = sonar_kernels.SonarAdamW(model if given == "model" else list(model.parameters()), **HYPER)
    assert all(any(q is p for q in optimizer.expert_tensors) for p in _experts(model))
    _train(model, optimizer, 1)
    assert all(float(optimizer.state[p]["step"]) == 1.0 and p.grad is None for p in _experts(model))


def test_two_models_with_their_own_optimizers_equal_each_trained_alone():
    alone = []
    for seed in (0, 1):
        model = Tiny(seed)
        _train(model, sonar_kernels.SonarAdamW(model, **HYPER, max_grad_norm=0.5), 3)
        alone.append(model)
    a, b = Tiny(0), Tiny(1)
    opt_a = sonar_kernels.SonarAdamW(a, **HYPER, max_grad_norm=0.5)
    opt_b = sonar_kernels.SonarAdamW(b, **HYPER, max_grad_norm=0.5)
    for step in range(3):  # interleaved
        for model, optimizer in ((a, opt_a), (b, opt_b)):
            model(_batch(step)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for together, reference in ((a, alone[0]), (b, alone[1])):
        for p, q in zip(together.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q)


class CastExperts(Tiny):
    """Calls the experts with its weights cast to bfloat16 (as torchtitan casts them before its GEMMs):
    the op sees tensors that are not the parameters."""

    def forward(self, x):
        weights, index = torch.softmax(self.router(x), -1).topk(2, dim=-1)
        e = self.experts
        out = sonar_kernels.moe_mlp(
            x.bfloat16(), index, weights, e.gate_up_proj.bfloat16(), e.down_proj.bfloat16(), backend="torch"
        )
        return self.head(out.float())


def test_a_cast_weight_reaches_the_owners_update_through_autograd():
    standard, sonar = CastExperts(), CastExperts()
    optimizer = sonar_kernels.SonarAdamW(sonar, **HYPER)
    _train(standard, torch.optim.AdamW(standard.parameters(), **HYPER, **FUSED), 2)
    _train(sonar, optimizer, 2)
    for p in _experts(sonar):
        assert float(optimizer.state[p]["step"]) == 2.0 and p.grad is None
    for p, q in zip(sonar.parameters(), standard.parameters(), strict=True):
        assert torch.equal(p, q)


def _to_local_forward(experts):
    """The experts' forward with their DTensor weights passed as ``to_local()`` tensors (torchtitan's way)."""

    def forward(x, index, weights):
        return sonar_kernels.moe_mlp(
            x, index, weights, experts.gate_up_proj.to_local(), experts.down_proj.to_local(), backend="torch"
        )

    return forward


@pytest.mark.timeout(60)
def test_a_dtensor_weight_passed_as_to_local_reaches_the_owners_update(one_rank_mesh):
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    mesh = one_rank_mesh
    standard, sonar = Tiny(), Tiny()
    for model in (standard, sonar):
        experts = model.experts
        for name in ("gate_up_proj", "down_proj"):
            local = getattr(experts, name).detach()
            experts.register_parameter(
                name, torch.nn.Parameter(distribute_tensor(local, mesh, [Replicate()]))
            )
        experts.forward = _to_local_forward(experts)
    optimizer = sonar_kernels.SonarAdamW(sonar, **HYPER)
    assert all(
        isinstance(p, DTensor) and any(q is p for q in optimizer.expert_tensors) for p in _experts(sonar)
    )
    # The DTensor experts and the plain dense parameters in separate groups: torch's fused AdamW refuses
    # one call mixing DTensors and tensors (SonarAdamW updates each expert tensor in its own call).
    experts = {id(p) for p in _experts(standard)}
    dense = [p for p in standard.parameters() if id(p) not in experts]
    groups = [{"params": _experts(standard)}, {"params": dense}]
    _train(standard, torch.optim.AdamW(groups, **HYPER, **FUSED), 2)
    _train(sonar, optimizer, 2)
    for p, q in zip(_experts(sonar), _experts(standard), strict=True):
        assert float(optimizer.state[p]["step"]) == 2.0 and p.grad is None
        assert torch.equal(p.to_local(), q.to_local())
    assert float(optimizer.expert_grad_norm()) > 0


@pytest.mark.timeout(60)
def test_fsdp2_unsharded_weights_reach_the_owners_update(one_rank_mesh):
    # FSDP2 runs the forward on unsharded parameters (other tensor objects, without the update); their
    # gradient is reduce-scattered into the sharded DTensor parameter's .grad, whose hook applies the
    # owner's update: the same bits as FSDP2 with torch.optim.AdamW.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = one_rank_mesh
    standard, sonar = Tiny(), Tiny()
    for model in (standard, sonar):
        fully_shard(model.experts, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = sonar_kernels.SonarAdamW(sonar, **HYPER)
    assert all(isinstance(p, DTensor) for p in _experts(sonar))
    assert len(optimizer.expert_tensors) == 2
    _train(standard, torch.optim.AdamW(standard.parameters(), **HYPER, **FUSED), 2)
    _train(sonar, optimizer, 2)
    for p, q in zip(sonar.parameters(), standard.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local())
    for p in _experts(sonar):
        assert float(optimizer.state[p]["step"]) == 2.0 and p.grad is None
    assert float(optimizer.expert_grad_norm()) > 0
