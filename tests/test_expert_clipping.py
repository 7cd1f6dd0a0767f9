"""expert_clipping (docs/design.md, "Expert clipping"): SPAM's spike rule and the lagged global-norm
coefficient inside the in-backward update, against torch.optim.AdamW (or, for 8-bit moments, the scheme's
torch ops) on a copy fed the same backend's plain gradients with the same rule applied to them first
(reference.spike_clip, reference.lagged_clip_coef), reading the copy's own exp_avg_sq."""

import copy
import io

import pytest
import torch
from cases import Case
from numerics import assert_same_run, rel_err

import sonar_kernels
from sonar_kernels import reference
from sonar_kernels.optim.in_backward import mark_expert_tensors
from sonar_kernels.rules import adamw as rules_adamw
from sonar_kernels.rules import master_weights as mw
from sonar_kernels.rules import moments_8bit as q8

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# T, H, I, E, top_k: W1 [2, 64, 96], W2 [2, 96, 32] (8-bit moments need the last dimension a multiple of 32).
SHAPE = Case(16, 96, 32, 2, 2)
STEPS = 3
SPIKE_STEP, SPIKE = 2, 1000.0  # the last step's loss multiplied by 1000
THETA = 50.0
MAX_NORM = 0.5
KINDS = {
    "fp32": (torch.float32, {}),
    "bf16": (torch.bfloat16, {}),
    "8bit": (torch.float32, {"moments_dtype": "8bit"}),
    "remainder": (torch.bfloat16, {"master_weights": "remainder"}),
}


def _inputs(device, dtype):
    torch.manual_seed(0)
    x, index, weights, w1, w2 = SHAPE.make(dtype, device=device)
    grads = []
    for s in range(STEPS):
        g = torch.randn(SHAPE.T, SHAPE.H, generator=torch.Generator().manual_seed(s))
        grads.append((g * (SPIKE if s == SPIKE_STEP else 1.0)).to(dtype).to(device))
    return x, index, weights, w1, w2, grads


def _optimizer(params, clipping, threshold=THETA, **options):
    if clipping == "lagged":
        mark_expert_tensors(*params)
        return sonar_kernels.SonarAdamW(
            params, **HYPER, max_grad_norm=MAX_NORM, expert_clipping="lagged", **options
        )
    return sonar_kernels.ExpertAdamW(
        params, **HYPER, expert_clipping=clipping, spike_threshold=threshold, **options
    )


def _bits(t):
    return t.detach().view(torch.int16) if t.dtype == torch.bfloat16 else t.detach()


def _train(backend, kind, clipping, device, **extra):
    """(params, optimizer, per-step clipped counts, per-step global norms) of the in-backward training."""
    dtype, options = KINDS[kind]
    x, index, weights, w1, w2, grads = _inputs(device, dtype)
    params = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
    optimizer = _optimizer(params, clipping, **options, **extra)
    counts, norms = [], []
    for grad_out in grads:
        sonar_kernels.moe_mlp(x, index, weights, *params, backend=backend).backward(grad_out)
        optimizer.step()
        counts.append(int(optimizer.expert_clipped_elements()))
        if clipping == "lagged":
            norms.append(optimizer.last_grad_norm.clone())
    return params, optimizer, counts, norms


def _hyper_tensor():
    return torch.tensor(
        [HYPER["lr"], *HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]], dtype=torch.float64
    )


def _moments(optimizer, p, kind):
    s = optimizer.state[p]
    if kind == "8bit":
        return ((s["exp_avg_codes"], s["exp_avg_scales"]), (s["exp_avg_sq_codes"], s["exp_avg_sq_scales"]))
    return (s["exp_avg"], s["exp_avg_sq"])


def _weight(optimizer, p, kind):
    """The weight the update trains: the fp32 master for the remainder."""
    return mw.merge(p.detach(), optimizer.state[p]["remainder"]) if kind == "remainder" else p.detach()


def _flat(moments):
    return [t for m in moments for t in (m if isinstance(m, tuple) else (m,))]


