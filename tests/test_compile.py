"""torch.compile over the expert MLP and its in-backward update (torch backend on the CPU): no graph
break, fullgraph, the same bits as eager under aot_eager and compiled autograd, fp32 tolerance under
inductor, and a scheduler's new learning rate reaching the compiled update."""

import copy

import pytest
import torch
from numerics import rel_err

import sonar_kernels

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


class Tiny(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.router = torch.nn.Linear(16, 4)
        self.experts = sonar_kernels.SonarExperts(4, 16, 8, backend="torch")
        self.head = torch.nn.Linear(16, 16)

    def forward(self, x):
        weights, index = torch.softmax(self.router(x), -1).topk(2, dim=-1)
        return self.head(self.experts(x, index, weights))


def _batch(step):
    return torch.randn(12, 16, generator=torch.Generator().manual_seed(100 + step))


def _run(model, optimizer, steps, compile_backend=None, scheduler=None, compiled_autograd=False):
    def loss_of(x):
        return model(x).square().mean()

    if compile_backend is not None:
        loss_of = torch.compile(loss_of, backend=compile_backend, fullgraph=True)
    for step in range(steps):
        loss = loss_of(_batch(step))
        if compiled_autograd:
            with torch._dynamo.compiled_autograd._enable(torch.compile(backend=compile_backend)):
                loss.backward()
        else:
            loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
    return model


def _experts(model):
    return [model.experts.gate_up_proj, model.experts.down_proj]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled_autograd", [False, True], ids=["aot", "compiled-autograd"])
@pytest.mark.parametrize("clip_norm_includes_experts", [False, True], ids=["dense-norm", "global-norm"])
def test_fullgraph_step_under_aot_eager_equals_eager_bitwise(compiled_autograd, clip_norm_includes_experts):
    # With the experts' norm in the clipping norm, the compiled updates' norms must reach the optimizer.
    clip = {"max_grad_norm": 0.5, "clip_norm_includes_experts": clip_norm_includes_experts}
    eager, compiled = Tiny(), Tiny()
    standard = sonar_kernels.SonarAdamW(eager, **HYPER, **clip)
    _run(eager, standard, 3)
    optimizer = sonar_kernels.SonarAdamW(compiled, **HYPER, **clip)
    _run(compiled, optimizer, 3, "aot_eager", compiled_autograd=compiled_autograd)
    assert torch.equal(optimizer.expert_grad_norm(), standard.expert_grad_norm())
    assert float(optimizer.expert_grad_norm()) > 0
    for p in _experts(compiled):
        assert float(optimizer.state[p]["step"]) == 3.0 and p.grad is None
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        assert torch.equal(p, q)


def test_fullgraph_step_under_inductor_within_fp32_tolerance():
    eager, compiled = Tiny(), Tiny()
    _run(eager, sonar_kernels.SonarAdamW(eager, **HYPER), 3)
    optimizer = sonar_kernels.SonarAdamW(compiled, **HYPER)
    _run(compiled, optimizer, 3, "inductor")
    for p in _experts(compiled):
        assert float(optimizer.state[p]["step"]) == 3.0 and p.grad is None
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        assert rel_err(p, q) <= 1e-5


def test_no_graph_break_in_the_experts():
    model = Tiny()
    sonar_kernels.SonarAdamW(model, **HYPER)
    explanation = torch._dynamo.explain(model)(_batch(0))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_a_scheduler_changes_the_learning_rate_of_the_compiled_update():
    eager, compiled = Tiny(), Tiny()
    results = []
    for model, backend in ((eager, None), (compiled, "aot_eager")):
        optimizer = sonar_kernels.SonarAdamW(model, **HYPER)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: [1.0, 0.0, 3.0, 1.0][step])
        _run(model, optimizer, 3, backend, scheduler=scheduler)
        results.append(model)
    for p, q in zip(_experts(compiled), _experts(eager), strict=True):
        assert torch.equal(p, q)
    # Against the same compiled run without the schedule: the new learning rates did reach the update.
    other = Tiny()
    optimizer = sonar_kernels.SonarAdamW(other, **HYPER)
    _run(other, optimizer, 3, "aot_eager")
    assert not torch.equal(_experts(other)[0], _experts(compiled)[0])


def _olmoe(intermediate_size=16):
    transformers = pytest.importorskip("transformers", minversion="5.13")
    from sonar_kernels.integrations import transformers as hf

    hf.register()
    torch.manual_seed(0)
    config = transformers.OlmoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=intermediate_size, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )  # fmt: skip
    config._experts_implementation = "sonar"
    return hf.set_backend(transformers.OlmoeForCausalLM(config), "torch")


