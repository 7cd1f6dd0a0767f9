"""SonarAdamW as a drop-in torch.optim.AdamW (issue 28, items 8 to 12): torch's arguments in torch's order,
torch's options honoured for groups without expert tensors (refused by name for groups with them), any
state torch.optim.AdamW loads, GradScaler's ``found_inf`` / ``grad_scale`` as torch's fused AdamW takes
them, torch's exception types for bad settings, and tensor hyperparameters with torch's arithmetic.
torch.optim.AdamW is the reference throughout."""

import copy
import inspect

import pytest
import torch
from numerics import rel_err

import sonar_kernels

E, H, I = 4, 16, 8
BACKENDS = ["torch", "triton"]
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# The options torch.optim.AdamW has that the in-backward update does not implement, with a value that
# turns each on.
EXPERT_REFUSED = {"amsgrad": True, "maximize": True, "capturable": True, "differentiable": True}
# What SonarAdamW's default flags (foreach=None, fused=None) run on the CPU: torch's fused AdamW.
FUSED = {"fused": True}


def _torch_flags(options):
    """torch.optim.AdamW's flags for SonarAdamW(**options): the options' own, else fused (the default)."""
    return {} if {"foreach", "fused", "capturable", "differentiable"} & options.keys() else FUSED


class Tiny(torch.nn.Module):
    """A router, SonarExperts and a dense head."""

    def __init__(self, seed=0, backend="torch"):
        super().__init__()
        torch.manual_seed(seed)
        self.router = torch.nn.Linear(H, E)
        self.experts = sonar_kernels.SonarExperts(E, H, I, backend=backend)
        self.head = torch.nn.Linear(H, H)

    def forward(self, x):
        weights, index = torch.softmax(self.router(x), -1).topk(2, dim=-1)
        return self.head(self.experts(x, index, weights))


class Dense(torch.nn.Module):
    """No expert tensor: what code that takes "an AdamW" trains."""

    def __init__(self, seed=0, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(H, H, dtype=dtype)
        self.out = torch.nn.Linear(H, 4, dtype=dtype)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


def _batch(step, dtype=torch.float32):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, H, generator=generator).to(dtype)


def _train(model, optimizer, steps=3, start=0, device="cpu"):
    for step in range(start, start + steps):
        model(_batch(step).to(device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _groups(model, expert_options=None, dense_options=None):
    experts = list(model.experts.parameters())
    dense = [p for name, p in model.named_parameters() if not name.startswith("experts.")]
    return [{"params": experts, **(expert_options or {})}, {"params": dense, **(dense_options or {})}]


def _assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max():.3e}"


# Item 9: torch.optim.AdamW's arguments.


def test_the_signature_holds_torch_adamws_arguments_in_torchs_order():
    torch_params = list(inspect.signature(torch.optim.AdamW).parameters.values())
    sonar_params = inspect.signature(sonar_kernels.SonarAdamW).parameters
    positional = [p.name for p in torch_params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in sonar_params.values()][: len(positional)] == positional
    for p in torch_params:
        assert p.name in sonar_params, p.name
        assert sonar_params[p.name].kind is p.kind, p.name
        assert sonar_params[p.name].default == p.default, p.name


ALL_FALSE = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}


@pytest.mark.parametrize("backend", BACKENDS)
def test_torchs_keywords_set_to_their_defaults_are_accepted_with_expert_tensors(backend):
    model, reference = Tiny(backend=backend), Tiny(backend="torch")
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, **ALL_FALSE, foreach=None, fused=None)
    positional = sonar_kernels.SonarAdamW(
        Tiny(backend=backend).parameters(), 1e-2, (0.9, 0.95), 1e-8, 0.1, False
    )
    assert len(optimizer.expert_tensors) == 2 and len(positional.expert_tensors) == 2
    if backend == "torch":
        _train(model, optimizer)
        _train(reference, torch.optim.AdamW(reference.parameters(), **HYPER, **ALL_FALSE, **FUSED))
        _assert_same(model, reference)