def _expected_step(backend, kind, clipping, optimizer, params, batch, coef):
    """What one step should give from the optimizer's state now: the same backend's plain gradient at the
    current weights (its backward without an optimizer), clipped by the reference rule (the spike rule
    against the state's own exp_avg_sq, dequantized for 8-bit moments; or the lagged coefficient
    ``coef``), then torch.optim.AdamW(fused=True) on a copy of the weight (the fp32 master for the
    remainder) and its state, or the 8-bit scheme's torch ops. Returns ([(weight, moments)], the spike
    rule's count, the plain gradients' global norm)."""
    x, index, weights, grad_out = batch
    copies = [p.detach().clone().requires_grad_() for p in params]
    sonar_kernels.moe_mlp(x, index, weights, *copies, backend=backend).backward(grad_out)
    grads = [c.grad for c in copies]
    norm = torch.sqrt(sum(torch.linalg.vector_norm(g.float()).square() for g in grads))
    expected, count = [], 0
    for p, g in zip(params, grads, strict=True):
        state = optimizer.state[p]
        if kind == "8bit":  # the scheme's torch ops, on the CPU
            m_state, v_state = (tuple(t.cpu().clone() for t in pair) for pair in _moments(optimizer, p, kind))
            v = q8.dequantize(*v_state, "exp_avg_sq")
            g = g.cpu()
        else:
            v = state["exp_avg_sq"]
        if clipping == "spike":
            g, n = reference.spike_clip(g, v, THETA)
            count += n
        elif coef is not None:
            g = reference.lagged_clip(g, coef)
        if kind == "8bit":
            scalars = rules_adamw.adamw_scalars(state["step"].cpu() + 1, _hyper_tensor())
            new_p, m, v = q8.adamw_8bit_update(
                p.detach().cpu(), g.float().cpu(), m_state, v_state, scalars, _hyper_tensor()
            )
            expected.append((new_p, (m, v)))
            continue
        copy = torch.nn.Parameter(_weight(optimizer, p, kind).clone())
        twin = torch.optim.AdamW([copy], **HYPER, fused=True)
        twin.state[copy] = {k: state[k].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
        copy.grad = g.to(copy.dtype)
        twin.step()
        expected.append((copy.detach(), (twin.state[copy]["exp_avg"], twin.state[copy]["exp_avg_sq"])))
    return expected, count, norm


@pytest.mark.usefixtures("wgrad_tiles_of_the_8bit_update")
@pytest.mark.parametrize("clipping", ["spike", "lagged"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("backend", ["torch", "torch-chunked", "triton"])
def test_each_step_equals_torch_adamw_fed_the_clipped_gradient(backend, kind, clipping, device, monkeypatch):
    if backend == "torch-chunked":  # one expert per chunk, clipped in place in slices that do not divide it
        from sonar_kernels.ops.torch_backend import mlp as torch_backend
        from sonar_kernels.rules import clipping as clipping_ops

        monkeypatch.setattr(torch_backend, "WGRAD_CHUNK_BYTES", 64 * 96 * 4)
        monkeypatch.setattr(clipping_ops, "CLIP_SLICE", 1000)
        backend = "torch"
    dtype, options = KINDS[kind]
    x, index, weights, w1, w2, grads = _inputs(device, dtype)
    params = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
    optimizer = _optimizer(params, clipping, **options)
    # Bitwise where the same arithmetic runs (the torch backend runs torch's AdamW and the scheme's ops; the
    # Triton 8-bit update is the scheme's arithmetic); else the Triton AdamW arithmetic and torch's CPU AdamW
    # round differently in the last bits (docs/design.md, "Arithmetic"; test_expert_adamw.py bounds it in
    # ulps): fp32 to a relative 1e-6 per step, bf16 each element within one bf16 ulp of the larger of the
    # result and the value before the step.
    exact = backend == "torch" or kind == "8bit"
    coef, counts = None, []
    for step, grad_out in enumerate(grads):
        expected, count, norm = _expected_step(
            backend, kind, clipping, optimizer, params, (x, index, weights, grad_out), coef
        )
        before = [
            [t.clone() for t in (_weight(optimizer, p, kind), *_flat(_moments(optimizer, p, kind)))]
            for p in params
        ]
        sonar_kernels.moe_mlp(x, index, weights, *params, backend=backend).backward(grad_out)
        optimizer.step()
        counts.append(int(optimizer.expert_clipped_elements()))
        assert counts[-1] == count, f"step {step}: the spike rule's count"
        if clipping == "lagged":  # the global norm over all parameters, and torch's coefficient of it
            assert abs(float(optimizer.last_grad_norm) / float(norm) - 1) <= 1e-6
            coef = reference.lagged_clip_coef(optimizer.last_grad_norm, MAX_NORM)
            assert torch.equal(optimizer.expert_clip_coef, coef)
        for p, (want_w, want_moments), old in zip(params, expected, before, strict=True):
            got = [_weight(optimizer, p, kind), *_flat(_moments(optimizer, p, kind))]
            for a, b, c in zip(got, [want_w, *_flat(want_moments)], old, strict=True):
                a, b, c = a.cpu(), b.cpu(), c.cpu()
                if exact:
                    assert torch.equal(a, b), f"step {step}"
                elif a.dtype == torch.float32:
                    assert rel_err(a, b) <= 1e-6, f"step {step}"
                else:  # one ulp at the larger of the result and the value before (a cancellation keeps its ulp)
                    scale = torch.maximum(b.float().abs(), c.float().abs())
                    ulp = torch.finfo(torch.bfloat16).eps * scale + torch.finfo(torch.bfloat16).tiny
                    assert bool(((a.float() - b.float()).abs() <= ulp).all()), f"step {step}"
    if clipping == "spike":  # not at the first update (v = 0); at the spike in most elements
        assert counts[0] == 0 and counts[SPIKE_STEP] > sum(p.numel() for p in params) // 2
    else:
        assert counts == [0] * STEPS and float(optimizer.expert_clip_coef) < 1.0


@pytest.mark.usefixtures("wgrad_tiles_of_the_8bit_update")
@pytest.mark.parametrize("clipping", ["spike", "lagged"])
@pytest.mark.parametrize("kind", [*KINDS, "stochastic"])
def test_the_fused_epilogue_equals_the_split_path(kind, clipping, device):
    options = {"master_weights": "stochastic"} if kind == "stochastic" else {}
    kind = "bf16" if kind == "stochastic" else kind
    runs = []
    for fused in (True, False):
        params, optimizer, counts, _ = _train(
            "triton", kind, clipping, device, fused_epilogue=fused, **options
        )
        runs.append((params, optimizer, counts))
    (fp, fo, fc), (sp, so, sc) = runs
    assert fc == sc
    for a, b in zip(fp, sp, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        for x, y in zip(_flat(_moments(fo, a, kind)), _flat(_moments(so, b, kind)), strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_threshold_no_gradient_reaches_gives_the_bits_without_clipping(backend, kind, device):
    high, _, counts, _ = _train(backend, kind, "spike", device, threshold=1e30)
    none, _, _, _ = _train(backend, kind, "none", device)
    assert counts == [0] * STEPS
    for a, b in zip(high, none, strict=True):
        assert torch.equal(a, b)


def test_the_rule_sees_the_accumulated_gradient_once():
    # accumulation_steps=2 on the torch backend: the two micro-batches' gradients are summed first (as
    # autograd sums them in .grad), then clipped once against exp_avg_sq.
    x, index, weights, w1, w2, grads = _inputs("cpu", torch.float32)
    params = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
    optimizer = sonar_kernels.ExpertAdamW(
        params, **HYPER, expert_clipping="spike", spike_threshold=2.0, accumulation_steps=2
    )
    masters = [torch.nn.Parameter(w.clone()) for w in (w1, w2)]
    ref = torch.optim.AdamW(masters, **HYPER, fused=True)
    total = 0
    for step in range(2):
        for grad_out in grads[:2]:
            sonar_kernels.moe_mlp(x, index, weights, *params, backend="torch").backward(grad_out * (step + 1))
            sonar_kernels.moe_mlp(x, index, weights, *masters, backend="torch").backward(
                grad_out * (step + 1)
            )
        optimizer.step()
        this_step = 0
        for m in masters:
            v = ref.state.get(m, {}).get("exp_avg_sq", torch.zeros_like(m))
            m.grad, n = reference.spike_clip(m.grad, v, 2.0)
            this_step += n
        ref.step()
        ref.zero_grad()
        assert int(optimizer.expert_clipped_elements()) == this_step
        total += this_step
    assert total > 0
    for p, m in zip(params, masters, strict=True):
        assert torch.equal(p, m)
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], ref.state[m]["exp_avg_sq"])


def test_a_gradient_that_reaches_grad_is_clipped_too():
    # A managed tensor used outside the expert MLP gets its gradient through .grad (torch's AdamW there).
    w = torch.nn.Parameter(torch.randn(2, 8, 32))
    twin = torch.nn.Parameter(w.detach().clone())
    optimizer = sonar_kernels.ExpertAdamW([w], **HYPER, expert_clipping="spike", spike_threshold=3.0)
    ref = torch.optim.AdamW([twin], **HYPER, fused=True)
    counts = []
    for step in range(3):
        c = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step)) * (
            100.0 if step == 2 else 1.0
        )
        (w * c).sum().backward()
        optimizer.step()
        (twin * c).sum().backward()
        v = ref.state.get(twin, {}).get("exp_avg_sq", torch.zeros_like(twin))
        twin.grad, n = reference.spike_clip(twin.grad, v, 3.0)
        counts.append((int(optimizer.expert_clipped_elements()), n))
        ref.step()
        ref.zero_grad()
        assert torch.equal(w, twin)
    assert all(a == b for a, b in counts) and counts[2][0] > 0


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"expert_clipping": "global"}, ValueError, "expert_clipping must be one of"),
        ({"expert_clipping": "spike", "spike_threshold": 0.0}, ValueError, "spike_threshold"),
        ({"expert_clipping": "spike", "spike_threshold": float("inf")}, ValueError, "spike_threshold"),
        ({"expert_clipping": "spike", "spike_threshold": True}, ValueError, "spike_threshold"),
        ({"expert_clipping": "lagged"}, ValueError, "needs max_grad_norm"),
    ],
)
def test_bad_options_are_refused(options, error, words):
    with pytest.raises(error, match=words):
        sonar_kernels.SonarAdamW([torch.nn.Parameter(torch.zeros(2))], **options)


