"""SonarAdamW's parameter groups as torch's tools use them: a hyperparameter set between a forward and
step() however it is set (``group[key] = ...``, ``group.update``, a tensor lr filled in place by an LR
scheduler), ``torch.compile(optimizer.step)`` (torch's compiled-optimizer recipe), and
torch.distributed.checkpoint's optimizer state_dict at any step. Both backends where an expert tensor is
involved (the Triton backend under the interpreter). References: torch.optim.AdamW over the same model
with plain expert gradients, ExpertAdamW beside a compiled torch.optim.AdamW, an uninterrupted run."""

import io
import warnings

import pytest
import torch
import torch._dynamo.testing
from numerics import rel_err
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import sonar_kernels

BACKENDS = ["torch", "triton"]
HYPER = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
LR, NEW_LR = 1e-2, 5e-3


class TwoLayers(torch.nn.Module):
    """A router, two SonarExperts layers (in one parameter group: one change reaches both) and a dense head."""

    def __init__(self, backend, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.router = torch.nn.Linear(16, 4)
        self.experts = torch.nn.ModuleList(
            sonar_kernels.SonarExperts(4, 16, 8, backend=backend) for _ in range(2)
        )
        self.head = torch.nn.Linear(16, 16)

    def forward(self, x):
        weights, index = torch.softmax(self.router(x), -1).topk(2, dim=-1)
        for experts in self.experts:
            x = experts(x, index, weights)
        return self.head(x)


def _batch(step):
    return torch.randn(12, 16, generator=torch.Generator().manual_seed(100 + step))


def _loss(model, step):
    return model(_batch(step)).square().mean()


def _expert_tensors(model):
    return [p for experts in model.experts for p in experts.parameters()]


def _dense_parameters(model):
    return [*model.router.parameters(), *model.head.parameters()]


def _snapshot(model, optimizer):
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [t.detach().clone() for t in state.values()]
    return tensors


def _torch_adamw_step(backend, lr):
    """One step of torch.optim.AdamW over the whole model, the experts' gradients plain ones (no optimizer
    owns them)."""
    model = TwoLayers(backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, **HYPER)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experts trained by an optimizer that does not own them
        _loss(model, 0).backward()
        optimizer.step()
    return list(model.parameters())


def _assert_trained_with(model, backend, lr, other_lr):
    """Every parameter (dense and expert) took the step torch.optim.AdamW takes with ``lr`` (the two
    backends' gradients round differently: normwise), and visibly not the one with ``other_lr``."""
    expected, other = _torch_adamw_step(backend, lr), _torch_adamw_step(backend, other_lr)
    for p, e, o in zip(model.parameters(), expected, other, strict=True):
        assert rel_err(p, e) <= 1e-6
        assert rel_err(p, o) > 1e-4


# How a hyperparameter is set: (tensor lr, change to NEW_LR). A scheduler fills a tensor lr in place.
HOWS = {
    "group[key]=": (False, lambda optimizer, scheduler: optimizer.param_groups[0].__setitem__("lr", NEW_LR)),
    "group.update": (False, lambda optimizer, scheduler: optimizer.param_groups[0].update(lr=NEW_LR)),
    "tensor-lr.fill_": (True, lambda optimizer, scheduler: optimizer.param_groups[0]["lr"].fill_(NEW_LR)),
    "scheduler-on-tensor-lr": (True, lambda optimizer, scheduler: scheduler.step()),
}


def _setup(backend, how):
    tensor_lr, change = HOWS[how]
    model = TwoLayers(backend)
    optimizer = sonar_kernels.SonarAdamW(model, lr=torch.tensor(LR) if tensor_lr else LR, **HYPER)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step == 0 else NEW_LR / LR)
    return model, optimizer, lambda: change(optimizer, scheduler)


def _restore_lr(optimizer):
    group = optimizer.param_groups[0]
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(LR)
    else:
        group["lr"] = LR