DENSE_OPTIONS = [
    pytest.param({"amsgrad": True}, id="amsgrad"),
    pytest.param({"maximize": True}, id="maximize"),
    pytest.param({"amsgrad": True, "maximize": True, "fused": True}, id="amsgrad-maximize-fused"),
    pytest.param({"amsgrad": True, "foreach": True}, id="amsgrad-foreach"),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_named_parameters_as_torch_optim_takes_them_find_the_expert_tensors(backend, device):
    device = device if backend == "triton" else "cpu"
    model, reference = Tiny(backend=backend).to(device), Tiny(backend=backend).to(device)
    optimizer = sonar_kernels.SonarAdamW(model.named_parameters(), **HYPER)
    assert [id(p) for p in optimizer.expert_tensors] == [id(p) for p in model.experts.parameters()]
    assert optimizer.param_groups[0]["param_names"] == [name for name, _ in model.named_parameters()]
    _train(model, optimizer, device=device)
    _train(reference, sonar_kernels.SonarAdamW(reference, **HYPER), device=device)
    _assert_same(model, reference)


@pytest.mark.parametrize("options", DENSE_OPTIONS)
def test_a_dense_only_optimizer_with_torchs_options_trains_as_torch_adamw_bitwise(options):
    model, reference = Dense(), Dense()
    optimizer = sonar_kernels.SonarAdamW(model.parameters(), **HYPER, **options)
    _train(model, optimizer)
    _train(reference, torch.optim.AdamW(reference.parameters(), **HYPER, **options, **_torch_flags(options)))
    _assert_same(model, reference)


@pytest.mark.parametrize("option", ["capturable", "differentiable"])
def test_capturable_and_differentiable_meet_torchs_own_refusal_on_the_cpu(option):
    # torch.optim.AdamW takes them and its step raises on CPU leaf parameters (capturable: no CPU kernel;
    # differentiable: an in-place update of a leaf that requires grad): SonarAdamW's step raises the same.
    errors = []
    for cls in (torch.optim.AdamW, sonar_kernels.SonarAdamW):
        model = Dense()
        optimizer = cls(model.parameters(), **HYPER, **{option: True})
        model(_batch(0)).square().mean().backward()
        with pytest.raises(Exception) as raised:  # the type is torch's, whatever it is
            optimizer.step()
        errors.append((raised.type, str(raised.value)))
    assert errors[0] == errors[1]


def test_amsgrad_as_the_sixth_positional_argument_is_honoured_for_dense_parameters():
    model, reference = Dense(), Dense()
    _train(model, sonar_kernels.SonarAdamW(model.parameters(), 1e-2, (0.9, 0.95), 1e-8, 0.1, True))
    _train(reference, torch.optim.AdamW(reference.parameters(), 1e-2, (0.9, 0.95), 1e-8, 0.1, True, **FUSED))
    _assert_same(model, reference)


@pytest.mark.parametrize("options", DENSE_OPTIONS)
def test_constructor_options_reach_the_dense_group_while_the_expert_group_sets_them_off(options):
    # The expert group turns each refused option off in its own dict; the dense group takes the constructor's.
    model, reference = Tiny(), Tiny()
    expert_off = {key: False for key in options if key in EXPERT_REFUSED}
    groups = _groups(model, expert_options=expert_off)
    optimizer = sonar_kernels.SonarAdamW(groups, **HYPER, **options)
    assert len(optimizer.expert_tensors) == 2
    _train(model, optimizer)
    groups = _groups(reference, expert_options=expert_off)
    _train(reference, torch.optim.AdamW(groups, **HYPER, **options, **_torch_flags(options)))
    _assert_same(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("option", "value", "how"),
    # amsgrad is torch.optim.AdamW's only positional option.
    [
        *((option, value, "keyword") for option, value in EXPERT_REFUSED.items()),
        ("amsgrad", True, "positional"),
    ],
)
def test_an_option_set_in_the_constructor_is_refused_by_name_for_the_expert_group(
    backend, option, value, how
):
    model = Tiny(backend=backend)
    with pytest.raises(ValueError, match=f"{option}={value}"):
        if how == "positional":
            sonar_kernels.SonarAdamW(model, 1e-2, (0.9, 0.95), 1e-8, 0.1, value)
        else:
            sonar_kernels.SonarAdamW(model, **HYPER, **{option: value})
    assert all(sonar_kernels.optim.expert_optimizer(p) is None for p in model.experts.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_constructor_option_is_refused_for_an_expert_group_added_later(backend):
    model = Tiny(backend=backend)
    dense = [p for name, p in model.named_parameters() if not name.startswith("experts.")]
    optimizer = sonar_kernels.SonarAdamW(dense, **HYPER, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        optimizer.add_param_group({"params": list(model.experts.parameters())})
    assert len(optimizer.param_groups) == 1
    optimizer.add_param_group({"params": list(model.experts.parameters()), "amsgrad": False})
    assert len(optimizer.expert_tensors) == 2


# Item 10: load_state_dict of what torch.optim.AdamW loads.


def _dense_state(kind, model):
    """A state_dict of the dense-only ``model`` after 2 steps: torch.optim.AdamW(amsgrad=True),
    torch.optim.Adam, or SonarAdamW's own with amsgrad and maximize in its group."""
    if kind == "torch-amsgrad":
        optimizer = torch.optim.AdamW(model.parameters(), **HYPER, amsgrad=True)
    elif kind == "torch-adam":
        optimizer = torch.optim.Adam(model.parameters(), **HYPER)
    else:
        group = {"params": list(model.parameters()), "amsgrad": True, "maximize": True}
        optimizer = sonar_kernels.SonarAdamW([group], **HYPER)
    _train(model, optimizer, 2)
    return optimizer.state_dict()


def _run_fused(standard):
    """torch.optim.AdamW takes foreach and fused from the loaded groups (None here: its own default, the
    for-loop on the CPU); SonarAdamW runs None as fused: set it for the reference."""
    for group in standard.param_groups:
        assert group["fused"] is None and group["foreach"] is None
        group["fused"] = True


@pytest.mark.parametrize("kind", ["torch-amsgrad", "torch-adam", "sonar-amsgrad-maximize"])
def test_a_state_whose_dense_only_groups_carry_torchs_options_loads_as_into_torch_adamw(kind):
    source = Dense()
    state = _dense_state(kind, source)
    model, reference = Dense(), Dense()
    model.load_state_dict(source.state_dict())
    reference.load_state_dict(source.state_dict())
    sonar = sonar_kernels.SonarAdamW(model.parameters(), **HYPER)
    standard = torch.optim.AdamW(reference.parameters(), **HYPER)
    # torch's load_state_dict keeps tensors of the right dtype and device: each optimizer gets its own copy.
    sonar.load_state_dict(copy.deepcopy(state))
    standard.load_state_dict(copy.deepcopy(state))
    assert sonar.state_dict()["param_groups"] == standard.state_dict()["param_groups"]
    _run_fused(standard)
    _train(model, sonar, 2, start=2)
    _train(reference, standard, 2, start=2)
    _assert_same(model, reference)


@pytest.mark.parametrize("kind", ["torch-amsgrad", "torch-adam", "sonar-amsgrad-maximize"])
def test_a_state_with_those_options_on_its_dense_group_loads_beside_an_expert_group(kind):
    # Two groups: experts (no option) and dense (the option); SonarAdamW then trains as torch.optim.AdamW.
    source = Tiny()
    if kind == "sonar-amsgrad-maximize":
        dense_options = {"amsgrad": True, "maximize": True}
        optimizer = sonar_kernels.SonarAdamW(_groups(source, dense_options=dense_options), **HYPER)
        _train(source, optimizer, 2)
        state = optimizer.state_dict()
    else:
        cls = torch.optim.AdamW if kind == "torch-amsgrad" else torch.optim.Adam
        extra = {"amsgrad": True} if kind == "torch-amsgrad" else {}
        groups = _groups(source, expert_options={"amsgrad": False, "decoupled_weight_decay": True})
        optimizer = cls(groups, **HYPER, **extra)
        _train(source, optimizer, 2)
        state = optimizer.state_dict()
    model, reference = Tiny(), Tiny()
    model.load_state_dict(source.state_dict())
    reference.load_state_dict(source.state_dict())
    sonar = sonar_kernels.SonarAdamW(_groups(model), **HYPER)
    standard = torch.optim.AdamW(_groups(reference), **HYPER)
    # torch's load_state_dict keeps tensors of the right dtype and device: each optimizer gets its own copy.
    sonar.load_state_dict(copy.deepcopy(state))
    standard.load_state_dict(copy.deepcopy(state))
    _run_fused(standard)
    _train(model, sonar, 2, start=2)
    _train(reference, standard, 2, start=2)
    _assert_same(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("option", "value"), [*EXPERT_REFUSED.items(), ("decoupled_weight_decay", False)])
def test_a_state_with_those_options_on_an_expert_group_is_refused_before_anything_changes(
    backend, option, value
):
    source = Tiny()
    state = torch.optim.AdamW(_groups(source), **HYPER).state_dict()
    state["param_groups"][0][option] = value
    model = Tiny(backend=backend)
    optimizer = sonar_kernels.SonarAdamW(_groups(model), **HYPER)
    before = optimizer.state_dict()
    with pytest.raises(ValueError, match=f"{option}={value}"):
        optimizer.load_state_dict(state)
    after = optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert optimizer.param_groups[0].get(option) != value


# Item 11: GradScaler and found_inf with fused=True.


def _scaled_training(model, optimizer, scaler, steps=4, clip=None, dtype=torch.float32):
    for step in range(steps):
        loss = model(_batch(step, dtype)).float().square().mean()
        if step == 1:
            loss = loss * float("inf")  # an overflow: the scaler skips this step and halves its scale
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


@pytest.mark.parametrize(
    ("dtype", "fused"),
    # GradScaler.unscale_ (the path of an optimizer that is not fused) refuses fp16 gradients, as for torch.
    [(torch.float32, True), (torch.float16, True), (torch.float32, False)],
    ids=["fp32-fused", "fp16-fused", "fp32-for-loop"],
)
def test_grad_scaler_trains_as_with_torchs_adamw_bitwise(dtype, fused):
    model, reference = Dense(dtype=dtype), Dense(dtype=dtype)
    sonar = sonar_kernels.SonarAdamW(model.parameters(), **HYPER, fused=fused)
    standard = torch.optim.AdamW(reference.parameters(), **HYPER, fused=fused)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    _scaled_training(model, sonar, scalers[0], dtype=dtype)
    _scaled_training(reference, standard, scalers[1], dtype=dtype)
    _assert_same(model, reference)
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**9
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert float(sonar.state[p]["step"]) == float(standard.state[q]["step"]) == 3
    assert int(sonar.dense_skipped_steps) == fused  # without fused, GradScaler does not call step()


def test_grad_scaler_with_clipping_in_step_equals_unscale_then_clip_then_torchs_fused_step():
    model, reference = Dense(), Dense()
    sonar = sonar_kernels.SonarAdamW(model.parameters(), **HYPER, fused=True, max_grad_norm=0.05)
    standard = torch.optim.AdamW(reference.parameters(), **HYPER, fused=True)
    scaler, standard_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2))
    _scaled_training(model, sonar, scaler)  # no unscale_: step() unscales before it clips
    _scaled_training(reference, standard, standard_scaler, clip=0.05)
    _assert_same(model, reference)


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_a_callers_found_inf_is_honoured_and_left_in_place(value):
    model, reference = Dense(), Dense()
    sonar = sonar_kernels.SonarAdamW(model.parameters(), **HYPER, fused=True)
    standard = torch.optim.AdamW(reference.parameters(), **HYPER, fused=True)
    for m, optimizer in ((model, sonar), (reference, standard)):
        m(_batch(0)).square().mean().backward()
        found_inf = torch.tensor(value)
        optimizer.found_inf = found_inf
        optimizer.step()
        assert optimizer.found_inf is found_inf and float(found_inf) == value
        del optimizer.found_inf
    _assert_same(model, reference)
    assert torch.equal(sonar.state[model.inp.weight]["step"], standard.state[reference.inp.weight]["step"])
    assert int(sonar.dense_skipped_steps) == int(value)


def test_a_callers_found_inf_of_zero_still_skips_a_non_finite_gradient():
    model = Dense()
    sonar = sonar_kernels.SonarAdamW(model.parameters(), **HYPER, fused=True)
    model(_batch(0)).square().mean().backward()
    model.inp.weight.grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    sonar.found_inf = torch.tensor(0.0)
    sonar.step()
    assert float(sonar.found_inf) == 0.0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert int(sonar.dense_skipped_steps) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_scaling_stays_refused_for_expert_tensors(backend, device):
    device = device if backend == "triton" else "cpu"
    model = Tiny(backend=backend).to(device)
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, fused=True)
    scaler = torch.amp.GradScaler(device)
    with pytest.raises(RuntimeError, match=r"scaled by torch\.amp\.GradScaler"):
        scaler.scale(model(_batch(0).to(device)).square().mean()).backward()
    assert all(float(optimizer.state[p]["step"]) == 0 for p in model.experts.parameters())


