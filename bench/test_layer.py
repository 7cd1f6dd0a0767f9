"""One expert-MLP layer by each provider, timed with pytest-benchmark, and its peak memory in a separate
pass (providers.peak_bytes: torch's MemTracker on the CPU, the CUDA allocator on a GPU) (`make bench`): the
training step (forward, backward, AdamW update) of every provider (providers.PROVIDERS: sonar, sonar-unfused,
paper-inbwd, per-expert-inbwd, standard-fused, standard), and the forward and the forward+backward of the
sonar expert MLP and of transformers' experts (providers.PHASES, providers.phase_providers).

On a CUDA machine: the Triton backend at the OLMoE-1B-7B and Granite-3.1-3B-A800M layer shapes. On the
CPU: the torch backend (the path CPU users run: torch's grouped GEMM) at sonar-train's tiny-olmoe layer
and a larger layer, uniform routing; the Triton interpreter is not timed (it says nothing about speed;
tests/test_bench_providers.py runs it for correctness). ``SONAR_BENCH_SHAPES`` (comma-separated names of
providers.SHAPES) overrides the shapes.

Each row is timed over enough rounds for its spread (p10-p90) to show, and records in its extra_info the
provider, phase, shape (name and T, H, I, E, top_k), peak_bytes, the layer's expert_grad_bytes, the
device, the versions and the commit (table.run_info). The table at the end (bench/conftest.py,
bench/table.py) gives every ratio as provider / standard-fused (below 1 is better) and says whether the
machine was quiet enough to compare them.
"""

import os
import time
from pathlib import Path

import providers
import pytest
import table
import torch

CUDA = torch.cuda.is_available()
DEFAULT_SHAPES = ("olmoe-1b-7b", "granite-3.1-3b-a800m") if CUDA else ("tiny-olmoe", "cpu-large")
SHAPES = tuple(filter(None, os.environ.get("SONAR_BENCH_SHAPES", "").split(","))) or DEFAULT_SHAPES
ROUTINGS = ("uniform", "skewed") if CUDA else ("uniform",)
BACKEND = "triton" if CUDA else "torch"
DTYPE = torch.bfloat16 if CUDA else torch.float32
# Rounds per row: about ROUND_BUDGET_S of timing, at least MIN_ROUNDS (enough for a p10-p90 spread), at
# most MAX_ROUNDS. On 2 idle CPU cores that was 15 to 58 rounds of cpu-large's rows and 100 of tiny-olmoe's,
# p90/p10 between 1.04 and 1.16 on every row; the whole run took about 2 minutes (7 on a busy machine), with
# the five providers before standard-fused was added.
MIN_ROUNDS, MAX_ROUNDS, ROUND_BUDGET_S = (30, 200, 2.0) if CUDA else (15, 100, 8.0)


def rounds_for(seconds: float) -> int:
    """Rounds for a phase that takes ``seconds`` once (see MIN_ROUNDS, MAX_ROUNDS, ROUND_BUDGET_S)."""
    return max(MIN_ROUNDS, min(MAX_ROUNDS, int(ROUND_BUDGET_S / max(seconds, 1e-9))))


# Device, its name, versions and commit: the same for every row of the run.
RUN_INFO = table.run_info(Path(__file__).resolve().parents[1])
PHASE_PROVIDERS = [(phase, name) for phase in providers.PHASES for name in providers.phase_providers(phase)]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("phase", "provider"), PHASE_PROVIDERS, ids=[f"{p}-{n}" for p, n in PHASE_PROVIDERS])
def test_layer(benchmark, phase, provider, shape, routing):
    inputs = providers.make_inputs(providers.SHAPES[shape], DTYPE, RUN_INFO["device"], routing=routing)
    step = providers.build(provider, inputs, backend=BACKEND)
    step.run()  # warm-up: compiles the kernels, creates the optimizer state
    fn = step.phase(phase)
    fn()  # the forward-only kernels compile here
    peak = providers.peak_bytes(step, phase)
    benchmark.group = f"{shape} {routing} {phase}"
    layer = providers.SHAPES[shape]
    benchmark.extra_info.update(
        provider=provider, phase=phase, shape=shape, **layer._asdict(), routing=routing, dtype=str(DTYPE),
        flops=layer.phase_flops(phase), peak_bytes=peak, expert_grad_bytes=layer.expert_grad_bytes(DTYPE),
        experts=step.experts, update=step.update, backend=BACKEND, threads=torch.get_num_threads(),
        **RUN_INFO,
    )  # fmt: skip

    def run():
        fn()
        if CUDA:
            torch.cuda.synchronize()

    start = time.perf_counter()
    run()
    benchmark.pedantic(run, rounds=rounds_for(time.perf_counter() - start), iterations=1, warmup_rounds=1)