def test_expert_adamw_refuses_lagged_and_names_sonar_adamw():
    with pytest.raises(ValueError, match="SonarAdamW"):
        sonar_kernels.ExpertAdamW([torch.nn.Parameter(torch.zeros(2, 4, 32))], expert_clipping="lagged")


@pytest.mark.gpu
@pytest.mark.parametrize("clipping", ["none", "spike", "lagged"])
def test_the_backward_with_its_updates_never_waits_for_the_device(clipping, device):
    # torch.cuda's sync debug mode raises at any operation that waits for the device (a host read, a copy
    # from the host): the wgrad launches with their in-epilogue updates, the check passes and the telemetry
    # all stay on the device, with and without expert clipping.
    x, index, weights, w1, w2, grads = _inputs(device, torch.bfloat16)
    params = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
    optimizer = (
        _optimizer(params, clipping) if clipping != "none" else sonar_kernels.ExpertAdamW(params, **HYPER)
    )
    for grad_out in grads[:2]:  # the first step builds the kernels and the state's tensors
        sonar_kernels.moe_mlp(x, index, weights, *params, backend="triton").backward(grad_out)
        optimizer.step()
    out = sonar_kernels.moe_mlp(x, index, weights, *params, backend="triton")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out.backward(grads[2])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert float(optimizer.state[params[0]]["step"]) == 3.0


