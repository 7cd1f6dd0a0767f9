"""SonarAdamW: the whole-model optimizer against torch.optim.AdamW with dense-only clipping."""

import copy
import io

import pytest
import torch
from numerics import rel_err
from torch import nn

import sonar_kernels
from sonar_kernels.optim.in_backward import mark_expert_tensors

H, I, E, TOP_K, T = 16, 8, 4, 2, 12
HYPER = {"lr": 3e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STEPS = 20
# What SonarAdamW's default flags (foreach=None, fused=None) run on the CPU: torch's fused AdamW.
FUSED = {"fused": True}


class TinyMoE(nn.Module):
    """Dense layers around one SonarExperts layer, routed by a softmax top-k router (also used by
    test_nonfinite.py and test_distributed.py). ``num_experts``, ``ep_group``: of the SonarExperts layer;
    ``mask`` [T, num_experts], added to the router logits, shapes the routing."""

    def __init__(self, backend, num_experts=E, ep_group=None):
        super().__init__()
        self.embed = nn.Linear(H, H)
        self.router = nn.Linear(H, num_experts, bias=False)
        self.experts = sonar_kernels.SonarExperts(num_experts, H, I, backend=backend, ep_group=ep_group)
        self.head = nn.Linear(H, H)

    def forward(self, x, mask=None):
        h = torch.tanh(self.embed(x))
        logits = self.router(h) if mask is None else self.router(h) + mask
        weights, index = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
        h = h + self.experts(h, index, weights / weights.sum(-1, keepdim=True))
        return self.head(h)


def _model(backend, seed=0):
    torch.manual_seed(seed)
    return TinyMoE(backend)


def _batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    return 3 * torch.randn(T, H, generator=generator), torch.randn(T, H, generator=generator)


def _dense(model):
    return [p for name, p in model.named_parameters() if not name.startswith("experts.")]


def _standard(model):
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER, **FUSED)
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)


def _sonar(model):
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, max_grad_norm=0.5)
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)


def _train(model, optimizer, scheduler, steps, start=0, sonar=True):
    norms = []
    for step in range(start, start + steps):
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        if sonar:
            assert model.experts.gate_up_proj.grad is None
        else:
            norms.append(float(nn.utils.clip_grad_norm_(_dense(model), 0.5)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if sonar:
            norms.append(float(optimizer.last_dense_grad_norm))
    return norms


def _assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max():.3e}"


def test_twenty_steps_equal_standard_training_with_dense_clipping_bitwise():
    standard, sonar = _model("torch"), _model("torch")
    norms = _train(standard, *_standard(standard), STEPS, sonar=False)
    sonar_norms = _train(sonar, *_sonar(sonar), STEPS)
    assert max(norms) > 0.5  # clipping did change the gradients
    assert norms == sonar_norms
    _assert_same(sonar, standard)


def test_twenty_steps_on_the_triton_backend_match_within_the_tolerance(device):
    standard = _model("torch")
    _train(standard, *_standard(standard), STEPS, sonar=False)
    sonar = _model("triton").to(device)
    optimizer, scheduler = _sonar(sonar)
    for step in range(STEPS):
        x, y = (t.to(device) for t in _batch(step))
        nn.functional.mse_loss(sonar(x), y).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    for (name, p), q in zip(sonar.named_parameters(), standard.parameters(), strict=True):
        assert rel_err(p.cpu(), q) <= 1e-5, name


def _state(model, optimizer, scheduler):
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": optimizer.state_dict(), "sched": scheduler.state_dict()}, buffer
    )
    buffer.seek(0)
    return torch.load(buffer)


