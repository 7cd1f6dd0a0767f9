"""grouped_mlp: the pre-permuted entry point (tokens already grouped by expert, torchtitan's interface),
against a per-expert float64 loop written here, and its in-backward update against torch.optim.AdamW."""

import pytest
import torch
import torch.nn.functional as F
from cases import CASES
from numerics import assert_close

import sonar_kernels

E, H, I = 4, 24, 12
# Expert 1 gets no rows; the last 3 rows are padding (no expert).
COUNTS = [5, 0, 7, 3]
N = sum(COUNTS) + 3


def _per_expert(x, w1, w2, counts, activation="silu"):
    """Expert e's MLP on its block of rows, one block at a time; padding rows 0."""
    act = {"silu": F.silu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[activation]
    I = w2.shape[2]
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(counts):
        rows = x[start : start + count]
        h = rows @ w1[e].T
        out[start : start + count] = (act(h[:, :I]) * h[:, I:]) @ w2[e].T
        start += count
    return out


def _inputs(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=generator)
    w1 = torch.randn(E, 2 * I, H, generator=generator) * H**-0.5
    w2 = torch.randn(E, H, I, generator=generator) * I**-0.5
    return [t.to(dtype) for t in (x, w1, w2)]


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_grouped_mlp_matches_a_per_expert_loop_in_float64(backend, dtype, activation):
    inputs = _inputs(dtype)
    leaves = [t.clone().requires_grad_() for t in inputs]
    counts = torch.tensor(COUNTS, dtype=torch.int32)
    out = sonar_kernels.grouped_mlp(*leaves[:1], counts, *leaves[1:], activation=activation, backend=backend)
    exact = [t.double().requires_grad_() for t in inputs]
    expected = _per_expert(*exact, COUNTS, activation)
    assert out.shape == (N, H) and out.dtype == dtype
    assert_close(out, expected, dtype)
    assert torch.equal(out[-3:], torch.zeros(3, H, dtype=dtype))  # padding rows
    grad_out = torch.randn(N, H).to(dtype)
    out.backward(grad_out)
    expected.backward(grad_out.double())
    for name, leaf, ref in zip(("x_sorted", "gate_up_proj", "down_proj"), leaves, exact, strict=True):
        assert_close(leaf.grad, ref.grad, dtype, what=name)
    assert torch.equal(leaves[0].grad[-3:], torch.zeros(3, H, dtype=dtype))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_grouped_mlp_over_the_shape_table_of_moe_mlp(backend, case):
    # The rows of each case's routed slots, grouped by expert: the same sizes and empty experts as the
    # moe_mlp tests; dropped slots (sentinels) become padding rows.
    torch.manual_seed(0)
    x, index, _, w1, w2 = case.make(torch.float32)
    flat = index.reshape(-1)
    kept = (flat >= 0) & (flat < case.E)
    counts = torch.bincount(flat[kept], minlength=case.E)
    rows = x[torch.arange(case.T).repeat_interleave(case.top_k)]  # one row per slot
    order = torch.sort(torch.where(kept, flat, case.E), stable=True).indices
    x_sorted = rows[order].clone().requires_grad_()
    leaves = [w.clone().requires_grad_() for w in (w1, w2)]
    out = sonar_kernels.grouped_mlp(x_sorted, counts, *leaves, backend=backend)
    exact = [t.detach().double().requires_grad_() for t in (x_sorted, w1, w2)]
    expected = _per_expert(*exact, counts.tolist())
    assert_close(out, expected, torch.float32)
    grad_out = torch.randn(out.shape)
    out.backward(grad_out)
    expected.backward(grad_out.double())
    for name, leaf, ref in zip(
        ("x_sorted", "gate_up_proj", "down_proj"), (x_sorted, *leaves), exact, strict=True
    ):
        assert_close(leaf.grad, ref.grad, torch.float32, what=name)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_grouped_mlp_updates_the_experts_in_the_backward_like_torch_adamw(backend):
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    x, w1, w2 = _inputs(torch.float32)
    weights = [torch.nn.Parameter(w.clone()) for w in (w1, w2)]
    sonar_kernels.specs.mark_expert_tensors(*weights)
    optimizer = sonar_kernels.ExpertAdamW(weights, **hyper)
    reference = [torch.nn.Parameter(w.double()) for w in (w1, w2)]
    torch_adamw = torch.optim.AdamW(reference, **hyper)
    counts = torch.tensor(COUNTS)
    for step in range(2):
        grad_out = torch.randn(N, H, generator=torch.Generator().manual_seed(step))
        sonar_kernels.grouped_mlp(x, counts, *weights, backend=backend).backward(grad_out)
        assert all(w.grad is None for w in weights)  # updated in the backward, no gradient kept
        optimizer.step()
        _per_expert(x.double(), *reference, COUNTS).backward(grad_out.double())
        torch_adamw.step()
        torch_adamw.zero_grad()
    for name, w, ref in zip(("gate_up_proj", "down_proj"), weights, reference, strict=True):
        assert_close(w, ref, torch.float32, what=name)
        assert_close(optimizer.state[w]["exp_avg"], torch_adamw.state[ref]["exp_avg"], torch.float32)
        assert float(optimizer.state[w]["step"]) == 2


def test_grouped_mlp_refuses_bad_counts_before_any_kernel():
    x, w1, w2 = _inputs(torch.float32)
    for counts, error, words in (
        (torch.tensor([5.0, 0, 7, 3]), TypeError, "integer dtype"),
        (torch.tensor([5, 0, 7]), ValueError, "shape [E] = [4]"),
        (torch.tensor([[5, 0, 7, 3]]), ValueError, "shape [E] = [4]"),
        (torch.tensor([5, 0, 7, 30]), ValueError, "sum to at most x_sorted.shape[0] = 18"),
        (torch.tensor([5, -1, 7, 3]), ValueError, ">= 0"),
        ([5, 0, 7, 3], TypeError, "num_tokens_per_expert must be a tensor"),
    ):
        with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
            sonar_kernels.grouped_mlp(x, counts, w1, w2, backend="torch")


def test_grouped_mlp_compiles_without_graph_breaks():
    x, w1, w2 = _inputs(torch.float32)
    counts = torch.tensor(COUNTS)

    def f(x, counts, w1, w2):
        return sonar_kernels.grouped_mlp(x, counts, w1, w2, backend="torch")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, counts, w1, w2), f(x, counts, w1, w2))