@pytest.mark.parametrize("kind", ["fp32", "bf16", "remainder"])
def test_the_torch_backends_chunks_and_slices_give_the_same_bits(kind, monkeypatch):
    # The torch backend's chunked update clips each chunk in place, CLIP_SLICE elements at a time: one expert
    # per chunk and slices that do not divide a chunk give the bits of the whole tensor's update ("spike";
    # "lagged" reads the global norm, whose chunked sum rounds differently: the reference test covers it).
    clipping = "spike"
    from sonar_kernels.ops.torch_backend import mlp as torch_backend
    from sonar_kernels.rules import clipping as clipping_ops

    whole, whole_opt, whole_counts, _ = _train("torch", kind, clipping, "cpu")
    monkeypatch.setattr(torch_backend, "WGRAD_CHUNK_BYTES", 64 * 96 * 4)
    monkeypatch.setattr(clipping_ops, "CLIP_SLICE", 1000)
    sliced, sliced_opt, sliced_counts, _ = _train("torch", kind, clipping, "cpu")
    assert sliced_counts == whole_counts
    for a, b in zip(whole, sliced, strict=True):
        assert torch.equal(_weight(whole_opt, a, kind), _weight(sliced_opt, b, kind))
        for x, y in zip(
            _flat(_moments(whole_opt, a, kind)), _flat(_moments(sliced_opt, b, kind)), strict=True
        ):
            assert torch.equal(x, y)