# Item 12: the same exception types as torch.optim.AdamW.

BAD_SETTINGS = [
    pytest.param({"lr": torch.tensor([1e-3, 1e-3])}, id="lr-two-elements"),
    pytest.param({"lr": -1.0}, id="lr-negative"),
    pytest.param({"lr": float("nan")}, id="lr-nan"),
    pytest.param({"lr": "0.1"}, id="lr-str"),
    pytest.param({"eps": -1.0}, id="eps"),
    pytest.param({"weight_decay": -1}, id="weight_decay"),
    pytest.param({"betas": (1.0, 0.0)}, id="beta1"),
    pytest.param({"betas": (0.9, 1.0)}, id="beta2"),
    pytest.param({"betas": (0.9,)}, id="betas-one"),
    pytest.param({"betas": (0.9, torch.tensor(0.99))}, id="betas-mixed"),
    pytest.param({"betas": (torch.tensor([0.9, 0.9]), torch.tensor(0.99))}, id="beta1-two-elements"),
    pytest.param({"lr": torch.tensor(1e-3), "foreach": True}, id="lr-tensor-foreach"),
    pytest.param(
        {"betas": (torch.tensor(0.9), torch.tensor(0.99)), "foreach": True}, id="betas-tensor-foreach"
    ),
    pytest.param({"fused": True, "foreach": True}, id="fused-foreach"),
    pytest.param({"fused": True, "differentiable": True}, id="fused-differentiable"),
]


