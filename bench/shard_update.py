"""FSDP2 shards with 8-bit moments, a remainder or stochastic rounding (issue 61, item 3): the update launches
per tensor per step on the GPU path, counted under the Triton interpreter, and the CPU time of the sharded
update (the compiled rules) against the exact update (torch's fused AdamW) on the same shard.

    python bench/shard_update.py [--shape E R C] [--repeats 3]

Run on the CPU with TRITON_INTERPRET=1 (set here when CUDA is absent). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sonar_kernels.kernels import adamw as adamw_kernels
from sonar_kernels.kernels import moments_8bit as kernels_8bit
from sonar_kernels.ops import shard_update
from sonar_kernels.ops.fp64_update import UPDATE_ELEMENTS, adamw_8bit_
from sonar_kernels.rules.moments_8bit import scales_shape

HYPER = torch.tensor([1e-3, 0.9, 0.95, 1e-8, 0.1], dtype=torch.float64)


def _state_8bit(weight, extra=()):
    counters = [
        torch.tensor(1.0),
        torch.zeros(()),
        torch.zeros((), dtype=torch.int64),
        torch.zeros((), dtype=torch.int32),
    ]
    m = torch.zeros(weight.shape, dtype=torch.int8)
    v = torch.zeros(weight.shape, dtype=torch.uint8)
    s = scales_shape(tuple(weight.shape))
    return [m, v, *counters, torch.zeros(s), torch.zeros(s), *extra]


class _Counted:
    """A Triton kernel whose launches (``kernel[grid](...)``) are counted."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def launches(kind: str) -> int:
    """Triton launches of one shard's update (a small shard: the count does not depend on its size)."""
    weight = torch.randn(2, 4, 64).to(torch.float32 if kind == "8bit" else torch.bfloat16)
    grad = torch.randn_like(weight)
    counted = [_Counted(kernels_8bit.adamw_8bit_kernel), _Counted(adamw_kernels.adamw_kernel)]
    kernels_8bit.adamw_8bit_kernel, shard_update.adamw_kernel = counted
    try:
        if kind == "stochastic":
            state = [
                torch.zeros_like(weight, dtype=torch.float32),
                torch.zeros_like(weight, dtype=torch.float32),
            ]
            state += [*_state_8bit(weight)[2:6], torch.tensor(3, dtype=torch.int64)]
            moments, seed, remainder = (state[0], state[1]), state[6], None
        else:
            extra = {"8bit": [], "8bit-remainder": [torch.zeros(weight.shape, dtype=torch.int16)],
                     "8bit-stochastic": [torch.tensor(3, dtype=torch.int64)]}[kind]  # fmt: skip
            state = _state_8bit(weight, extra)
            moments = (state[0], state[6], state[1], state[7])
            remainder = extra[0] if kind == "8bit-remainder" else None
            seed = extra[0] if kind == "8bit-stochastic" else None
        shard_update.shard_update_triton_(
            weight, grad, moments, state, HYPER, decided=torch.tensor(False), remainder=remainder, seed=seed
        )
    finally:
        kernels_8bit.adamw_8bit_kernel, shard_update.adamw_kernel = (c.kernel for c in counted)
    return sum(c.launches for c in counted)


def cpu_times(shape, repeats: int) -> tuple[float, float]:
    """Median seconds of the sharded 8-bit update (the CPU's compiled rules, a whole shard's gradient) and of
    torch's fused AdamW (fp32 moments) on a tensor of ``shape``, fp32."""
    torch.manual_seed(0)
    weight = torch.randn(shape)
    grad = torch.randn(shape)
    state = _state_8bit(weight)
    exp_avg, exp_avg_sq = torch.zeros_like(weight), torch.zeros_like(weight)
    step = torch.tensor(0.0)

    def sharded():
        adamw_8bit_(weight, grad, None, state, HYPER, grad_dtype=torch.float32, chunk_bytes=None)

    def exact():
        torch._fused_adamw_(
            [weight], [grad], [exp_avg], [exp_avg_sq], [], [step], amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.95,
            weight_decay=0.1, eps=1e-8, maximize=False,
        )  # fmt: skip

    times = []
    for fn in (sharded, exact):
        fn()  # warm-up (the rule's compilation)
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - start)
        times.append(statistics.median(runs))
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[16, 768, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for kind in ("8bit", "8bit-remainder", "8bit-stochastic", "stochastic"):
        print(f"{kind}: {launches(kind)} Triton update launch(es) per tensor per step on a shard")
    qwen_shard = 128 * 1536 * 2048 // 8  # Qwen3-30B-A3B's gate_up_proj on FSDP2 x 8
    print(f"before (torch rules on CUDA): {-(-qwen_shard // UPDATE_ELEMENTS)} slices of {UPDATE_ELEMENTS} elements "
          "for a Qwen3-30B-A3B gate_up_proj shard at FSDP2 x 8, about 40 ops each")  # fmt: skip
    sharded, exact = cpu_times(tuple(args.shape), args.repeats)
    numel = torch.Size(args.shape).numel()
    print(f"CPU, {torch.get_num_threads()} threads, shard {tuple(args.shape)} fp32 ({numel} elements): sharded 8-bit "
          f"{sharded * 1e3:.1f} ms, exact (torch fused AdamW) {exact * 1e3:.1f} ms, ratio {sharded / exact:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
