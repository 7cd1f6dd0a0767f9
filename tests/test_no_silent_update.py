"""An expert tensor is updated only by a backward that computes its gradient, and a misuse raises the
library's own error before anything changes (both backends). Expected dX from the float64 reference
(plain torch autograd over sonar_kernels.reference)."""

import functools

import pytest
import torch
from numerics import rel_err

import sonar_kernels
from sonar_kernels import reference

E, H, I, T, TOP_K = 4, 16, 8, 8, 2
BACKENDS = ["torch", "triton"]


def _setup(backend):
    torch.manual_seed(0)
    experts = sonar_kernels.SonarExperts(E, H, I, backend=backend)
    optimizer = sonar_kernels.ExpertAdamW(experts.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(T, H, requires_grad=True)
    index, weights = torch.randint(0, E, (T, TOP_K)), torch.rand(T, TOP_K)
    return experts, optimizer, x, index, weights


def _snapshot(experts, optimizer):
    return [t.detach().clone() for p in experts.parameters() for t in (p, *optimizer.state[p].values())]


def _float64_grads(experts, x, index, weights):
    """(dX, d gate_up_proj, d down_proj) of the tests' loss as plain torch autograd gives them in float64
    over reference.moe_mlp."""
    x64 = x.detach().double().requires_grad_()
    w64 = [p.detach().double().requires_grad_() for p in experts.parameters()]
    loss = reference.moe_mlp(x64, index, weights.double(), *w64).square().sum()
    return torch.autograd.grad(loss, [x64, *w64])


def _assert_untouched(experts, optimizer, before):
    after = _snapshot(experts, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert all(p.grad is None for p in experts.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ["autograd.grad", "Tensor.backward(inputs=)", "autograd.backward(inputs=)"])
def test_a_backward_that_does_not_ask_for_the_weights_leaves_them_and_their_state(backend, entry):
    experts, optimizer, x, index, weights = _setup(backend)
    before = _snapshot(experts, optimizer)
    loss = experts(x, index, weights).square().sum()
    if entry == "autograd.grad":
        (grad_x,) = torch.autograd.grad(loss, x)
    elif entry == "Tensor.backward(inputs=)":
        loss.backward(inputs=[x])
        grad_x = x.grad
    else:
        torch.autograd.backward([loss], inputs=[x])
        grad_x = x.grad
    _assert_untouched(experts, optimizer, before)
    assert rel_err(grad_x, _float64_grads(experts, x, index, weights)[0]) <= 1e-5
    # A backward that asks for them updates them, once.
    experts(x, index, weights).square().sum().backward()
    assert all(float(optimizer.state[p]["step"]) == 1 for p in experts.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd_grad_of_the_weights_returns_their_gradients_and_updates_nothing(backend):
    # torch.autograd.grad accumulates nothing: the weights' gradients go to the caller, as plain torch
    # autograd gives them (float64 reference), and no optimizer sees them.
    experts, optimizer, x, index, weights = _setup(backend)
    before = _snapshot(experts, optimizer)
    grads = torch.autograd.grad(experts(x, index, weights).square().sum(), [x, *experts.parameters()])
    _assert_untouched(experts, optimizer, before)
    for actual, reference_grad in zip(grads, _float64_grads(experts, x, index, weights), strict=True):
        assert rel_err(actual, reference_grad) <= 1e-5


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("autograd.grad", "does not compute the gradient of"),
        ("Tensor.backward(inputs=)", "does not compute the gradient of"),
        ("autograd.grad with the weights", "returns to its caller the gradient of"),
    ],
)
def test_a_compiled_backward_that_does_not_accumulate_the_weights_is_refused_before_anything(
    compiler, entry, message
):
    # Under torch.compile the update runs inside the compiled backward, which cannot leave it out: refused
    # before any update, then a backward that accumulates the weights' gradients updates them once.
    experts, optimizer, x, index, weights = _setup("torch")
    compiled = torch.compile(experts, backend=compiler, fullgraph=True)
    before = _snapshot(experts, optimizer)
    loss = compiled(x, index, weights).square().sum()
    with pytest.raises(RuntimeError, match=message):
        if entry == "autograd.grad":
            torch.autograd.grad(loss, x)
        elif entry == "autograd.grad with the weights":
            torch.autograd.grad(loss, [x, *experts.parameters()])
        else:
            loss.backward(inputs=[x])
    _assert_untouched(experts, optimizer, before)
    x.grad = None
    compiled(x, index, weights).square().sum().backward()
    assert all(float(optimizer.state[p]["step"]) == 1 for p in experts.parameters())


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = sonar_kernels.SonarExperts(E, H, I, backend="torch")
        self.second = sonar_kernels.SonarExperts(E, H, I, backend="torch")

    def forward(self, x, index, weights):
        return self.second(self.first(x, index, weights), index, weights)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_compiled_backward_that_asks_for_one_layers_weights_only_is_refused_before_any_update(compiler):
    # The second layer's backward runs first and its weights are asked for; the first layer's are not:
    # refused at the first check, before the second layer's update.
    torch.manual_seed(0)
    model = _TwoLayers()
    optimizer = sonar_kernels.ExpertAdamW(model.parameters(), lr=1e-2)
    x, index, weights = (
        torch.randn(T, H, requires_grad=True),
        torch.randint(0, E, (T, TOP_K)),
        torch.rand(T, TOP_K),
    )
    compiled = torch.compile(model, backend=compiler, fullgraph=True)
    before = _snapshot(model, optimizer)
    loss = compiled(x, index, weights).square().sum()
    with pytest.raises(RuntimeError, match="does not compute the gradient of"):
        loss.backward(inputs=[x, *model.second.parameters()])
    _assert_untouched(model, optimizer, before)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_another_use_of_a_weight_inside_a_compiled_graph_is_refused_at_compile_time(compiler):
    # The update inside a compiled backward cannot wait for the penalty's part: refused while torch.compile
    # traces the backward, before anything runs.
    experts, optimizer, x, index, weights = _setup("torch")

    def loss_of(x):
        return OTHER_USES["penalty after the MLP"](lambda: experts(x, index, weights), *experts.parameters())

    before = _snapshot(experts, optimizer)
    with pytest.raises(RuntimeError, match="another use of this expert tensor in the compiled graph"):
        torch.compile(loss_of, backend=compiler, fullgraph=True)(x).backward()
    _assert_untouched(experts, optimizer, before)


@pytest.mark.parametrize("what", ["a penalty outside the compiled graph", "a second backward before step()"])
def test_a_compiled_update_is_recorded_so_a_second_one_raises_and_never_applies_twice(what):
    # Outside the compiled graph the penalty's part arrives after the compiled update (a documented limit):
    # it raises the library's error instead of applying a second AdamW step from the penalty alone.
    # A second compiled backward before step() is refused before its update.
    experts, optimizer, x, index, weights = _setup("torch")
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
    if what == "a second backward before step()":
        compiled(x, index, weights).square().sum().backward()
        before = _snapshot(experts, optimizer)
        with pytest.raises(RuntimeError, match="already updated in a backward"):
            compiled(x, index, weights).square().sum().backward()
        assert all(torch.equal(a, b) for a, b in zip(_snapshot(experts, optimizer), before, strict=True))
    else:
        with pytest.raises(RuntimeError, match="received a gradient from outside the expert MLP"):
            forward = functools.partial(compiled, x, index, weights)
            OTHER_USES["penalty after the MLP"](forward, *experts.parameters()).backward()
    assert all(float(optimizer.state[p]["step"]) == 1 for p in experts.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("step_between", [False, True])
def test_a_second_backward_of_one_graph_raises_the_librarys_error_and_changes_nothing(backend, step_between):
    experts, optimizer, x, index, weights = _setup(backend)
    loss = experts(x, index, weights).square().sum()
    loss.backward(retain_graph=True)
    if step_between:
        optimizer.step()
    before = _snapshot(experts, optimizer)
    with pytest.raises(RuntimeError, match="changed after the forward of this graph"):
        loss.backward()
    _assert_untouched(experts, optimizer, before)
    x.grad = None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hyperparameter_set_between_forward_and_backward_is_the_one_the_update_uses(backend):
    # The backward reads the group when it runs (as step() reads it for dense parameters): the update is
    # the one of the value set before the forward. (Set between the backward and step(), step() refuses
    # it: tests/test_hyperparameters_and_checkpoints.py.)
    updated = []
    for set_after_forward in (True, False):
        experts, optimizer, x, index, weights = _setup(backend)
        if not set_after_forward:
            optimizer.param_groups[0]["lr"] = 5e-3
        loss = experts(x, index, weights).square().sum()
        optimizer.param_groups[0]["lr"] = 5e-3
        loss.backward()
        updated.append(_snapshot(experts, optimizer))
    assert all(torch.equal(a, b) for a, b in zip(*updated, strict=True))


# Kind 2: every option of a torch.optim.AdamW parameter group is honoured for the expert tensors or refused.
REFUSED = [("maximize", True), ("amsgrad", True), ("capturable", True), ("differentiable", True),
           ("decoupled_weight_decay", False)]  # fmt: skip


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(H, H)
        self.experts = sonar_kernels.SonarExperts(E, H, I, backend="torch")

    def forward(self, x, index, weights):
        return self.experts(self.proj(x), index, weights)


def _groups(model, **options):
    return [
        {"params": list(model.experts.parameters()), **options},
        {"params": list(model.proj.parameters())},
    ]


@pytest.mark.parametrize(("option", "value"), REFUSED)
@pytest.mark.parametrize("how", ["SonarAdamW", "ExpertAdamW", "add_param_group", "set later"])
def test_an_adamw_option_the_update_does_not_implement_is_refused_before_anything(option, value, how):
    torch.manual_seed(0)
    model = _Model()
    experts = list(model.experts.parameters())
    match = f"{option}={value}"
    if how == "SonarAdamW":
        with pytest.raises(ValueError, match=match):
            sonar_kernels.SonarAdamW(_groups(model, **{option: value}), lr=1e-2)
    elif how == "ExpertAdamW":
        with pytest.raises(ValueError, match=match):
            sonar_kernels.ExpertAdamW([{"params": experts, option: value}], lr=1e-2)
    elif how == "add_param_group":
        optimizer = sonar_kernels.SonarAdamW(model.proj.parameters(), lr=1e-2)
        with pytest.raises(ValueError, match=match):
            optimizer.add_param_group({"params": experts, option: value})
        assert len(optimizer.param_groups) == 1
    else:
        # param_groups hold plain dicts (torch.compile traces no other): refused where it would be used.
        optimizer = sonar_kernels.SonarAdamW(_groups(model), lr=1e-2)
        optimizer.param_groups[0][option] = value
        before = [p.detach().clone() for p in experts]
        x, index = torch.randn(T, H), torch.randint(0, E, (T, TOP_K))
        with pytest.raises(ValueError, match=match):
            model(x, index, torch.rand(T, TOP_K)).square().sum().backward()
        assert all(torch.equal(p, b) for p, b in zip(experts, before, strict=True))
        with pytest.raises(ValueError, match=match):
            optimizer.step()
        return
    assert not any(hasattr(p, "sonar_update") for p in experts)  # nothing attached, nothing to update


def _train_one_step(model, optimizer):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=generator)
    index = torch.randint(0, E, (T, TOP_K), generator=generator)
    model(x, index, torch.rand(T, TOP_K, generator=generator)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize(
    "group",
    [{"lr": torch.tensor(1e-2)}, {"foreach": True}, {"foreach": False}, {"dense_maximize": True}],
    ids=["lr-tensor", "foreach", "for-loop", "maximize-on-dense-only"],
)
def test_the_options_it_accepts_give_torch_adamws_update(group):
    group = dict(group)
    dense_options = {"maximize": group.pop("dense_maximize")} if "dense_maximize" in group else {}
    models = []
    for kind in ("sonar", "torch"):
        torch.manual_seed(0)
        model = _Model()
        groups = [
            {"params": list(model.experts.parameters()), **group},
            {"params": list(model.proj.parameters()), **dense_options},
        ]
        if kind == "torch":
            # What SonarAdamW runs each group with: a group's own foreach or fused, else torch's fused
            # AdamW (SonarAdamW's default flags, on the CPU as on CUDA).
            groups = [g if {"foreach", "fused"} & g.keys() else {**g, "fused": True} for g in groups]
        optimizer = (sonar_kernels.SonarAdamW if kind == "sonar" else torch.optim.AdamW)(groups, lr=3e-3)
        _train_one_step(model, optimizer)
        models.append(model)
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        # A tensor lr reaches torch's AdamW as the tensor (torch's arithmetic for tensor values).
        assert torch.equal(p, q)


def test_a_model_whose_experts_do_not_dispatch_through_the_interface_is_named():
    # transformers 5.24's JetMoe accepts experts_implementation "sonar" and never calls it.
    import transformers

    from sonar_kernels.integrations import transformers as sonar_transformers

    sonar_transformers.register()
    config = transformers.JetMoeConfig(
        hidden_size=32, num_hidden_layers=1, vocab_size=64, num_local_experts=4, num_experts_per_tok=2,
        kv_channels=8, intermediate_size=16, num_key_value_heads=4,
    )  # fmt: skip
    config._experts_implementation = "sonar"
    model = transformers.JetMoeForCausalLM(config)
    with pytest.warns(UserWarning, match=r"none of its modules dispatches.*mlp\.input_linear\.weight"):
        optimizer = sonar_kernels.SonarAdamW(model)
    assert optimizer.expert_tensors == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loss_scaled_by_grad_scaler_is_refused_before_any_update(backend):
    experts, optimizer, x, index, weights = _setup(backend)
    before = _snapshot(experts, optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with pytest.raises(RuntimeError, match=r"scaled by torch\.amp\.GradScaler.*Nothing was updated"):
        scaler.scale(experts(x, index, weights).square().sum()).backward()
    _assert_untouched(experts, optimizer, before)
    # A disabled scaler, and plain backward passes afterwards, train as usual: one update each.
    x.grad = None
    torch.amp.GradScaler("cpu", enabled=False).scale(experts(x, index, weights).square().sum()).backward()
    optimizer.step()
    experts(x, index, weights).square().sum().backward()
    assert all(float(optimizer.state[p]["step"]) == 2 for p in experts.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_double_backward_is_refused_before_anything_changes(backend):
    experts, optimizer, x, index, weights = _setup(backend)
    before = _snapshot(experts, optimizer)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(experts(x, index, weights).square().sum(), x, create_graph=True)
    _assert_untouched(experts, optimizer, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_changed_in_place_after_the_forward_are_refused_by_name(backend):
    experts, optimizer, x, index, weights = _setup(backend)
    loss = experts(x, index, weights).square().sum()
    with torch.no_grad():
        experts.down_proj.mul_(0.5)
    before = _snapshot(experts, optimizer)
    with pytest.raises(RuntimeError, match="changed after the forward of this graph"):
        loss.backward()
    _assert_untouched(experts, optimizer, before)


# The update uses the tensor's complete gradient: parts given by other uses of the tensor in the same
# backward (a penalty on the weights, a second use) are added, whichever order the engine runs them in.
# Expected: torch.optim.AdamW on an equal fp32 model (reference.moe_mlp, plain torch autograd).
def _penalty(w1, w2):
    return 0.1 * (w1.square().sum() + w2.square().sum())


# Each: the loss of (forward, w1, w2), forward() giving the MLP's output. A penalty created before the
# MLP's forward runs its backward after the MLP's (the engine runs later nodes first), one created after
# it runs before.
OTHER_USES = {
    "penalty after the MLP": lambda forward, w1, w2: forward().square().sum() + _penalty(w1, w2),
    "penalty before the MLP": lambda forward, w1, w2: _penalty(w1, w2) + forward().square().sum(),
    "a second use of one weight": lambda forward, w1, w2: (
        forward().square().sum() + (w2[1] @ torch.ones(I, dtype=w2.dtype)).sin().sum()
    ),
    "none": lambda forward, w1, w2: forward().square().sum(),
}


def _assert_weights_alike(actual, expected):
    for a, b in zip(actual, expected, strict=True):
        assert rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use", list(OTHER_USES))
@pytest.mark.parametrize("accumulation_steps", [1, 2])
@pytest.mark.parametrize("checkpointing", ["none", "reentrant"])
def test_the_update_uses_the_complete_gradient_of_every_use_of_the_tensor(
    backend, use, accumulation_steps, checkpointing
):
    # Reentrant activation checkpointing runs the MLP's backward nested in the outer one, which delivers
    # the other uses' parts before it (penalty after) or after it (penalty before).
    torch.manual_seed(0)
    experts = sonar_kernels.SonarExperts(E, H, I, backend=backend)
    optimizer = sonar_kernels.ExpertAdamW(
        experts.parameters(), lr=1e-2, weight_decay=0.1, accumulation_steps=accumulation_steps
    )
    plain = [p.detach().clone().requires_grad_() for p in experts.parameters()]
    standard = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1)
    loss_of = OTHER_USES[use]
    for step in range(2):
        for _ in range(accumulation_steps):
            x, index, weights = torch.randn(T, H), torch.randint(0, E, (T, TOP_K)), torch.rand(T, TOP_K)
            if checkpointing == "none":
                forward = functools.partial(experts, x, index, weights)
            else:
                x.requires_grad_()  # reentrant checkpointing records a graph when an input requires grad
                region = functools.partial(experts, top_k_index=index, top_k_weights=weights)
                forward = functools.partial(torch.utils.checkpoint.checkpoint, region, x, use_reentrant=True)
            loss_of(forward, *experts.parameters()).backward()
            loss_of(functools.partial(reference.moe_mlp, x, index, weights, *plain), *plain).backward()
        assert all(p.grad is None for p in experts.parameters())
        optimizer.step()
        standard.step()
        standard.zero_grad()
        _assert_weights_alike(experts.parameters(), plain)
        for p, q in zip(experts.parameters(), plain, strict=True):
            assert float(optimizer.state[p]["step"]) == step + 1
            assert rel_err(optimizer.state[p]["exp_avg"], standard.state[q]["exp_avg"]) <= 1e-6
            assert rel_err(optimizer.state[p]["exp_avg_sq"], standard.state[q]["exp_avg_sq"]) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use", ["penalty before the MLP", "a second use of one weight"])
def test_plain_gradients_with_another_use_of_a_weight_equal_torch_autograds(backend, use):
    # No in-backward optimizer: ordinary gradients. The MLP's backward writes no weight, so a node of the
    # other use that saved the weight and runs after it still finds the version it saved.
    torch.manual_seed(0)
    experts = sonar_kernels.SonarExperts(E, H, I, backend=backend)
    plain = [p.detach().double().requires_grad_() for p in experts.parameters()]
    x, index, weights = torch.randn(T, H), torch.randint(0, E, (T, TOP_K)), torch.rand(T, TOP_K)
    OTHER_USES[use](functools.partial(experts, x, index, weights), *experts.parameters()).backward()
    forward64 = functools.partial(reference.moe_mlp, x.double(), index, weights.double(), *plain)
    OTHER_USES[use](forward64, *plain).backward()
    for p, q in zip(experts.parameters(), plain, strict=True):
        assert rel_err(p.grad, q.grad) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use", ["penalty after the MLP", "penalty before the MLP"])
def test_weights_passed_as_views_get_the_complete_gradient_through_autograd(backend, use):
    # The MLP sees views (non-leaf tensors, no update attached): it gives them ordinary gradients, which
    # autograd sums with the penalty's at the parameters; the owner's hook then applies the update.
    torch.manual_seed(0)
    experts = sonar_kernels.SonarExperts(E, H, I, backend=backend)
    optimizer = sonar_kernels.ExpertAdamW(experts.parameters(), lr=1e-2, weight_decay=0.1)
    plain = [p.detach().clone().requires_grad_() for p in experts.parameters()]
    standard = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        x, index, weights = torch.randn(T, H), torch.randint(0, E, (T, TOP_K)), torch.rand(T, TOP_K)
        views = [p.view_as(p) for p in experts.parameters()]
        forward = functools.partial(sonar_kernels.moe_mlp, x, index, weights, *views, backend=backend)
        OTHER_USES[use](forward, *experts.parameters()).backward()
        OTHER_USES[use](functools.partial(reference.moe_mlp, x, index, weights, *plain), *plain).backward()
        optimizer.step()
        standard.step()
        standard.zero_grad()
    _assert_weights_alike(experts.parameters(), plain)
    assert all(float(optimizer.state[p]["step"]) == 2 and p.grad is None for p in experts.parameters())


@pytest.mark.parametrize("use", ["penalty after the MLP", "penalty before the MLP"])
@pytest.mark.parametrize("checkpointing", ["none", "reentrant"])
def test_a_penalty_reaches_the_gradient_buffer_of_a_micro_batch(use, checkpointing):
    # bf16 weights with fp32 micro-batch buffers (grad_dtype): the Triton backward adds each micro-batch's
    # gradient to the buffer, and the penalty's part is added there too (with reentrant checkpointing it
    # may arrive in the outer backward, before or after the MLP's). The update's gradient norm is the
    # norm of the whole gradient as plain torch autograd gives it (fp32 over the same bf16 weights).
    torch.manual_seed(0)
    experts = sonar_kernels.SonarExperts(E, H, I, dtype=torch.bfloat16, backend="triton")
    optimizer = sonar_kernels.ExpertAdamW(
        experts.parameters(), lr=1e-2, accumulation_steps=2, grad_dtype=torch.float32
    )
    plain = [p.detach().float().requires_grad_() for p in experts.parameters()]
    loss_of = OTHER_USES[use]
    for _ in range(2):
        x, index, weights = torch.randn(T, H), torch.randint(0, E, (T, TOP_K)), torch.rand(T, TOP_K)
        region = functools.partial(experts, top_k_index=index, top_k_weights=weights.bfloat16())
        x16 = x.bfloat16().requires_grad_(checkpointing == "reentrant")
        if checkpointing == "none":
            forward = functools.partial(region, x16)
        else:
            forward = functools.partial(torch.utils.checkpoint.checkpoint, region, x16, use_reentrant=True)
        loss_of(lambda forward=forward: forward().float(), *experts.parameters()).backward()
        forward = functools.partial(
            reference.moe_mlp, x.bfloat16().float(), index, weights.bfloat16().float(), *plain
        )
        loss_of(forward, *plain).backward()
    expected = torch.cat([q.grad.flatten() for q in plain]).norm()
    assert abs(float(optimizer.expert_grad_norm()) - float(expected)) <= 4 * 2.0**-8 * float(expected)
    assert all(float(optimizer.state[p]["step"]) == 1 for p in experts.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change", ["load_state_dict", "a new optimizer"])
def test_an_update_replaced_between_forward_and_backward_is_refused_before_anything(backend, change):
    # The forward recorded the optimizer state it would update; after load_state_dict() (new state
    # tensors) or a new optimizer over the tensors (the newest owns them) that state is not the owner's.
    experts, optimizer, x, index, weights = _setup(backend)
    experts(x, index, weights).square().sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    loss = experts(x, index, weights).square().sum()
    if change == "load_state_dict":
        optimizer.load_state_dict(saved)
        owner = optimizer
    else:
        owner = sonar_kernels.ExpertAdamW(experts.parameters(), lr=1e-2)
    before = _snapshot(experts, optimizer) + _snapshot(experts, owner)
    with pytest.raises(RuntimeError, match="changed between this graph's forward and its backward"):
        loss.backward()
    after = _snapshot(experts, optimizer) + _snapshot(experts, owner)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    # A new forward updates through the current owner.
    x.grad = None
    experts(x, index, weights).square().sum().backward()
    assert all(
        float(owner.state[p]["step"]) == (2 if owner is optimizer else 1) for p in experts.parameters()
    )


# Misuse paths found by trying the library as a new user would (each failed on the code before its fix).


@pytest.mark.parametrize("backend", BACKENDS)
def test_saved_tensor_hooks_that_return_copies_still_update_the_parameters(backend):
    # torch.autograd.graph.save_on_cpu gives back copies on CUDA: the update must write the parameters
    # and their state, not the copies. Two steps against torch.optim.AdamW on an equal plain model.
    experts, optimizer, *_ = _setup(backend)
    plain = [p.detach().clone().requires_grad_() for p in experts.parameters()]
    standard = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        x, index, weights = torch.randn(T, H), torch.randint(0, E, (T, TOP_K)), torch.rand(T, TOP_K)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            experts(x, index, weights).square().sum().backward()
        reference.moe_mlp(x, index, weights, *plain).square().sum().backward()
        optimizer.step()
        standard.step()
        standard.zero_grad()
    _assert_weights_alike(experts.parameters(), plain)
    for p, q in zip(experts.parameters(), plain, strict=True):
        assert float(optimizer.state[p]["step"]) == 2
        assert rel_err(optimizer.state[p]["exp_avg"], standard.state[q]["exp_avg"]) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_users_gradient_hook_on_an_expert_tensor_is_refused_before_anything(backend, hook):
    # The gradient never reaches a tensor the hook could see or change.
    experts, optimizer, x, index, weights = _setup(backend)
    getattr(experts.gate_up_proj, hook)(lambda t: None)
    before = _snapshot(experts, optimizer)
    with pytest.raises(RuntimeError, match="has a gradient hook of its own"):
        experts(x, index, weights).square().sum().backward()
    _assert_untouched(experts, optimizer, before)


@pytest.mark.parametrize("change", ["lr set", "scheduler step", "load_state_dict"])
def test_a_change_between_backward_and_step_that_the_update_already_missed_is_refused(change):
    # torch reads lr and the state at step(); the in-backward update ran before. A new value is refused by
    # step() (the set itself is a plain dict's), the state by load_state_dict(), before anything changes.
    experts, optimizer, x, index, weights = _setup("torch")
    saved = optimizer.state_dict()
    experts(x, index, weights).square().sum().backward()
    before = _snapshot(experts, optimizer)
    with pytest.raises(RuntimeError, match="before step"):
        if change == "lr set":
            optimizer.param_groups[0]["lr"] = 5e-3
            optimizer.step()
        elif change == "scheduler step":
            torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5).step()
            optimizer.step()
        else:
            optimizer.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(experts, optimizer), before, strict=True))
    optimizer.param_groups[0]["lr"] = 1e-2  # set back: the step ends
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 5e-3  # after step(): taken by the next update


@pytest.mark.parametrize("backend", BACKENDS)
def test_requires_grad_turned_off_between_forward_and_backward_updates_nothing(backend):
    # torch accumulates nothing into a leaf that no longer requires grad.
    experts, optimizer, x, index, weights = _setup(backend)
    out = experts(x, index, weights).square().sum()
    experts.down_proj.requires_grad_(False)
    down_before = experts.down_proj.detach().clone()
    out.backward()
    assert torch.equal(experts.down_proj, down_before)
    assert float(optimizer.state[experts.down_proj]["step"]) == 0
    assert float(optimizer.state[experts.gate_up_proj]["step"]) == 1


def test_copying_or_pickling_the_optimizer_raises_a_clear_type_error():
    import copy
    import pickle

    _, optimizer, *_ = _setup("torch")
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(optimizer)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(optimizer)
    copy.deepcopy(optimizer.state_dict())  # the supported way


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_are_refused_in_the_librarys_words(transform):
    experts, _, x, index, weights = _setup("torch")
    with pytest.raises(RuntimeError, match=r"does not support torch\.func transforms"):
        if transform == "grad":
            torch.func.grad(lambda x: experts(x, index, weights).sum())(x.detach())
        else:
            torch.func.vmap(lambda x: experts(x, index, weights))(x.detach()[None])
