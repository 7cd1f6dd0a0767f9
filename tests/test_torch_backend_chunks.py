"""The torch backend's in-backward update by chunks of experts (ops/torch_backend/expert_gradient.py ``ExpertGradient``,
ops/torch_backend/adamw.py ``torch_adamw_chunked_``): bit for bit the update of the whole tensor whatever the chunks,
bit for bit torch.optim.AdamW(fused=True) with dense-only clipping, the skip rule for the tensor as a
whole, and at most one chunk of expert gradient alive (torch's MemTracker)."""

import warnings

import pytest
import torch
from numerics import rel_err
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

import sonar_kernels
from sonar_kernels import ops
from sonar_kernels.ops.torch_backend import expert_gradient
from sonar_kernels.ops.torch_backend import mlp as torch_backend
from sonar_kernels.optim import UnownedExpertsWarning

# 12 experts; one expert's W1 gradient is 2 * 16 * 32 = 1024 elements, its W2's 512: multiples of the
# 64-element chunk alignment, so a chunk can be one expert.
E, H, I, T, TOP_K = 12, 32, 16, 40, 2
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
W1_EXPERT_BYTES = 2 * I * H * 4
# Chunk budgets by experts of W1 per chunk: one, a prime number, every expert at once (None: the whole
# tensor, no chunks).
CHUNKS = {"1-expert": W1_EXPERT_BYTES, "5-experts": 5 * W1_EXPERT_BYTES, "all": None}
COMPUTE = expert_gradient.ExpertGradient.compute


def _batch(step, top_k=TOP_K):
    generator = torch.Generator().manual_seed(10 + step)
    x = torch.randn(T, H, generator=generator)
    index = torch.randint(0, E, (T, top_k), generator=generator)
    weights = torch.softmax(torch.randn(T, top_k, generator=generator), dim=-1)
    grad_out = torch.randn(T, H, generator=generator)
    return x, index, weights, grad_out


def _layer_weights(layout):
    generator = torch.Generator().manual_seed(0)
    w1 = torch.randn(E, 2 * I, H, generator=generator) * H**-0.5
    w2 = torch.randn(E, H, I, generator=generator) * I**-0.5
    if layout.startswith("interleaved"):  # gate 0, up 0, gate 1, ... (as tests/test_layouts.py)
        w1 = torch.stack((w1[:, :I], w1[:, I:]), dim=2).flatten(1, 2)
    if layout.endswith("_transposed"):
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    return [torch.nn.Parameter(t.contiguous()) for t in (w1, w2)]


def _train(layout, chunk_bytes, monkeypatch, steps=2, accumulation_steps=1):
    """``steps`` optimizer steps of one layer (ExpertAdamW, torch backend) with chunks of at most
    ``chunk_bytes``; returns (weights, optimizer, the expert ranges each gradient was computed for)."""
    monkeypatch.setattr(torch_backend, "WGRAD_CHUNK_BYTES", chunk_bytes)
    ranges = []

    def recording(self, first, last, out):
        ranges.append((tuple(self.weight.shape), first, last))
        return COMPUTE(self, first, last, out)

    monkeypatch.setattr(expert_gradient.ExpertGradient, "compute", recording)
    params = _layer_weights(layout)
    optimizer = sonar_kernels.ExpertAdamW(params, **HYPER, accumulation_steps=accumulation_steps)
    flags = {"transposed": layout.endswith("_transposed"), "interleaved": layout.startswith("interleaved")}
    for step in range(steps * accumulation_steps):
        x, index, weights, grad_out = _batch(step)
        sonar_kernels.moe_mlp(x, index, weights, *params, backend="torch", **flags).backward(grad_out)
        if (step + 1) % accumulation_steps == 0:
            optimizer.step()
    return params, optimizer, ranges


