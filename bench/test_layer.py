"""One expert-MLP layer's training step (forward, backward, AdamW update) by each provider, timed with
pytest-benchmark, and its peak memory from torch's MemTracker in a separate pass (`make bench`).

On a CUDA machine: the OLMoE-1B-7B and Granite-3.1-3B-A800M layer shapes. On the CPU the sonar kernels
run under the Triton interpreter, so only the tiny CPU shape, with an explicit, small number of rounds:
those timings are CPU timings, not kernel performance (the memory accounting is meaningful).
"""

import providers
import pytest
import torch

CUDA = torch.cuda.is_available()
SHAPES = ("olmoe-1b-7b", "granite-3.1-3b-a800m") if CUDA else ("cpu-tiny",)
DTYPE = torch.bfloat16 if CUDA else torch.float32
ROUNDS = 20 if CUDA else 3


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("provider", providers.PROVIDERS)
def test_layer_step(benchmark, provider, shape, routing):
    device = "cuda" if CUDA else "cpu"
    inputs = providers.make_inputs(providers.SHAPES[shape], DTYPE, device, routing=routing)
    step = providers.build(provider, inputs, backend="triton")
    step.run()  # warm-up: compiles the kernels, creates the optimizer state
    peak = providers.peak_bytes(step)
    benchmark.group = f"{shape} {routing}"
    benchmark.extra_info.update(
        provider=provider, shape=shape, routing=routing, device=device, dtype=str(DTYPE),
        flops=providers.SHAPES[shape].flops(), peak_bytes=peak, experts=step.experts,
    )  # fmt: skip

    def run():
        step.run()
        if CUDA:
            torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