@pytest.mark.parametrize("how", list(HOWS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hyperparameter_set_between_forward_and_backward_is_used_by_every_update_of_the_step(backend, how):
    # The expert updates read their group when the backward runs, the dense step when step() runs: both
    # take the new value, in both layers (the first layer's backward must not find the hyperparameter
    # tensor that the second one's rewrote "modified").
    model, optimizer, change = _setup(backend, how)
    loss = _loss(model, 0)
    change()
    loss.backward()
    optimizer.step()
    _assert_trained_with(model, backend, NEW_LR, LR)


@pytest.mark.parametrize("how", list(HOWS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hyperparameter_set_between_backward_and_step_is_refused_by_step_before_the_dense_step(
    backend, how
):
    # The expert updates already ran with the old value; step() would take the dense step with the new
    # one. It raises before anything changes; with the value restored, the step is the old value's.
    model, optimizer, change = _setup(backend, how)
    _loss(model, 0).backward()
    before = _snapshot(model, optimizer)
    change()
    with pytest.raises(RuntimeError, match=r"lr of parameter group 0 changed after .* before step\(\)"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, optimizer), before, strict=True))
    with pytest.raises(RuntimeError, match="before step"):  # refused again: the step did not end
        optimizer.step()
    _restore_lr(optimizer)
    optimizer.step()
    _assert_trained_with(model, backend, LR, NEW_LR)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unsupported_option_set_on_a_group_with_expert_tensors_is_refused_before_any_update(backend):
    model = TwoLayers(backend)
    optimizer = sonar_kernels.SonarAdamW(model, lr=LR, **HYPER)
    before = _snapshot(model, optimizer)
    optimizer.param_groups[0]["maximize"] = True
    with pytest.raises(ValueError, match="maximize=True"):
        _loss(model, 0).backward()
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, optimizer), before, strict=True))
    with pytest.raises(ValueError, match="maximize=True"):  # nor a dense step for the group
        optimizer.step()
    optimizer.zero_grad()
    optimizer.param_groups[0]["maximize"] = False
    _loss(model, 0).backward()
    optimizer.step()
    _assert_trained_with(model, backend, LR, NEW_LR)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("when", ["scheduler after step", "fill_ between forward and backward"])
def test_a_tensor_lr_filled_in_place_reaches_the_compiled_update(fresh_dynamo, when):
    # Compiled forward and backward (fullgraph): nothing of the optimizer runs between a scheduler's
    # fill_ and the compiled update, which must still read the new value, as eager mode does.
    schedule = [1.0, 0.0, 3.0, 1.0]
    results = []
    for compile_backend in (None, "aot_eager", "aot_eager-unscheduled"):
        model = TwoLayers("torch")
        optimizer = sonar_kernels.SonarAdamW(model, lr=torch.tensor(LR), **HYPER)

        def loss_of(x, model=model):
            return model(x).square().mean()

        if compile_backend is not None:
            loss_of = torch.compile(loss_of, backend="aot_eager", fullgraph=True)
        for step in range(3):
            loss = loss_of(_batch(step))
            if when != "scheduler after step" and compile_backend != "aot_eager-unscheduled":
                optimizer.param_groups[0]["lr"].fill_(LR * schedule[step + 1])
            loss.backward()
            optimizer.step()
            if when == "scheduler after step" and compile_backend != "aot_eager-unscheduled":
                optimizer.param_groups[0]["lr"].fill_(LR * schedule[step + 1])
            optimizer.zero_grad()
        results.append(list(model.parameters()))
    eager, compiled, unscheduled = results
    # Normwise: with a tensor lr, eager torch-backend updates take torch's arithmetic for tensor values,
    # the compiled ones the float64 values of the hyperparameter tensor (a few ulps apart).
    for p, q, u in zip(compiled, eager, unscheduled, strict=True):
        assert rel_err(p, q) <= 1e-6
        assert rel_err(p, u) > 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_compiled_optimizer_step_equals_expert_adamw_beside_a_compiled_torch_adamw(fresh_dynamo, backend):
    # torch's compiled-optimizer recipe: torch.compile(optimizer.step). The dense step is compiled (dynamo
    # traces torch.optim.AdamW's step with capturable=True, so the reference's dense step is compiled too).
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    model = TwoLayers(backend)
    optimizer = sonar_kernels.SonarAdamW(model, lr=LR, **HYPER)
    step = torch.compile(optimizer.step, backend=counter)
    reference = TwoLayers(backend)
    experts = sonar_kernels.ExpertAdamW(_expert_tensors(reference), lr=LR, **HYPER)
    dense = torch.optim.AdamW(_dense_parameters(reference), lr=LR, **HYPER)
    dense_step = torch.compile(dense.step, backend="aot_eager")
    frames = []
    for i in range(3):
        _loss(model, i).backward()
        step()
        optimizer.zero_grad()
        frames.append(counter.frame_count)
        _loss(reference, i).backward()
        experts.step()
        dense_step()
        dense.zero_grad()
    assert frames[0] >= 1 and frames[-1] == frames[0]  # compiled at the first step, never again
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    for p in _expert_tensors(model):
        assert float(optimizer.state[p]["step"]) == 3.0 and p.grad is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_compiled_optimizer_step_with_fused_adamw_equals_eager_bitwise(fresh_dynamo, backend):
    # torch's fused AdamW is not switched to capturable by dynamo: the compiled step is eager's, bit for bit.
    models = []
    for compiled in (False, True):
        model = TwoLayers(backend)
        optimizer = sonar_kernels.SonarAdamW(model, lr=LR, fused=True, max_grad_norm=0.5, **HYPER)
        step = torch.compile(optimizer.step, backend="aot_eager") if compiled else optimizer.step
        for i in range(3):
            _loss(model, i).backward()
            step()
            optimizer.zero_grad()
        models.append(model)
    for p, q in zip(*(model.parameters() for model in models), strict=True):
        assert torch.equal(p, q)