def test_stop_save_rebuild_resume_is_bitwise_equal_to_not_stopping():
    straight = _model("torch")
    _train(straight, *_sonar(straight), STEPS)
    first = _model("torch")
    optimizer, scheduler = _sonar(first)
    _train(first, optimizer, scheduler, STEPS // 2)
    saved = _state(first, optimizer, scheduler)
    resumed = _model("torch", seed=123)  # other initial weights: everything comes from the checkpoint
    resumed.load_state_dict(saved["model"])
    optimizer, scheduler = _sonar(resumed)
    optimizer.load_state_dict(saved["opt"])
    scheduler.load_state_dict(saved["sched"])
    _train(resumed, optimizer, scheduler, STEPS // 2, start=STEPS // 2)
    _assert_same(resumed, straight)


@pytest.mark.parametrize("direction", ["torch-to-sonar", "sonar-to-torch"])
def test_moving_between_torch_adamw_and_sonar_on_resume(direction):
    # Dense clipping is what both runs do, so the interchange is exact.
    straight = _model("torch")
    _train(straight, *_standard(straight), STEPS, sonar=False)
    first = _model("torch")
    build_first, build_second = (_standard, _sonar) if direction == "torch-to-sonar" else (_sonar, _standard)
    optimizer, scheduler = build_first(first)
    _train(first, optimizer, scheduler, STEPS // 2, sonar=build_first is _sonar)
    saved = _state(first, optimizer, scheduler)
    second = _model("torch", seed=123)
    second.load_state_dict(saved["model"])
    optimizer, scheduler = build_second(second)
    optimizer.load_state_dict(saved["opt"])
    scheduler.load_state_dict(saved["sched"])
    if build_second is _standard:
        # torch takes foreach and fused from the checkpoint: SonarAdamW's None (fused where torch has it, as
        # chosen at each step), which torch.optim.AdamW reads as its own default (the for-loop on the CPU).
        assert optimizer.param_groups[0]["fused"] is None
        optimizer.param_groups[0]["fused"] = True
    _train(second, optimizer, scheduler, STEPS // 2, start=STEPS // 2, sonar=build_second is _sonar)
    _assert_same(second, straight)


def test_param_groups_are_kept_as_given():
    model = _model("torch")
    groups = [
        {"params": [model.embed.weight, model.experts.down_proj], "lr": 1e-3},
        {
            "params": [
                model.embed.bias,
                model.router.weight,
                model.experts.gate_up_proj,
                *model.head.parameters(),
            ]
        },
    ]
    optimizer = sonar_kernels.SonarAdamW(groups, **HYPER)
    reference = torch.optim.AdamW(groups, **HYPER)
    assert [len(g["params"]) for g in optimizer.param_groups] == [
        len(g["params"]) for g in reference.param_groups
    ]
    assert (
        optimizer.state_dict()["param_groups"][0]["params"]
        == reference.state_dict()["param_groups"][0]["params"]
    )
    # The experts were found by their registration (no module given) and have state already.
    assert set(optimizer.state) == {model.experts.down_proj, model.experts.gate_up_proj}


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": float("nan")}, ValueError, "max_grad_norm"),
        # torch.optim.AdamW's option, refused for the group that holds the expert tensors (the model's only
        # group); a dense-only group takes it (tests/test_drop_in_adamw.py).
        ({"amsgrad": True}, ValueError, "amsgrad=True"),
    ],
)
def test_bad_options_are_refused(options, error, words):
    with pytest.raises(error, match=words):
        sonar_kernels.SonarAdamW(_model("torch"), **options)


def _accumulate(model, optimizer, steps, k, sonar, device="cpu"):
    for step in range(steps):
        for micro in range(k):
            x, y = (t.to(device) for t in _batch(100 * step + micro))
            (nn.functional.mse_loss(model(x), y) / k).backward()
        if not sonar:
            nn.utils.clip_grad_norm_(_dense(model), 0.5)
        else:  # consumed by the k-th micro-batch's update
            assert model.experts.gate_up_proj.grad is None and model.experts.down_proj.grad is None
        optimizer.step()
        optimizer.zero_grad()


def test_gradient_accumulation_equals_standard_accumulation():
    k = 4
    standard, sonar = _model("torch"), _model("torch")
    _accumulate(standard, torch.optim.AdamW(standard.parameters(), **HYPER, **FUSED), 3, k, sonar=False)
    optimizer = sonar_kernels.SonarAdamW(sonar, **HYPER, max_grad_norm=0.5, accumulation_steps=k)
    _accumulate(sonar, optimizer, 3, k, sonar=True)
    _assert_same(sonar, standard)


def test_gradient_accumulation_on_the_triton_backend(device):
    k = 4
    standard = _model("torch")
    _accumulate(standard, torch.optim.AdamW(standard.parameters(), **HYPER), 3, k, sonar=False)
    results = []
    for fused_epilogue in (True, False):
        sonar = _model("triton").to(device)
        optimizer = sonar_kernels.SonarAdamW(
            sonar, **HYPER, max_grad_norm=0.5, accumulation_steps=k, fused_epilogue=fused_epilogue
        )
        _accumulate(sonar, optimizer, 3, k, sonar=True, device=device)
        results.append([p.detach().clone() for p in sonar.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))  # fused == split, grad_in included
    for (name, _), p, q in zip(standard.named_parameters(), results[0], standard.parameters(), strict=True):
        assert rel_err(p.cpu(), q) <= 1e-5, name


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_backward_more_than_the_accumulation_window_raises(backend, device):
    device = device if backend == "triton" else "cpu"
    model = _model(backend).to(device)
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, accumulation_steps=2)
    for micro in range(2):
        x, y = (t.to(device) for t in _batch(micro))
        nn.functional.mse_loss(model(x), y).backward()
    before = model.experts.down_proj.detach().clone()
    x, y = (t.to(device) for t in _batch(2))
    with pytest.raises(RuntimeError, match="accumulation_steps"):
        nn.functional.mse_loss(model(x), y).backward()
    assert torch.equal(model.experts.down_proj, before)
    optimizer.step()
    optimizer.zero_grad()


def test_clipping_by_the_true_global_norm_sees_the_expert_gradients():
    standard, sonar = _model("torch"), _model("torch")
    x, y = _batch(0)
    nn.functional.mse_loss(standard(x), y).backward()
    expected = nn.utils.clip_grad_norm_(list(standard.parameters()), 0.5)  # all parameters, standard training
    optimizer = sonar_kernels.SonarAdamW(sonar, **HYPER, max_grad_norm=0.5, clip_norm_includes_experts=True)
    nn.functional.mse_loss(sonar(x), y).backward()
    dense_grads = [p.grad.clone() for p in optimizer.dense_parameters()]
    optimizer.step()
    assert rel_err(optimizer.last_grad_norm, expected) <= 1e-6
    assert optimizer.last_grad_norm > optimizer.last_dense_grad_norm
    # The dense gradients were scaled by max_norm / total, as clip_grad_norm_ over everything scales them.
    scale = 0.5 / (float(optimizer.last_grad_norm) + 1e-6)
    for g, q in zip(dense_grads, _dense(standard), strict=True):
        assert torch.allclose(g * scale, q.grad, rtol=1e-6, atol=0)


class CheckpointedMoE(TinyMoE):
    """TinyMoE with the expert layer under torch.utils.checkpoint."""

    def __init__(self, backend, use_reentrant):
        super().__init__(backend)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = torch.tanh(self.embed(x))

        def moe(h):
            weights, index = torch.softmax(self.router(h), dim=-1).topk(TOP_K, dim=-1)
            return h + self.experts(h, index, weights / weights.sum(-1, keepdim=True))

        return self.head(torch.utils.checkpoint.checkpoint(moe, h, use_reentrant=self.use_reentrant))


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_activation_checkpointing_updates_each_expert_tensor_once(backend, use_reentrant, device):
    device = device if backend == "triton" else "cpu"
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = (CheckpointedMoE(backend, use_reentrant) if checkpointed else TinyMoE(backend)).to(device)
        optimizer = sonar_kernels.SonarAdamW(model, **HYPER, max_grad_norm=0.5)
        for step in range(3):
            x, y = (t.to(device) for t in _batch(step))
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert float(optimizer.state[model.experts.down_proj]["step"]) == 3
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


class HeldRecomputation(CheckpointedMoE):
    """CheckpointedMoE whose non-reentrant recomputation leaves the experts' output referenced after it
    ends, as a collective after the experts does (expert parallelism's all-to-all: gloo's and NCCL's work
    objects hold their input until their own threads release it)."""

    def __init__(self, backend, hold):
        super().__init__(backend, use_reentrant=False)
        self.hold, self.held = hold, []

    def forward(self, x):
        h = torch.tanh(self.embed(x))

        def moe(h):
            weights, index = torch.softmax(self.router(h), dim=-1).topk(TOP_K, dim=-1)
            out = self.experts(h, index, weights / weights.sum(-1, keepdim=True))
            if self.hold and torch._C._current_graph_task_id() != -1:  # the recomputation, in the backward
                self.held.append(out)
            # A tensor saved after the experts (the product): the recomputation ends there.
            return h + out * self.head.weight[0]

        return self.head(torch.utils.checkpoint.checkpoint(moe, h, use_reentrant=False))


def test_a_recomputed_graph_still_referenced_is_not_another_live_graph():
    results = []
    for model in (HeldRecomputation("torch", hold=False), HeldRecomputation("torch", hold=True)):
        model.load_state_dict(_model("torch").state_dict())
        optimizer = sonar_kernels.SonarAdamW(model, **HYPER, max_grad_norm=0.5)
        for step in range(3):
            x, y = _batch(step)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert float(optimizer.state[model.experts.down_proj]["step"]) == 3
        results.append([p.detach().clone() for p in model.parameters()])
    assert len(model.held) == 3  # the recomputed graph of every step was still referenced at its update
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_step_hooks_run_once_per_step():
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # torch wraps AdamW.step once one exists
    model = _model("torch")
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER)
    calls = []
    optimizer.register_step_post_hook(lambda *args: calls.append(1))
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    assert calls == [1]


