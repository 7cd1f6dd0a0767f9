"""A training step of a model with sonar experts captured in a CUDA graph (torch.cuda.graphs) and replayed,
bitwise equal to the same steps run eagerly (docs/benchmarks.md, "The host path of a layer step"). The
library promises no host sync and no allocation whose size depends on the data on the kernel path; this is
where that promise is shown on a GPU. Skipped without CUDA: the CPU checks what it can statically
(tests/test_host_path.py: no op that reads a value back to the host or sizes a tensor by its values)."""

import pytest
import torch

import sonar_kernels

T, H, I, E, TOP_K = 64, 64, 32, 5, 2
STEPS, WARMUP = 3, 3


class _Model(torch.nn.Module):
    """A dense projection, a router, sonar experts and a dense head: both kinds of parameters train."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(H, H)
        self.router = torch.nn.Linear(H, E, bias=False)
        self.experts = sonar_kernels.SonarExperts(E, H, I, backend="triton")
        self.head = torch.nn.Linear(H, H)

    def forward(self, x, y):
        h = self.inp(x)
        top, index = torch.softmax(self.router(h), dim=-1).topk(TOP_K, dim=-1)
        out = self.head(h + self.experts(h, index, top))
        return torch.nn.functional.mse_loss(out, y)


def _build(device):
    torch.manual_seed(0)
    model = _Model().to(device)
    experts = [model.experts.gate_up_proj, model.experts.down_proj]
    dense = [p for n, p in model.named_parameters() if not n.startswith("experts.")]
    expert_opt = sonar_kernels.ExpertAdamW(experts, lr=1e-3, weight_decay=0.1)
    # capturable: torch's AdamW keeps its step on the device, as a graph needs.
    dense_opt = torch.optim.AdamW(dense, lr=1e-3, weight_decay=0.1, capturable=True)
    return model, expert_opt, dense_opt


def _step(model, expert_opt, dense_opt, x, y):
    model(x, y).backward()
    dense_opt.step()
    expert_opt.step()


def _state(model, expert_opt, dense_opt):
    out = [p.detach().clone() for p in model.parameters()]
    for opt in (expert_opt, dense_opt):
        for state in opt.state.values():
            out += [t.clone() for t in state.values() if isinstance(t, torch.Tensor)]
    return out


@pytest.mark.gpu
def test_a_training_step_with_sonar_experts_replays_in_a_cuda_graph_bitwise():
    device = "cuda"
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(T, H, generator=generator).to(device), torch.randn(T, H, generator=generator).to(device))
        for _ in range(WARMUP + STEPS)
    ]
    # Eager: every step in order.
    eager = _build(device)
    for x, y in batches:
        _step(*eager, x, y)
        eager[2].zero_grad(set_to_none=True)
    expected = _state(*eager)

    # Graphed: the warm-up steps eagerly on a side stream (kernels built, optimizer state and tile choices
    # made), then one step captured and replayed for the rest, its inputs copied into static tensors.
    graphed = _build(device)
    static_x, static_y = torch.empty_like(batches[0][0]), torch.empty_like(batches[0][1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in batches[:WARMUP]:
            _step(*graphed, x, y)
            graphed[2].zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(*graphed, static_x, static_y)
    for x, y in batches[WARMUP:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
    torch.cuda.synchronize()
    got = _state(*graphed)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b), f"{float((a != b).float().mean()):.2e} of the elements differ"
    # The expert step counts advanced on the device in every replay.
    assert float(graphed[1].state[graphed[0].experts.gate_up_proj]["step"]) == WARMUP + STEPS