@pytest.mark.parametrize(
    ("key", "value"), [("expert_clipping", "spike"), ("spike_threshold", 10.0), ("max_grad_norm", 1.0)]
)
@pytest.mark.parametrize("when", ["given", "set_later"])
@pytest.mark.parametrize("optimizer_class", ["SonarAdamW", "ExpertAdamW"])
def test_a_groups_own_clipping_option_is_refused_by_name(optimizer_class, when, key, value):
    # torch honours a group's own lr; a group's own expert_clipping or spike_threshold would be ignored (the
    # optimizer's argument holds for every group), so it is refused, naming the key, before anything changes.
    torch.manual_seed(0)
    experts = torch.nn.Parameter(torch.randn(2, 64, 32))
    mark_expert_tensors(experts)
    dense = torch.nn.Parameter(torch.randn(8))
    params = [experts] if optimizer_class == "ExpertAdamW" else [experts, dense]
    group = {"params": params, key: value} if when == "given" else {"params": params}
    build = getattr(sonar_kernels, optimizer_class)
    if when == "given":
        with pytest.raises(ValueError, match=rf"a parameter group sets {key}=.*of the whole optimizer"):
            build([group], **HYPER)
        return
    optimizer = build([group], **HYPER)
    optimizer.param_groups[0][key] = value
    dense.grad = torch.ones_like(dense)
    values = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=rf"a parameter group sets {key}=.*of the whole optimizer"):
        optimizer.step()
    assert all(torch.equal(p, v) for p, v in zip(params, values, strict=True))


# --- Resume: what a checkpoint keeps (docs/usage.md, "Checkpoints and resume") ---

RESUME_STOP, RESUME_STEPS = 2, 4
# Small enough that the global norm exceeds it at every step: the lagged coefficient is below 1 throughout.
RESUME_MAX_NORM = 0.01
RESUME_CLIPPING = {
    "spike": {"expert_clipping": "spike", "spike_threshold": 2.0},
    "lagged": {"expert_clipping": "lagged", "max_grad_norm": RESUME_MAX_NORM},
}


