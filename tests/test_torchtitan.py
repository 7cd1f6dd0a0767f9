"""The torchtitan plug-in (sonar_kernels.integrations.torchtitan) against torchtitan's own modules and
torch.optim.AdamW (torchtitan 0.3.0, CPU).

torchtitan 0.3.0's GroupedExperts has one forward, which casts its input and weights to bf16 (no
for-loop path), so it is the reference of the default bf16 compute, at the bf16 tolerance. The fp32
reference is torchtitan's dense SwiGLU (``FeedForward``: w2(silu(w1 x) * w3 x), in the input's dtype) run
per expert in float64 with the same weights."""

import dataclasses

import pytest
import torch
from numerics import TOLERANCE, assert_close, rel_err
from torch import nn

pytest.importorskip("torchtitan")

from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    default_adamw,
)
from torchtitan.config import Configurable, OverrideConfig
from torchtitan.config.override import apply_overrides
from torchtitan.distributed.utils import clip_grad_norm_
from torchtitan.models.common.config_utils import make_routed_experts_config
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts, MoE, TokenChoiceTopKRouter

import sonar_kernels
from sonar_kernels import specs
from sonar_kernels.integrations.torchtitan import (
    EXPERT_WEIGHTS,
    SonarGroupedExperts,
    SonarOptimizersContainer,
    sonar_adamw,
    swap_grouped_experts,
)