@pytest.mark.parametrize("options", BAD_SETTINGS)
@pytest.mark.parametrize("params", ["dense", "model"])
def test_bad_settings_raise_torch_adamws_exception_type_and_message(options, params):
    with pytest.raises(Exception) as expected:  # the type is torch's, whatever it is
        torch.optim.AdamW(Tiny().parameters(), **options)
    model = Tiny()
    with pytest.raises(expected.type) as raised:
        sonar_kernels.SonarAdamW(model if params == "model" else Dense().parameters(), **options)
    assert str(raised.value) == str(expected.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_two_element_tensor_lr_in_an_expert_group_raises_value_error(backend):
    model = Tiny(backend=backend)
    with pytest.raises(ValueError, match="lr"):
        sonar_kernels.SonarAdamW(_groups(model, expert_options={"lr": torch.tensor([1e-3, 1e-3])}))


# Item 8: tensor hyperparameters follow torch.optim.AdamW's arithmetic.

TENSOR_HYPER = [
    pytest.param({"betas": (torch.tensor(0.9), torch.tensor(0.95))}, id="betas-fp32"),
    pytest.param({"lr": torch.tensor(1e-2)}, id="lr-fp32"),
    pytest.param({"lr": torch.tensor(1e-2), "betas": (torch.tensor(0.9), torch.tensor(0.95))}, id="all-fp32"),
    pytest.param(
        {
            "lr": torch.tensor(1e-2, dtype=torch.float64),
            "betas": tuple(torch.tensor(b, dtype=torch.float64) for b in (0.9, 0.95)),
        },
        id="all-fp64",
    ),
    pytest.param({"betas": (torch.tensor([0.9]), torch.tensor([0.95]))}, id="betas-one-element-1d"),
]


def _with(tensor_hyper):
    return {**HYPER, **tensor_hyper}


@pytest.mark.parametrize("tensor_hyper", TENSOR_HYPER)
@pytest.mark.parametrize(
    "flags", [{}, {"fused": True}, {"fused": False}], ids=["default", "fused", "for-loop"]
)
def test_tensor_hyperparameters_give_torch_adamws_bits_on_the_torch_backend(tensor_hyper, flags):
    model, reference = Tiny(), Tiny()
    _train(model, sonar_kernels.SonarAdamW(model, **_with(tensor_hyper), **flags), 5)
    torch_flags = flags or FUSED  # the default: torch's fused AdamW
    _train(reference, torch.optim.AdamW(reference.parameters(), **_with(tensor_hyper), **torch_flags), 5)
    _assert_same(model, reference)


@pytest.mark.parametrize("tensor_hyper", TENSOR_HYPER[:3])
def test_tensor_hyperparameters_of_a_gradient_reaching_grad_give_torch_adamws_bits(tensor_hyper):
    # A penalty alone: the expert tensor's gradient reaches .grad, and its hook applies torch's AdamW.
    model, reference = Tiny(), Tiny()
    optimizer = sonar_kernels.SonarAdamW(model, **_with(tensor_hyper))
    standard = torch.optim.AdamW(reference.parameters(), **_with(tensor_hyper), **FUSED)
    for m, opt in ((model, optimizer), (reference, standard)):
        for _ in range(5):
            (m.experts.gate_up_proj.square().sum() + m.experts.down_proj.sin().sum()).backward()
            opt.step()
            opt.zero_grad()
    _assert_same(model, reference)


@pytest.mark.parametrize("tensor_hyper", TENSOR_HYPER[:3])
def test_tensor_hyperparameters_on_the_triton_backend_stay_within_the_bound(tensor_hyper, device):
    model, reference = Tiny(backend="triton").to(device), Tiny()
    _train(model, sonar_kernels.SonarAdamW(model, **_with(tensor_hyper)), 5, device=device)
    _train(reference, torch.optim.AdamW(reference.parameters(), **_with(tensor_hyper)), 5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert rel_err(p.cpu(), q) <= 1e-5, name


# Issue 30: torch's fused AdamW by default, wherever torch has it for the device and dtype.

MAX_NORM = 0.05  # below the gradients' norm: the clipping changes them


def _dense_clipped_training(model, optimizer, steps=3, dtype=torch.float32, clip=True):
    """Standard training with dense-only clipping (``clip``): the reference of
    SonarAdamW(max_grad_norm=MAX_NORM), which clips in step() (``clip=False``)."""
    dense = [p for name, p in model.named_parameters() if not name.startswith("experts.")]
    norms = []
    for step in range(steps):
        model(_batch(step, dtype)).float().square().mean().backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(dense, MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_default_flags_train_as_torchs_fused_adamw_with_dense_clipping_bitwise(dtype):
    model, reference, loop = (Tiny().to(dtype) for _ in range(3))
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, max_grad_norm=MAX_NORM)
    # The groups keep torch's defaults (None: the path is chosen at each step, as torch chooses its own).
    assert optimizer.param_groups[0]["fused"] is None and optimizer.param_groups[0]["foreach"] is None
    standard = torch.optim.AdamW(reference.parameters(), **HYPER, fused=True)
    norms = _dense_clipped_training(reference, standard, dtype=dtype)
    _dense_clipped_training(model, optimizer, dtype=dtype, clip=False)
    assert max(norms) > MAX_NORM
    # Every tensor: the dense ones (step()), the expert ones (the torch backend's update in the backward,
    # fed the same gradient as torch's fused AdamW in the reference).
    _assert_same(model, reference)
    for p in model.parameters():
        assert optimizer.state[p]["step"].dtype == torch.float32 and float(optimizer.state[p]["step"]) == 3
    # The for-loop AdamW (torch's own default on the CPU) gives other bits: the comparison tells them apart.
    _dense_clipped_training(loop, torch.optim.AdamW(loop.parameters(), **HYPER, foreach=False), dtype=dtype)
    assert any(not torch.equal(p, q) for p, q in zip(loop.parameters(), reference.parameters(), strict=True))


@pytest.mark.parametrize(
    "flags",
    [{"foreach": True}, {"foreach": False}, {"fused": False}, {"fused": True}],
    ids=["foreach", "foreach-false", "fused-false", "fused"],
)
def test_explicit_flags_train_as_torch_adamw_with_those_flags_bitwise(flags):
    model, reference = Tiny(), Tiny()
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, **flags, max_grad_norm=MAX_NORM)
    _dense_clipped_training(reference, torch.optim.AdamW(reference.parameters(), **HYPER, **flags))
    _train(model, optimizer)
    _assert_same(model, reference)
    assert optimizer.param_groups[0]["foreach"] == flags.get("foreach")
    assert optimizer.param_groups[0]["fused"] == flags.get("fused")


def test_an_expert_gradient_reaching_grad_is_applied_by_torchs_fused_adamw_by_default():
    # A penalty on the expert weights alone: their gradient reaches .grad, and the hook applies torch's AdamW.
    model, reference = Tiny(), Tiny()
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER)
    standard = torch.optim.AdamW(reference.experts.parameters(), **HYPER, fused=True)
    for m, opt in ((model, optimizer), (reference, standard)):
        for _ in range(3):
            (m.experts.gate_up_proj.square().sum() + m.experts.down_proj.sin().sum()).backward()
            opt.step()
            opt.zero_grad()
    _assert_same(model, reference)