def _state(params, optimizer):
    return [
        [p.detach().clone()] + [optimizer.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq", "step")]
        for p in params
    ]


def _assert_same_state(a, b):
    for tensors, expected in zip(a, b, strict=True):
        for x, y, what in zip(tensors, expected, ("weight", "exp_avg", "exp_avg_sq", "step"), strict=True):
            assert torch.equal(x, y), f"{what}: max diff {(x - y).abs().max():.3e}"


@pytest.mark.parametrize("layout", ["concatenated", "interleaved_transposed"])
@pytest.mark.parametrize("chunks", list(CHUNKS), ids=list(CHUNKS))
@pytest.mark.parametrize("accumulation_steps", [1, 2], ids=["one-micro-batch", "accumulated"])
def test_the_chunked_update_is_the_whole_tensors_update_bit_for_bit(
    layout, chunks, accumulation_steps, monkeypatch
):
    whole, whole_optimizer, whole_ranges = _train(
        layout, None, monkeypatch, accumulation_steps=accumulation_steps
    )
    params, optimizer, ranges = _train(
        layout, CHUNKS[chunks], monkeypatch, accumulation_steps=accumulation_steps
    )
    assert all((first, last) == (0, E) for _, first, last in whole_ranges)
    # W1's chunks of the budget's experts, W2's of twice as many (half the bytes per expert).
    per_chunk = {"1-expert": 1, "5-experts": 5, "all": E}[chunks]
    # (Earlier micro-batches' gradients are whole: they go to the accumulation buffer.)
    chunked = {
        (shape, first, last) for shape, first, last in ranges if per_chunk == E or (first, last) != (0, E)
    }
    w1_ranges = sorted((first, last) for shape, first, last in chunked if shape == tuple(params[0].shape))
    w2_ranges = sorted((first, last) for shape, first, last in chunked if shape == tuple(params[1].shape))
    assert w1_ranges == [(e, min(e + per_chunk, E)) for e in range(0, E, per_chunk)]
    assert w2_ranges == [(e, min(e + 2 * per_chunk, E)) for e in range(0, E, 2 * per_chunk)]
    _assert_same_state(_state(params, optimizer), _state(whole, whole_optimizer))
    # The gradient-norm telemetry: the chunks' squares summed, the same norm to fp32 rounding.
    assert rel_err(optimizer.expert_grad_norm(), whole_optimizer.expert_grad_norm()) <= 1e-6


class _Tiny(torch.nn.Module):
    """A router, SonarExperts on the torch backend and a dense head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router = torch.nn.Linear(H, E)
        self.experts = sonar_kernels.SonarExperts(E, H, I, backend="torch")
        self.head = torch.nn.Linear(H, H)

    def forward(self, x):
        weights, index = torch.softmax(self.router(x), -1).topk(TOP_K, dim=-1)
        return self.head(self.experts(x, index, weights))


@pytest.mark.parametrize("lr", [1e-2, "tensor"], ids=["float-lr", "tensor-lr"])
def test_chunks_equal_torch_fused_adamw_with_dense_only_clipping(lr, monkeypatch):
    # SonarAdamW's default flags on the CPU (torch's fused AdamW) against torch.optim.AdamW(fused=True)
    # given the plain gradients of the same kernels, the dense ones clipped: the same bits, clipping active.
    # A tensor lr takes torch's arithmetic for tensors (the chunks then go through torch's AdamW call).
    monkeypatch.setattr(torch_backend, "WGRAD_CHUNK_BYTES", W1_EXPERT_BYTES)
    model, twin = _Tiny(), _Tiny()
    hyper = {**HYPER, "lr": torch.tensor(1e-2) if lr == "tensor" else lr}
    optimizer = sonar_kernels.SonarAdamW(model, **hyper, max_grad_norm=1e-3)
    dense = [p for name, p in twin.named_parameters() if not name.startswith("experts.")]
    reference = torch.optim.AdamW(
        twin.parameters(), **{**hyper, "lr": torch.tensor(1e-2) if lr == "tensor" else lr}, fused=True
    )
    clipped = []
    for step in range(3):
        x, *_ = _batch(step)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnownedExpertsWarning)
            twin(x).square().mean().backward()
            clipped.append(float(torch.nn.utils.clip_grad_norm_(dense, 1e-3)) > 1e-3)
            reference.step()
        reference.zero_grad()
    assert all(clipped)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max():.3e}"


def _routed_to_the_last_expert(bad: float):
    """A batch with top_k 1 whose token 0 alone goes to expert E - 1 (the last chunk's), with a gradient of
    ``bad`` there: every non-finite or too large entry of both expert gradients is in the last chunk."""
    x, _, _, grad_out = _batch(0, top_k=1)
    index = (torch.arange(T) % (E - 1)).reshape(T, 1)
    index[0] = E - 1
    weights = torch.ones(T, 1)
    grad_out[0] = bad
    return x, index, weights, grad_out


@pytest.mark.parametrize("bad", [float("nan"), 1e30], ids=["nan", "beyond-the-limit"])
def test_a_bad_entry_in_the_last_chunk_skips_the_whole_tensor(bad, monkeypatch):
    monkeypatch.setattr(torch_backend, "WGRAD_CHUNK_BYTES", W1_EXPERT_BYTES)
    params = _layer_weights("concatenated")
    optimizer = sonar_kernels.ExpertAdamW(params, **HYPER)
    x, index, weights, grad_out = _batch(0)
    sonar_kernels.moe_mlp(x, index, weights, *params, backend="torch").backward(grad_out)
    optimizer.step()
    before = _state(params, optimizer)
    updates = []
    adamw = ops.torch_backend.adamw._adamw
    monkeypatch.setattr(
        ops.torch_backend.adamw, "_adamw", lambda *args: updates.append(args[0].shape) or adamw(*args)
    )
    x, index, weights, grad_out = _routed_to_the_last_expert(bad)
    sonar_kernels.moe_mlp(x, index, weights, *params, backend="torch").backward(grad_out)
    optimizer.step()
    assert updates == []  # no chunk was updated, the first ones included
    _assert_same_state(_state(params, optimizer), before)
    assert int(optimizer.expert_skipped_updates()) == 2
    assert float(optimizer.expert_grad_norm()) == float("inf")


def test_the_check_pass_changes_no_bit_of_an_update_it_lets_through(monkeypatch):
    # When the bound cannot clear a gradient, every chunk's gradient is checked first; a finite one is then
    # applied exactly as without the check.
    expected, expected_optimizer, _ = _train("concatenated", W1_EXPERT_BYTES, monkeypatch)
    checks = []
    bound = ops.torch_backend.adamw.overflow_possible
    monkeypatch.setattr(
        ops.torch_backend.adamw,
        "overflow_possible",
        lambda *args: checks.append(1) or torch.ones_like(bound(*args)),
    )
    params, optimizer, ranges = _train("concatenated", W1_EXPERT_BYTES, monkeypatch)
    assert len(checks) == 4  # two tensors, two steps
    assert len(ranges) == 2 * (E + E // 2) * 2  # every chunk computed twice: checked, then updated
    _assert_same_state(_state(params, optimizer), _state(expected, expected_optimizer))


@pytest.mark.filterwarnings("ignore:Expected a tensor or a traceable wrapper-subclass")
@pytest.mark.parametrize("experts_per_chunk", [1, 2, None], ids=["1-expert", "2-experts", "whole"])
def test_a_layers_backward_holds_one_chunk_of_expert_gradient(experts_per_chunk, monkeypatch):
    # Expert gradients dwarf the activations here (8 routed rows): torch's MemTracker's peak of temporaries
    # during the backward is one chunk of W1's gradient plus less than one expert's gradient more.
    e, h, i, t = 8, 64, 64, 4
    per_expert = 2 * i * h * 4
    budget = None if experts_per_chunk is None else experts_per_chunk * per_expert
    monkeypatch.setattr(torch_backend, "WGRAD_CHUNK_BYTES", budget)
    torch.manual_seed(0)
    x, index, weights, grad_out = (
        torch.randn(t, h),
        torch.randint(0, e, (t, 2)),
        torch.rand(t, 2),
        torch.randn(t, h),
    )
    experts = sonar_kernels.SonarExperts(e, h, i, backend="torch")
    optimizer = sonar_kernels.ExpertAdamW(experts.parameters())
    experts(x, index, weights).backward(grad_out)
    optimizer.step()
    tracker = MemTracker()
    tracker.track_external(experts, optimizer)
    with tracker:
        experts(x, index, weights).backward(grad_out)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    assert peak[_MemRefType.GRAD] == 0
    chunk = e * per_expert if budget is None else budget
    down_expert = h * i * 4  # the smallest gradient of one expert
    assert chunk <= peak[_MemRefType.TEMP] < chunk + down_expert


@pytest.mark.filterwarnings("ignore:Expected a tensor or a traceable wrapper-subclass")
def test_dhpre_is_written_over_hpre_only_when_the_graph_is_freed():
    # The backward writes SwiGLU's dHpre over the saved Hpre when no one can read Hpre again (the graph is
    # freed after it): the same bits as with retain_graph=True, where Hpre is kept and dHpre gets a tensor
    # of its own, and one [S, 2I] tensor less at the peak. Activations dwarf the expert gradients here.
    e, h, i, t = 4, 16, 64, 256
    generator = torch.Generator().manual_seed(0)
    x, grad_out = torch.randn(t, h, generator=generator), torch.randn(t, h, generator=generator)
    index = torch.randint(0, e, (t, 2), generator=generator)
    weights = torch.rand(t, 2, generator=generator)
    results, peaks = [], []
    for retain in (False, True):
        torch.manual_seed(0)
        experts = sonar_kernels.SonarExperts(e, h, i, backend="torch")
        optimizer = sonar_kernels.ExpertAdamW(experts.parameters(), **HYPER)
        out = experts(x, index, weights)
        tracker = MemTracker()
        tracker.track_external(experts, optimizer)
        with tracker:
            out.backward(grad_out, retain_graph=retain)
        optimizer.step()
        peaks.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")][_MemRefType.TEMP])
        results.append(_state(list(experts.parameters()), optimizer))
    _assert_same_state(*results)
    dhpre_bytes = t * 2 * 2 * i * 4
    assert peaks[1] - peaks[0] >= dhpre_bytes