def _train_olmoe(model, compile_backend, steps=3, **options):
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, max_grad_norm=0.5, **options)
    run = model if compile_backend is None else torch.compile(model, backend=compile_backend)
    for step in range(steps):
        tokens = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        run(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_a_compiled_olmoe_trains_like_eager(compile_backend):
    eager = _olmoe()
    compiled = copy.deepcopy(eager)
    explanation = torch._dynamo.explain(compiled)(torch.randint(3, 64, (2, 12)))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    _train_olmoe(eager, None)
    optimizer = _train_olmoe(compiled, compile_backend)
    assert len(optimizer.expert_tensors) == 4
    for p in optimizer.expert_tensors:
        assert float(optimizer.state[p]["step"]) == 3.0 and p.grad is None
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        if compile_backend == "aot_eager":
            assert torch.equal(p, q), name
        else:
            assert rel_err(p, q) <= 1e-5, name


def test_a_compiled_olmoe_with_8bit_moments_trains_like_eager_bitwise():
    # The update op with 8-bit moments (codes and scales in its state list) inside the compiled backward.
    eager = _olmoe(intermediate_size=32)
    compiled = copy.deepcopy(eager)
    _train_olmoe(eager, None, moments_dtype="8bit")
    optimizer = _train_olmoe(compiled, "aot_eager", moments_dtype="8bit")
    for p in optimizer.expert_tensors:
        assert (
            float(optimizer.state[p]["step"]) == 3.0
            and optimizer.state[p]["exp_avg_codes"].dtype == torch.int8
        )
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_compiled_bf16_olmoe_with_remainder_master_weights_trains_like_eager_bitwise():
    # The update op with the remainder in its state list (bf16 experts, fp32 masters) inside the compiled
    # backward.
    eager = _olmoe().to(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    eager_optimizer = _train_olmoe(eager, None, master_weights="remainder")
    optimizer = _train_olmoe(compiled, "aot_eager", master_weights="remainder")
    assert len(optimizer.expert_tensors) == 4
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(p, q), name
        if any(p is t for t in optimizer.expert_tensors):
            state, want = optimizer.state[p], eager_optimizer.state[q]
            assert float(state["step"]) == 3.0 and p.grad is None and p.dtype == torch.bfloat16
            assert torch.equal(state["remainder"], want["remainder"]) and bool(state["remainder"].ne(0).any())


class TinyExperts(torch.nn.Module):
    """Tiny with expert tensors beyond SonarExperts': the gate and the up projection as separate tensors
    (torchtitan's w1, w3), or one gate_up_proj with biases on both projections (gpt-oss)."""

    def __init__(self, kind, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.kind = kind
        self.router = torch.nn.Linear(16, 4)
        rows = 8 if kind == "separate" else 16
        self.gate = torch.nn.Parameter(torch.randn(4, rows, 16) * 0.25)
        self.down = torch.nn.Parameter(torch.randn(4, 16, 8) * 0.35)
        if kind == "separate":
            self.up = torch.nn.Parameter(torch.randn(4, 8, 16) * 0.25)
            extra = (self.up,)
        else:
            self.b1 = torch.nn.Parameter(torch.randn(4, 16) * 0.1)
            self.b2 = torch.nn.Parameter(torch.randn(4, 16) * 0.1)
            extra = (self.b1, self.b2)
        self.extra = extra
        sonar_kernels.specs.mark_expert_tensors(self.gate, self.down, *extra)
        self.head = torch.nn.Linear(16, 16)

    def expert_tensors(self):
        return (self.gate, self.down, *self.extra)

    def forward(self, x):
        weights, index = torch.softmax(self.router(x), -1).topk(2, dim=-1)
        if self.kind == "separate":
            options = {"up_proj": self.up}
        else:
            options = {"gate_up_proj_bias": self.b1, "down_proj_bias": self.b2}
        out = sonar_kernels.moe_mlp(x, index, weights, self.gate, self.down, backend="torch", **options)
        return self.head(out)


@pytest.mark.parametrize("kind", ["separate", "biases"])
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_separate_up_tensors_and_biases_are_updated_inside_the_compiled_backward(compile_backend, kind):
    eager, compiled = TinyExperts(kind), TinyExperts(kind)
    _run(eager, sonar_kernels.SonarAdamW(eager, **HYPER), 3)
    optimizer = sonar_kernels.SonarAdamW(compiled, **HYPER)
    _run(compiled, optimizer, 3, compile_backend)
    for p in compiled.expert_tensors():
        assert float(optimizer.state[p]["step"]) == 3.0 and p.grad is None
    for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
        if compile_backend == "aot_eager":
            assert torch.equal(p, q)
        else:
            assert rel_err(p, q) <= 1e-5