def test_meta_device_init_then_to_empty_trains_with_torchs_fused_adamw_by_default():
    with torch.device("meta"):
        model = Tiny()
    model.to_empty(device="cpu")
    model.load_state_dict(Tiny().state_dict())
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, max_grad_norm=MAX_NORM)
    reference = Tiny()
    _dense_clipped_training(reference, torch.optim.AdamW(reference.parameters(), **HYPER, fused=True))
    _train(model, optimizer)
    assert len(optimizer.expert_tensors) == 2
    _assert_same(model, reference)


def test_a_checkpoint_of_a_non_fused_adamw_resumes_with_the_step_where_the_fused_kernel_reads_it():
    # torch.optim.AdamW(fused=True) loads ``step`` as float32 on the parameter's device; SonarAdamW's default
    # groups (fused=None, run fused) do the same, whatever the checkpoint held (float64 here).
    source = Dense()
    torch_default = torch.optim.AdamW(source.parameters(), **HYPER)
    _train(source, torch_default, 2)
    state = torch_default.state_dict()
    for entry in state["state"].values():
        entry["step"] = entry["step"].double()
    model, reference = Dense(), Dense()
    model.load_state_dict(source.state_dict())
    reference.load_state_dict(source.state_dict())
    sonar = sonar_kernels.SonarAdamW(model.parameters(), **HYPER)
    standard = torch.optim.AdamW(reference.parameters(), **HYPER, fused=True)
    sonar.load_state_dict(copy.deepcopy(state))
    standard.load_state_dict(copy.deepcopy(state))
    _run_fused(standard)
    for p in model.parameters():
        assert sonar.state[p]["step"].dtype == torch.float32 and float(sonar.state[p]["step"]) == 2
    _train(model, sonar, 2, start=2)
    _train(reference, standard, 2, start=2)
    _assert_same(model, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_grad_scaler_with_default_flags_trains_as_with_torchs_fused_adamw_bitwise(dtype):
    # The default flags run torch's fused AdamW, so GradScaler hands step() its grad_scale and found_inf, as
    # it does to torch.optim.AdamW(fused=True) (fp16 gradients included, which GradScaler.unscale_ refuses).
    model, reference = Dense(dtype=dtype), Dense(dtype=dtype)
    sonar = sonar_kernels.SonarAdamW(model.parameters(), **HYPER)
    standard = torch.optim.AdamW(reference.parameters(), **HYPER, fused=True)
    assert sonar._step_supports_amp_scaling is False  # no gradient yet: nothing that step() would update
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    _scaled_training(model, sonar, scalers[0], dtype=dtype)
    _scaled_training(reference, standard, scalers[1], dtype=dtype)
    _assert_same(model, reference)
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**9
    assert int(sonar.dense_skipped_steps) == 1
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert float(sonar.state[p]["step"]) == float(standard.state[q]["step"]) == 3


@pytest.mark.parametrize(
    ("device", "dtype", "expected"),
    [
        ("cpu", torch.float32, True),
        ("cpu", torch.bfloat16, True),
        ("cpu", torch.float16, True),
        ("cpu", torch.float64, True),
        ("cuda", torch.bfloat16, True),
        ("meta", torch.float32, False),
        ("cpu", torch.int64, False),
    ],
)
def test_torchs_fused_adamw_is_chosen_where_torch_has_it(device, dtype, expected):
    from sonar_kernels.ops import has_torch_fused_adamw
    from sonar_kernels.optim.param_groups import torch_adamw_flags

    assert has_torch_fused_adamw(device, dtype) is expected
    if device != "cuda":
        p = torch.zeros(2, dtype=dtype, device=device)
        assert torch_adamw_flags({"foreach": None, "fused": None}, [p]) == (
            (None, True) if expected else (None, None)
        )
        # Explicit flags, and capturable or differentiable: torch's meaning, torch's choice.
        for group in ({"foreach": False, "fused": None}, {"foreach": None, "fused": False}):
            assert torch_adamw_flags(group, [p]) == (group["foreach"], group["fused"])
        assert torch_adamw_flags({"foreach": None, "fused": None, "capturable": True}, [p]) == (None, None)


def test_an_expert_group_with_its_own_flags_beside_a_default_dense_group_trains_as_torch_adamw():
    # The dense group runs torch's fused AdamW (found_inf given); the expert group, with nothing for step(),
    # asks for the for-loop, which refuses found_inf: step() must still run.
    model, reference = Tiny(), Tiny()
    optimizer = sonar_kernels.SonarAdamW(_groups(model, expert_options={"foreach": False}), **HYPER)
    groups = _groups(reference, expert_options={"foreach": False}, dense_options=FUSED)
    _train(model, optimizer)
    _train(reference, torch.optim.AdamW(groups, **HYPER))
    _assert_same(model, reference)
    assert optimizer.param_groups[0]["foreach"] is False and optimizer.param_groups[1]["fused"] is None


@pytest.mark.timeout(60)
def test_dtensors_run_torchs_fused_adamw_unless_a_call_would_mix_them_with_tensors(one_rank_mesh):
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from sonar_kernels.optim.param_groups import torch_adamw_flags

    def params(mixed):
        """A DTensor parameter, and a tensor one when ``mixed``, with gradients."""
        generator = torch.Generator().manual_seed(3)
        values = [torch.randn(4, 3, generator=generator) for _ in range(4)]
        made = [torch.nn.Parameter(distribute_tensor(values[0], one_rank_mesh, [Replicate()]))]
        made[0].grad = distribute_tensor(values[1], one_rank_mesh, [Replicate()])
        if mixed:
            made.append(torch.nn.Parameter(values[2]))
            made[1].grad = values[3]
        return made

    group = {"foreach": None, "fused": None}
    assert torch_adamw_flags(group, params(False)) == (None, True)
    # torch's fused AdamW refuses a call that mixes DTensors and tensors: torch's own default for them.
    assert torch_adamw_flags(group, params(True)) == (None, None)
    sonar, standard = params(False), params(False)
    for optimizer in (
        sonar_kernels.SonarAdamW(sonar, **HYPER),
        torch.optim.AdamW(standard, **HYPER, **FUSED),
    ):
        for _ in range(2):
            optimizer.step()
    assert isinstance(sonar[0], DTensor) and torch.equal(sonar[0].to_local(), standard[0].to_local())
