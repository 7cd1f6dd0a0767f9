"""One expert-MLP layer by each provider, timed with pytest-benchmark, and its peak memory in a separate
pass (providers.peak_bytes: torch's MemTracker on the CPU, the CUDA allocator on a GPU) (`make bench`): the training step (forward, backward, AdamW update) of every
provider, and the forward and the forward+backward of the sonar kernels and of standard
(providers.PHASES).

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


PHASE_PROVIDERS = [(phase, name) for phase in providers.PHASES for name in providers.phase_providers(phase)]


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("phase", "provider"), PHASE_PROVIDERS, ids=[f"{p}-{n}" for p, n in PHASE_PROVIDERS])
def test_layer(benchmark, phase, provider, shape, routing):
    device = "cuda" if CUDA else "cpu"
    inputs = providers.make_inputs(providers.SHAPES[shape], DTYPE, device, routing=routing)
    step = providers.build(provider, inputs, backend="triton")
    step.run()  # warm-up: compiles the kernels, creates the optimizer state
    fn = step.phase(phase)
    fn()  # the forward-only kernels compile here
    peak = providers.peak_bytes(step, phase)
    benchmark.group = f"{shape} {routing} {phase}"
    benchmark.extra_info.update(
        provider=provider, phase=phase, shape=shape, routing=routing, device=device, dtype=str(DTYPE),
        flops=providers.SHAPES[shape].phase_flops(phase), peak_bytes=peak, experts=step.experts,
    )  # fmt: skip

    def run():
        fn()
        if CUDA:
            torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