def test_expert_norm_counts_zero_for_a_step_without_expert_gradients():
    model = _model("torch")
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, max_grad_norm=0.5, clip_norm_includes_experts=True)
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    assert float(optimizer.expert_grad_norm()) > 0
    optimizer.zero_grad()
    nn.functional.mse_loss(model.head(model.embed(x)), y).backward()  # the experts get no gradient
    dense_norm = nn.utils.get_total_norm([p.grad for p in optimizer.dense_parameters() if p.grad is not None])
    optimizer.step()
    assert float(optimizer.expert_grad_norm()) == 0.0
    assert torch.equal(optimizer.last_grad_norm, dense_norm)


def test_experts_of_a_deep_copy_are_found_from_its_parameters():
    model = copy.deepcopy(_model("torch"))
    optimizer = sonar_kernels.SonarAdamW(list(model.parameters()), **HYPER)
    assert set(optimizer.state) == {model.experts.gate_up_proj, model.experts.down_proj}


def test_expert_tensors_replaced_in_param_groups_by_other_tensors_are_refused():
    # What DeepSpeed's ZeRO does (tests/test_deepspeed.py): one flat tensor of all parameters in the group.
    model = _model("torch")
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    flat = nn.Parameter(torch.cat([p.detach().flatten() for p in model.parameters()]))
    optimizer.param_groups[0]["params"] = [flat]
    x, _ = _batch(0)
    with pytest.raises(
        RuntimeError, match=r"2 expert tensor\(s\) in this optimizer.s param_groups were replaced"
    ):
        model(x)
    flat.grad = torch.ones_like(flat)
    with pytest.raises(
        RuntimeError, match=r"2 expert tensor\(s\) in this optimizer.s param_groups were replaced"
    ):
        optimizer.step()
    assert torch.equal(flat, torch.cat([p.flatten() for p in before.values()]))
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_a_refused_optimizer_of_another_model_does_not_stop_this_one():
    # An optimizer left refused and alive (a notebook's variable, a traceback's frame) raises at its own
    # model's forwards and step(), never at another model's, which trains as it does without it.
    def train(model):
        optimizer = sonar_kernels.SonarAdamW(model, **HYPER)
        for step in range(3):
            x, y = _batch(step)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return model

    alone = train(_model("torch"))
    refused_model = _model("torch", seed=1)
    refused = sonar_kernels.SonarAdamW(refused_model, **HYPER)
    refused.param_groups[0]["params"] = [nn.Parameter(torch.zeros(3))]
    x, _ = _batch(0)
    with pytest.raises(RuntimeError, match=r"param_groups were replaced"):
        refused_model(x)
    trained = train(_model("torch"))
    for (name, p), q in zip(trained.named_parameters(), alone.parameters(), strict=True):
        assert torch.equal(p, q), name
    with pytest.raises(RuntimeError, match=r"param_groups were replaced"):
        refused_model(x)
    with pytest.raises(RuntimeError, match=r"param_groups were replaced"):
        refused.step()


