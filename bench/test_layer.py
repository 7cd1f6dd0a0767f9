"""One expert-MLP layer by each provider, timed with pytest-benchmark, and its peak memory in a separate
pass (providers.peak_bytes: torch's MemTracker on the CPU, the CUDA allocator on a GPU) (`make bench`): the
training step (forward, backward, AdamW update) of every provider, and the forward and the
forward+backward of the sonar kernels and of standard (providers.PHASES).

On a CUDA machine: the Triton backend at the OLMoE-1B-7B and Granite-3.1-3B-A800M layer shapes. On the
CPU: the torch backend (the path CPU users run: torch's grouped GEMM) at sonar-train's tiny-olmoe layer
and a larger layer, uniform routing; the Triton interpreter is not timed (it says nothing about speed;
tests/test_bench_providers.py runs it for correctness). ``SONAR_BENCH_SHAPES`` (comma-separated names of
providers.SHAPES) overrides the shapes.
"""

import os

import providers
import pytest
import torch

CUDA = torch.cuda.is_available()
DEFAULT_SHAPES = ("olmoe-1b-7b", "granite-3.1-3b-a800m") if CUDA else ("tiny-olmoe", "cpu-large")
SHAPES = tuple(filter(None, os.environ.get("SONAR_BENCH_SHAPES", "").split(","))) or DEFAULT_SHAPES
ROUTINGS = ("uniform", "skewed") if CUDA else ("uniform",)
BACKEND = "triton" if CUDA else "torch"
DTYPE = torch.bfloat16 if CUDA else torch.float32
ROUNDS = 20 if CUDA else 5


PHASE_PROVIDERS = [(phase, name) for phase in providers.PHASES for name in providers.phase_providers(phase)]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("phase", "provider"), PHASE_PROVIDERS, ids=[f"{p}-{n}" for p, n in PHASE_PROVIDERS])
def test_layer(benchmark, phase, provider, shape, routing):
    device = "cuda" if CUDA else "cpu"
    inputs = providers.make_inputs(providers.SHAPES[shape], DTYPE, device, routing=routing)
    step = providers.build(provider, inputs, backend=BACKEND)
    step.run()  # warm-up: compiles the kernels, creates the optimizer state
    fn = step.phase(phase)
    fn()  # the forward-only kernels compile here
    peak = providers.peak_bytes(step, phase)
    benchmark.group = f"{shape} {routing} {phase}"
    benchmark.extra_info.update(
        provider=provider, phase=phase, shape=shape, routing=routing, device=device, dtype=str(DTYPE),
        flops=providers.SHAPES[shape].phase_flops(phase), peak_bytes=peak, experts=step.experts,
        backend=BACKEND, threads=torch.get_num_threads(),
    )  # fmt: skip

    def run():
        fn()
        if CUDA:
            torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