def _resume_run(backend, kind, clipping, steps, first=0, model=None, optimizer=None):
    from test_replacement import KINDS as STATE_KINDS
    from test_replacement import Tiny, _batch

    dtype, options = STATE_KINDS[kind]
    if model is None:
        model = Tiny(backend=backend).to(dtype)
        optimizer = sonar_kernels.SonarAdamW(
            model.parameters(), **HYPER, **options, **RESUME_CLIPPING[clipping]
        )
    for step in range(first, steps):
        model(_batch(step, dtype)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _saved(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _resumed(backend, kind, clipping, route, tmp_path):
    """The run stopped after RESUME_STOP steps, its checkpoint written and read back by ``route``, and
    continued in a new model and optimizer (another initialisation: what the checkpoint misses differs)."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    first, first_optimizer = _resume_run(backend, kind, clipping, RESUME_STOP)
    model_state = _saved(first.state_dict())
    model, optimizer = _resume_run(backend, kind, clipping, 0)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.load_state_dict(model_state)
    if route == "state_dict":
        optimizer.load_state_dict(_saved(first_optimizer.state_dict()))
    else:  # torch.distributed.checkpoint, files included (one process: no process group needed)
        dcp.save({"optimizer": get_optimizer_state_dict(first, first_optimizer)}, checkpoint_id=tmp_path)
        target = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(target, checkpoint_id=tmp_path)
        set_optimizer_state_dict(model, optimizer, target["optimizer"])
    return _resume_run(backend, kind, clipping, RESUME_STEPS, RESUME_STOP, model, optimizer)


RESUME_CASES = [
    pytest.param("torch", kind, clipping, route, id=f"torch-{kind}-{clipping}-{route}")
    for kind in ("fp32", "8bit", "bf16", "bf16-remainder", "bf16-stochastic", "bf16-8bit-remainder")
    for clipping in RESUME_CLIPPING
    for route in ("state_dict", "dcp")
] + [pytest.param("triton", "fp32", "lagged", "state_dict", id="triton-fp32-lagged-state_dict")]


@pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed.checkpoint")
@pytest.mark.parametrize(("backend", "kind", "clipping", "route"), RESUME_CASES)
def test_a_resumed_run_equals_the_uninterrupted_one_bitwise(backend, kind, clipping, route, tmp_path):
    uninterrupted = _resume_run(backend, kind, clipping, RESUME_STEPS)
    if clipping == "lagged":  # the coefficient clips at every step: a resume that forgot it would differ
        assert float(uninterrupted[1].expert_clip_coef) < 1.0
    assert_same_run(_resumed(backend, kind, clipping, route, tmp_path), uninterrupted)


def test_a_lagged_checkpoint_loads_into_torch_adamw_and_one_without_the_coefficient_loads_as_before():
    model, optimizer = _resume_run("torch", "fp32", "lagged", RESUME_STOP)
    saved = _saved(optimizer.state_dict())
    coef = float(optimizer.expert_clip_coef)
    experts = {i for i, p in enumerate(model.parameters()) if p.dim() == 3}
    assert 0.0 < coef < 1.0 and {i for i, s in saved["state"].items() if "expert_clip_coef" in s} == experts
    # torch.optim.AdamW loads it and steps as it does from the same state without the key.
    with_key, without_key = [], []
    for keep, out in ((True, with_key), (False, without_key)):
        state = copy.deepcopy(saved)
        if not keep:
            for entry in state["state"].values():
                entry.pop("expert_clip_coef", None)
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        twin = torch.optim.AdamW(params, **HYPER)
        twin.load_state_dict(state)
        for p in params:
            p.grad = torch.ones_like(p)
        twin.step()
        out.extend(p.detach() for p in params)
    assert all(torch.equal(a, b) for a, b in zip(with_key, without_key, strict=True))
    # A checkpoint written before the coefficient was saved: it loads, the coefficient left as it was.
    for entry in saved["state"].values():
        entry.pop("expert_clip_coef", None)
    _, fresh = _resume_run("torch", "fp32", "lagged", 0)
    fresh.load_state_dict(saved)
    assert not fresh.lagged_coef_set and float(fresh.expert_clip_coef) == 1.0


def test_a_bad_saved_lagged_coefficient_is_refused_before_anything_is_loaded():
    _, optimizer = _resume_run("torch", "fp32", "lagged", 1)
    saved = _saved(optimizer.state_dict())
    _, fresh = _resume_run("torch", "fp32", "lagged", 0)
    before = copy.deepcopy(fresh.state_dict())
    index = next(i for i, s in saved["state"].items() if "expert_clip_coef" in s)
    saved["state"][index]["expert_clip_coef"] = torch.tensor(2.0)
    with pytest.raises(
        ValueError, match=r"expert_clip_coef of parameter \d+ must be a one-element tensor in"
    ):
        fresh.load_state_dict(saved)
    after = fresh.state_dict()
    for i, state in before["state"].items():
        assert all(torch.equal(value, after["state"][i][key]) for key, value in state.items())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_telemetry_of_a_tensor_with_no_gradient_this_step_reads_0_from_the_end_of_the_backward(backend):
    # Two layers; the last step's backward reaches only the first. Read between that backward and step()
    # (the docstrings allow it), the second layer's norm and clipped count are 0, not the last step's; the
    # first layer's norm is that of its plain gradient (a copy's backward without an optimizer).
    x, index, weights, w1, w2, grads = _inputs("cpu", torch.float32)
    first = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
    second = [torch.nn.Parameter(w1.clone() * 0.5), torch.nn.Parameter(w2.clone() * 0.5)]
    optimizer = _optimizer(first + second, "spike", threshold=0.5)
    for grad_out in grads[:2]:
        hidden = sonar_kernels.moe_mlp(x, index, weights, *first, backend=backend)
        sonar_kernels.moe_mlp(hidden, index, weights, *second, backend=backend).backward(grad_out)
        optimizer.step()
    assert (
        int(optimizer.expert_clipped_elements(second)) > 0 and float(optimizer.expert_grad_norm(second)) > 0
    )
    copies = [p.detach().clone().requires_grad_() for p in first]
    sonar_kernels.moe_mlp(x, index, weights, *copies, backend=backend).backward(grads[2])
    expected = torch.sqrt(sum(torch.linalg.vector_norm(c.grad).square() for c in copies))
    sonar_kernels.moe_mlp(x, index, weights, *first, backend=backend).backward(grads[2])
    assert float(optimizer.expert_grad_norm(second)) == 0.0
    assert int(optimizer.expert_clipped_elements(second)) == 0
    assert rel_err(optimizer.expert_grad_norm(first), expected) <= 1e-6
    optimizer.step()
    assert (
        float(optimizer.expert_grad_norm(second)) == 0.0
        and int(optimizer.expert_clipped_elements(second)) == 0
    )


@pytest.mark.parametrize("number", ["float", "numpy.float32", "numpy.float64", "numpy.int64"])
@pytest.mark.parametrize("clipping", ["spike", "lagged"])
def test_every_real_number_type_torch_takes_is_taken(clipping, number):
    # spike_threshold and max_grad_norm of any real type (numpy's too) and accumulation_steps / rounding_seed
    # of any integer type, each step equal to torch.optim.AdamW fed the reference-clipped gradient.
    import numpy as np

    kind = {"float": float, "numpy.float32": np.float32, "numpy.float64": np.float64, "numpy.int64": np.int64}
    as_number = kind[number]
    x, index, weights, w1, w2, grads = _inputs("cpu", torch.float32)
    params = [torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
    integers = {"accumulation_steps": np.int64(1), "rounding_seed": np.int64(0)}
    if clipping == "lagged":
        mark_expert_tensors(*params)
        max_norm = as_number(MAX_NORM) if number != "numpy.int64" else np.int64(1)
        optimizer = sonar_kernels.SonarAdamW(
            params, **HYPER, max_grad_norm=max_norm, expert_clipping="lagged", **integers
        )
    else:
        optimizer = _optimizer(params, "spike", threshold=as_number(THETA), **integers)
    coef = None
    for grad_out in grads:
        expected, count, _ = _expected_step(
            "torch", "fp32", clipping, optimizer, params, (x, index, weights, grad_out), coef
        )
        sonar_kernels.moe_mlp(x, index, weights, *params, backend="torch").backward(grad_out)
        optimizer.step()
        if clipping == "lagged":
            coef = reference.lagged_clip_coef(optimizer.last_grad_norm, float(max_norm))
        assert int(optimizer.expert_clipped_elements()) == count
        for p, (want, _) in zip(params, expected, strict=True):
            assert torch.equal(p.detach(), want)