def _state_bytes(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("stop_at", [0, 1, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_distributed_checkpoint_round_trip_resumes_bitwise(backend, stop_at):
    # torch.distributed.checkpoint.state_dict (no process group needed): a checkpoint taken before the
    # first step() too holds every parameter's state, and resuming equals not stopping.
    steps = 3

    def train(model, optimizer, batches):
        for i in batches:
            _loss(model, i).backward()
            optimizer.step()
            optimizer.zero_grad()

    uninterrupted = TwoLayers(backend)
    optimizer = sonar_kernels.SonarAdamW(uninterrupted, lr=LR, max_grad_norm=1.0, **HYPER)
    train(uninterrupted, optimizer, range(steps))
    first = TwoLayers(backend)
    first_optimizer = sonar_kernels.SonarAdamW(first, lr=LR, max_grad_norm=1.0, **HYPER)
    train(first, first_optimizer, range(stop_at))
    saved_model = _state_bytes(get_model_state_dict(first))
    saved_optimizer = _state_bytes(get_optimizer_state_dict(first, first_optimizer))
    assert set(saved_optimizer["state"]) == {name for name, _ in first.named_parameters()}
    resumed = TwoLayers(backend, seed=1)
    resumed_optimizer = sonar_kernels.SonarAdamW(resumed, lr=LR, max_grad_norm=1.0, **HYPER)
    set_model_state_dict(resumed, saved_model)
    set_optimizer_state_dict(resumed, resumed_optimizer, saved_optimizer)
    train(resumed, resumed_optimizer, range(stop_at, steps))
    for p, q in zip(resumed.parameters(), uninterrupted.parameters(), strict=True):
        assert torch.equal(p, q)
        for key, value in optimizer.state[q].items():
            assert torch.equal(resumed_optimizer.state[p][key].cpu(), value.cpu()), key


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(
            {"moments_dtype": torch.float32, "master_weights": "remainder"}, id="fp32-moments-remainder"
        ),
        pytest.param({"moments_dtype": "8bit", "master_weights": "stochastic"}, id="8bit-stochastic"),
        pytest.param({"max_grad_norm": 1.0, "expert_clipping": "lagged"}, id="lagged"),
    ],
)
def test_an_undecided_expert_tensor_saves_the_state_its_update_starts_from(options):
    # Several ranks (a fake process group in this process), before the experts modules' first forward: the
    # expert tensors are held undecided. A checkpoint then holds for them what the same optimizer saves for
    # them once decided (one process: the in-backward update's initial state), not torch's dense state.
    import torch.distributed as dist
    from test_replacement import Tiny
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def saved():
        model = Tiny().to(torch.bfloat16)
        optimizer = sonar_kernels.SonarAdamW(model.parameters(), **options)
        return optimizer, optimizer.state_dict()

    _, single = saved()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        optimizer, undecided = saved()
        assert len(optimizer.managed.pending) == 2
    finally:
        dist.destroy_process_group()
    assert undecided["state"].keys() == single["state"].keys()
    for index, state in single["state"].items():
        assert undecided["state"][index].keys() == state.keys(), index
        for key, value in state.items():
            other = undecided["state"][index][key]
            assert (other.dtype, other.device) == (value.dtype, value.device) and torch.equal(other, value), (
                key
            )