def test_expert_tensors_that_leave_param_groups_after_an_update_are_refused():
    model = _model("torch")
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER)
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    experts = optimizer.expert_tensors
    state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in experts}
    # New expert tensors in their places (as accelerate's prepare puts FSDP2's shards there); tensors that are
    # not experts would be ZeRO's flat partitions, refused naming DeepSpeed (test_deepspeed.py).
    replacements = [nn.Parameter(p.detach().clone()) for p in experts]
    mark_expert_tensors(*replacements)
    optimizer.param_groups[0]["params"] = [
        replacements[[id(q) for q in experts].index(id(p))] if any(p is q for q in experts) else p
        for p in optimizer.param_groups[0]["params"]
    ]
    with pytest.raises(RuntimeError, match="after an update or a micro-batch"):
        model(x)
    # Nothing changed: the old tensors keep their state and their update.
    assert all(torch.equal(optimizer.state[p][k], v) for p in experts for k, v in state[id(p)].items())
    assert all(p in optimizer.managed.tensors for p in experts)


@pytest.mark.parametrize(
    ("options", "error"),
    [({"lr": -1.0}, ValueError), ({"amsgrad": True}, ValueError), ({"betas": (0.9, 1.5)}, ValueError)],
)
def test_a_refused_construction_leaves_the_module_as_it_was(options, error):
    # Building SonarAdamW on a module puts its experts on DDP's ignore list; a construction refused for a bad
    # argument must not: a DDP wrapping the module afterwards (with another optimizer) would skip them.
    model = _model("torch")
    with pytest.raises(error):
        sonar_kernels.SonarAdamW(model, **{**HYPER, **options})
    assert getattr(model, "_ddp_params_and_buffers_to_ignore", None) is None
    sonar_kernels.SonarAdamW(model, **HYPER)
    ignored = model._ddp_params_and_buffers_to_ignore
    assert set(ignored) == {name for name, _ in model.named_parameters() if name.startswith("experts.")}