E, D, F, TOP_K = 4, 16, 8, 2
N = 24  # rows of the experts' input
EXPERTS_OVERRIDE = "sonar_kernels.integrations.torchtitan.sonar_grouped_experts"
OPTIMIZER_OVERRIDE = "sonar_kernels.integrations.torchtitan.sonar_optimizers"
HYPER = {"lr": 3e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
MAX_NORM = 0.5
# The router's float32 autocast region warns on the CPU (torchtitan's code, not ours).
CPU_AUTOCAST = "ignore:In CPU autocast, but the target dtype is not supported"


def _counts(seed=0):
    """Random counts of N rows over experts 0, 2 and 3; expert 1 gets none."""
    generator = torch.Generator().manual_seed(seed)
    experts = torch.tensor([0, 2, 3])[torch.randint(0, 3, (N,), generator=generator)]
    return torch.bincount(experts, minlength=E)


def _config(cls=GroupedExperts, **options):
    return cls.Config(dim=D, hidden_dim=F, num_experts=E, **options)


def _fill(module, seed=0):
    """Random weights (GroupedExperts allocates them uninitialised; torchtitan's init runs in the trainer)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5)
    return module


def _stock(seed=0):
    return _fill(GroupedExperts(_config()), seed)


def _device(backend):
    """Where a backend's module runs: the Triton backend on CUDA when there is one (compiled kernels), else
    on the CPU (under the interpreter, tests/conftest.py); the references stay on the CPU."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _sonar_like(stock, device="cpu", **options):
    module = SonarGroupedExperts(_config(SonarGroupedExperts, **options))
    module.load_state_dict(stock.state_dict())
    return module.to(device)


def _swiglu_per_expert_float64(stock, x, counts):
    """Each expert's rows through torchtitan's FeedForward holding that expert's weights, in float64:
    (output [N, D], the FeedForward modules, whose weights' .grad the backward fills)."""
    experts = []
    for e in range(E):
        ff = FeedForward(
            FeedForward.Config(
                w1=Linear.Config(in_features=D, out_features=F),
                w2=Linear.Config(in_features=F, out_features=D),
                w3=Linear.Config(in_features=D, out_features=F),
            )
        ).double()
        with torch.no_grad():
            for linear, name in ((ff.w1, "w1_EFD"), (ff.w2, "w2_EDF"), (ff.w3, "w3_EFD")):
                linear.weight.copy_(getattr(stock, name)[e])
        experts.append(ff)
    rows = torch.split(x, counts.tolist())
    return torch.cat([ff(r) for ff, r in zip(experts, rows, strict=True)]), experts


def _stacked_grads(experts):
    """{w1_EFD, w2_EDF, w3_EFD: [E, ...] float64} from the per-expert FeedForward modules."""
    return {
        name: torch.stack([getattr(ff, attr).weight.grad for ff in experts])
        for name, attr in (("w1_EFD", "w1"), ("w2_EDF", "w2"), ("w3_EFD", "w3"))
    }


def _fp32_step_and_reference(stock, sonar):
    """One forward and backward of ``sonar`` on random fp32 rows (the counts of _counts) and of the float64
    per-expert SwiGLU with ``stock``'s weights: (output, its input leaf, the reference output, its input
    leaf, the reference's FeedForward modules)."""
    device = sonar.w1_EFD.device
    counts = _counts()
    x = torch.randn(N, D)
    grad_out = torch.randn(N, D)
    xd = x.to(device).detach().requires_grad_()
    out = sonar(xd, counts)
    out.backward(grad_out.to(device))
    x64 = x.detach().double().requires_grad_()
    expected, experts = _swiglu_per_expert_float64(stock, x64, counts)
    expected.backward(grad_out.double())
    return out, xd, expected, x64, experts


@pytest.mark.timeout(60)
def test_parameters_and_checkpoints_are_the_stock_modules():
    stock = _stock()
    sonar = SonarGroupedExperts(_config(SonarGroupedExperts, backend="torch"))
    assert list(sonar.state_dict()) == list(stock.state_dict()) == list(EXPERT_WEIGHTS)
    for name in EXPERT_WEIGHTS:
        assert getattr(sonar, name).shape == getattr(stock, name).shape
    # A stock checkpoint loads (strict), and the sonar module's checkpoint is the stock one, bit for bit.
    sonar.load_state_dict(stock.state_dict())
    saved = sonar.state_dict()
    for name, value in stock.state_dict().items():
        assert torch.equal(saved[name], value), name
    back = GroupedExperts(_config())
    back.load_state_dict(saved)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in saved.items())
    # The expert tensors, marked for SonarAdamW, also after load_state_dict(assign=True).
    sonar.load_state_dict(stock.state_dict(), assign=True)
    assert sonar.expert_tensors() == tuple(getattr(sonar, n) for n in EXPERT_WEIGHTS)
    assert all(specs.is_expert_tensor(t) for t in sonar.expert_tensors())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_default_bf16_compute_matches_torchtitans_grouped_experts(backend):
    stock = _stock()
    device = _device(backend)
    sonar = _sonar_like(stock, device, backend=backend)  # compute_dtype "bfloat16", as stock
    counts = _counts()
    x = torch.randn(N, D)
    grad_out = torch.randn(N, D)
    inputs = [x.clone().requires_grad_(), x.to(device).detach().requires_grad_()]
    outputs = [stock(inputs[0], counts), sonar(inputs[1], counts)]
    for out in outputs:
        out.backward(grad_out.to(out.device))
    assert outputs[1].dtype == torch.float32
    # Both round the same quantities to bf16 (stock also rounds silu(gate) on its own): 4u, u = 2^-8.
    assert_close(outputs[1].cpu(), outputs[0], torch.bfloat16, what="output")
    assert_close(inputs[1].grad.cpu(), inputs[0].grad, torch.bfloat16, what="dX")
    for name in EXPERT_WEIGHTS:
        assert_close(getattr(sonar, name).grad.cpu(), getattr(stock, name).grad, torch.bfloat16, what=name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp32_gradients_match_torchtitans_swiglu_in_float64(backend):
    stock = _stock()
    sonar = _sonar_like(stock, _device(backend), backend=backend, compute_dtype="input")
    out, xd, expected, x64, experts = _fp32_step_and_reference(stock, sonar)
    assert out.dtype == torch.float32
    assert_close(out.cpu(), expected, torch.float32, what="output")
    assert_close(xd.grad.cpu(), x64.grad, torch.float32, what="dX")
    for name, grad in _stacked_grads(experts).items():
        assert_close(getattr(sonar, name).grad.cpu(), grad, torch.float32, what=name)
    assert torch.equal(sonar.w1_EFD.grad[1].cpu(), torch.zeros(F, D))  # the expert without rows


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_split_path_update_uses_the_gradients_of_torchtitans_swiglu(backend):
    # SonarAdamW attached, fused_epilogue=False: each weight's gradient goes into the AdamW update inside the
    # backward (no .grad), on the Triton backend through the split path (the wgrad to a temporary, then the
    # AdamW kernel), on the torch backend through torch's AdamW right after the wgrad. After one step
    # exp_avg = (1 - beta1) g and exp_avg_sq = (1 - beta2) g^2, and W is torch.optim.AdamW's step fed the
    # float64 reference gradient.
    stock = _stock()
    sonar = _sonar_like(stock, _device(backend), backend=backend, compute_dtype="input")
    optimizer = sonar_kernels.SonarAdamW(sonar, **HYPER, fused_epilogue=False)
    _, xd, _, x64, experts = _fp32_step_and_reference(stock, sonar)
    assert_close(xd.grad.cpu(), x64.grad, torch.float32, what="dX")
    reference = {name: nn.Parameter(getattr(stock, name).detach().double()) for name in EXPERT_WEIGHTS}
    torch_adamw = torch.optim.AdamW(reference.values(), **HYPER)
    for name, grad in _stacked_grads(experts).items():
        reference[name].grad = grad
    torch_adamw.step()
    beta1, beta2 = HYPER["betas"]
    for name, grad in _stacked_grads(experts).items():
        w = getattr(sonar, name)
        assert w.grad is None, name  # updated in the backward
        state = optimizer.state[w]
        assert float(state["step"]) == 1
        exp_avg, exp_avg_sq = state["exp_avg"].cpu(), state["exp_avg_sq"].cpu()
        assert_close(exp_avg / (1 - beta1), grad, torch.float32, what=f"{name} gradient")
        assert_close(exp_avg_sq / (1 - beta2), grad.square(), torch.float32, what=f"{name} gradient^2")
        assert_close(w.cpu(), reference[name], torch.float32, what=f"{name} after the update")
    optimizer.step()


def _moe_config(**experts_options):
    """A torchtitan MoE layer (softmax top-2 router, E experts); with options, the experts replaced through
    torchtitan's override mechanism by SonarGroupedExperts with those options."""
    config = MoE.Config(
        num_experts=E,
        routed_experts=make_routed_experts_config(
            dim=D, hidden_dim=F, num_experts=E, top_k=TOP_K, param_init={}, comm_backend="standard"
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E,
            gate=Linear.Config(in_features=D, out_features=E),
            top_k=TOP_K,
            score_func="softmax",
        ),
        load_balance_coeff=None,
    )
    if experts_options:
        done = apply_overrides(OverrideConfig(imports=[(EXPERTS_OVERRIDE, experts_options)]), config)
        assert len(done) == 1, done
    return config


class TinyModel(nn.Module):
    """A dense layer, a torchtitan MoE layer (router and experts), a dense head."""

    def __init__(self, moe_config):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.moe = moe_config.build()
        self.head = nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        return self.head(h + self.moe(h))


def _models(count, **experts_options):
    """``count`` TinyModels with the same weights (those of a stock one, seeded)."""
    torch.manual_seed(0)
    stock = _fill(TinyModel(_moe_config()), seed=1)
    models = [TinyModel(_moe_config(**experts_options)) for _ in range(count)]
    for model in models:
        model.load_state_dict(stock.state_dict())
    return models


def _batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    return 3 * torch.randn(2, 6, D, generator=generator), torch.randn(2, 6, D, generator=generator)


def _dense(model):
    return [p for name, p in model.named_parameters() if ".inner_experts." not in name]


def _assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max():.3e}"


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings(CPU_AUTOCAST)
def test_the_override_replaces_the_stock_experts_config_only():
    config = _moe_config(backend="torch", compute_dtype="input")
    experts = config.routed_experts.inner_experts
    assert type(experts) is SonarGroupedExperts.Config
    assert (experts.backend, experts.compute_dtype, experts.dim, experts.hidden_dim) == (
        "torch",
        "input",
        D,
        F,
    )
    assert isinstance(config.build().routed_experts.inner_experts, SonarGroupedExperts)

    class OtherExperts(GroupedExperts):  # a subclass (another layout or activation): left alone
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

    other = _moe_config()
    other.routed_experts.inner_experts = _config(OtherExperts)
    assert apply_overrides(OverrideConfig(imports=[EXPERTS_OVERRIDE]), other) == []
    with pytest.raises(ValueError, match="backend must be one of"):
        apply_overrides(OverrideConfig(imports=[(EXPERTS_OVERRIDE, {"backend": "cuda"})]), _moe_config())


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings(CPU_AUTOCAST)
def test_swap_keeps_the_parameters_and_their_names():
    torch.manual_seed(0)
    model = _fill(TinyModel(_moe_config()))
    before = dict(model.named_parameters())
    state = model.state_dict()
    x, _ = _batch(0)
    expected = model(x)
    with pytest.raises(ValueError, match="compute_dtype"):
        swap_grouped_experts(model, compute_dtype="float64")
    assert type(model.moe.routed_experts.inner_experts) is GroupedExperts  # unchanged by the refusal
    assert swap_grouped_experts(model, backend="torch") == 1
    experts = model.moe.routed_experts.inner_experts
    assert isinstance(experts, SonarGroupedExperts) and experts.backend == "torch"
    assert all(p is before[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == list(state)
    assert all(specs.is_expert_tensor(t) for t in experts.expert_tensors())
    # bf16 compute, as stock: the same bf16 roundings (up to the order of fp32 sums).
    assert rel_err(model(x), expected) <= TOLERANCE[torch.bfloat16]
    assert swap_grouped_experts(model) == 0
    # After torchtitan's parallelize() (which wraps the forward of the instance) a class change would not reach
    # the forward: refused, nothing changed.
    parallelized = TinyModel(_moe_config())
    parallelized.moe.routed_experts.inner_experts._parallelized = True
    with pytest.raises(ValueError, match="already parallelized"):
        swap_grouped_experts(parallelized)
    assert type(parallelized.moe.routed_experts.inner_experts) is GroupedExperts


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings(CPU_AUTOCAST)
def test_three_steps_with_sonar_adamw_equal_torch_adamw_with_dense_clipping_bitwise():
    sonar, standard = _models(2, backend="torch", compute_dtype="input")
    optimizer = sonar_kernels.SonarAdamW(sonar, **HYPER, max_grad_norm=MAX_NORM)
    # Fused: SonarAdamW's default flags run torch's fused AdamW on the CPU.
    torch_adamw = torch.optim.AdamW(standard.parameters(), **HYPER, fused=True)
    for step in range(3):
        x, y = _batch(step)
        nn.functional.mse_loss(sonar(x), y).backward()
        assert all(t.grad is None for t in sonar.moe.routed_experts.inner_experts.expert_tensors())
        optimizer.step()
        optimizer.zero_grad()
        nn.functional.mse_loss(standard(x), y).backward()
        norm = nn.utils.clip_grad_norm_(_dense(standard), MAX_NORM)
        assert norm > MAX_NORM  # clipping is active
        assert torch.equal(optimizer.last_dense_grad_norm, norm)
        torch_adamw.step()
        torch_adamw.zero_grad()
    _assert_same(sonar, standard)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings(CPU_AUTOCAST)
def test_torchtitans_optimizer_api_with_sonar_adamw_equals_its_adamw_and_checkpoints_move():
    # The trainer's calls: config.optimizer.build(model_parts=...), lr_scheduler.build(...), its
    # clip_grad_norm_ over every parameter, optimizers.step(), lr_schedulers.step(), zero_grad().
    sonar, standard, resumed = _models(3, backend="torch", compute_dtype="input")
    optimizers = sonar_adamw(**HYPER).build(model_parts=[sonar])
    assert isinstance(optimizers, SonarOptimizersContainer)
    assert [type(o) for o in optimizers] == [sonar_kernels.SonarAdamW]
    reference = default_adamw(**HYPER).build(model_parts=[standard])
    schedulers = [
        LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=o, training_steps=3)
        for o in (optimizers, reference)
    ]
    for step in range(3):
        x, y = _batch(step)
        nn.functional.mse_loss(sonar(x), y).backward()
        assert all(t.grad is None for t in sonar.moe.routed_experts.inner_experts.expert_tensors())
        norm = clip_grad_norm_(list(sonar.parameters()), MAX_NORM, foreach=True)  # sees the dense ones
        nn.functional.mse_loss(standard(x), y).backward()
        dense_norm = clip_grad_norm_(_dense(standard), MAX_NORM, foreach=True)
        assert dense_norm > MAX_NORM and torch.equal(norm, dense_norm)
        for opts, scheduler in zip((optimizers, reference), schedulers, strict=True):
            opts.step()
            scheduler.step()
            opts.zero_grad()
    _assert_same(sonar, standard)
    # torchtitan's flat FQN-keyed optimizer checkpoints: the same keys and values, both ways.
    saved, expected = optimizers.state_dict(), reference.state_dict()
    assert sorted(saved) == sorted(expected)
    for key, value in expected.items():
        if key.startswith("state."):
            assert torch.equal(torch.as_tensor(saved[key]), torch.as_tensor(value)), key
        else:
            assert saved[key] == value, key
    fresh = sonar_adamw(**HYPER).build(model_parts=[resumed])  # before any step: dense state created to load
    fresh.load_state_dict(expected)
    loaded = fresh.state_dict()
    for key, value in expected.items():
        if key.startswith("state."):
            assert torch.equal(torch.as_tensor(loaded[key]), torch.as_tensor(value)), key


@pytest.mark.timeout(60)
def test_the_optimizer_override_turns_adamw_groups_into_sonar_adamw():
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Root(Configurable.Config):  # the part of torchtitan's Trainer.Config the override sees
        optimizer: OptimizersContainer.Config

    root = Root(optimizer=default_adamw(lr=1e-3))
    done = apply_overrides(
        OverrideConfig(imports=[(OPTIMIZER_OVERRIDE, {"accumulation_steps": 2, "moments_dtype": "float32"})]),
        root,
    )
    assert len(done) == 1
    assert type(root.optimizer) is SonarOptimizersContainer.Config
    assert [g.optimizer_name for g in root.optimizer.param_groups] == ["SonarAdamW"]
    assert (
        root.optimizer.param_groups[0].optimizer_kwargs
        == default_adamw(lr=1e-3).param_groups[0].optimizer_kwargs
    )
    experts = _fill(SonarGroupedExperts(_config(SonarGroupedExperts, backend="torch")))
    optimizer = next(iter(root.optimizer.build(model_parts=[experts])))
    assert optimizer.accumulation_steps == 2
    assert optimizer.dense_parameters() == []  # every weight is an expert tensor, updated in the backward
    # A container whose groups all name another optimizer trains the experts as dense parameters: it says so.
    with pytest.warns(UserWarning, match="no param group of 'SonarAdamW' holds the model's 3 expert tensors"):
        SonarOptimizersContainer.Config(param_groups=default_adamw(lr=1e-3).param_groups).build(
            model_parts=[experts]
        )


@pytest.fixture
def mesh():
    """A one-rank CPU DeviceMesh (gloo in this process), destroyed afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_dtensor_weights_run_on_their_local_shards_and_the_rest_is_refused(mesh):
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    stock = _stock()
    plain = _sonar_like(stock, backend="torch", compute_dtype="input")
    sharded = _sonar_like(stock, backend="torch", compute_dtype="input")
    for name in EXPERT_WEIGHTS:  # expert parallel: the expert axis sharded over the "ep" mesh
        setattr(
            sharded, name, nn.Parameter(distribute_tensor(getattr(stock, name).detach(), mesh, [Shard(0)]))
        )
    optimizers = [sonar_kernels.SonarAdamW(m, **HYPER) for m in (plain, sharded)]
    x, counts = torch.randn(N, D), _counts()
    grad_out = torch.randn(N, D)
    for module, optimizer in zip((plain, sharded), optimizers, strict=True):
        module(x, counts).backward(grad_out)
        optimizer.step()
    for name in EXPERT_WEIGHTS:  # the DTensor parameters updated from their gradient, as the plain ones
        w = getattr(sharded, name)
        assert isinstance(w, DTensor) and w.grad is None
        assert torch.equal(w.to_local(), getattr(plain, name)), name
    with pytest.raises(TypeError, match="x_RD is a DTensor"):
        sharded(distribute_tensor(x, mesh, [Shard(0)]), counts)
    partial = _sonar_like(stock, backend="torch")
    partial.w2_EDF = nn.Parameter(DTensor.from_local(stock.w2_EDF.detach(), mesh, [Partial()]))
    with pytest.raises(ValueError, match=r"\['w2_EDF'\] are DTensors and the other expert weights are not"):
        partial(x, counts)
    for name in ("w1_EFD", "w3_EFD"):
        setattr(
            partial, name, nn.Parameter(DTensor.from_local(getattr(stock, name).detach(), mesh, [Shard(0)]))
        )
    with pytest.raises(ValueError, match="w2_EDF has the DTensor placement"):
        partial(x, counts)
