"""FSDP2 shards with 8-bit moments, a remainder or stochastic rounding (issue 61, item 3): for each kind, the
update launches per tensor per step on the GPU path, counted by the dry run (``bench/dry_run.py``: fake tensors
at a Qwen3-30B-A3B shard's shape, each Triton launch recorded as sm_90a's JIT compiles it), and the CPU time
of the sharded update (the C update, ``ops/torch_backend/cpu_update.py``, where a C compiler exists; else the compiled
rule) against the exact update on an fp32 shard of the same shape: torch's fused AdamW alone, and
as the library runs it for a shard with exact moments (``ops/torch_backend/adamw.py``'s ``torch_adamw_``: the same skip check
and norm, then the fused AdamW; the fair ratio; also on a shard of the kind's own weight and gradient dtype),
median and p10-p90 of interleaved repeats.

    PYTHONPATH=. python bench/shard_update.py [--shape E R C] [--repeats 11] [--kinds 8bit ...] [--threads N]
        [--clock wall|cpu]

Run without TRITON_INTERPRET (the dry run records the JIT's launches; tests/test_shard_update.py runs the same
launches under the interpreter and proves their bits). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from sonar_kernels.ops.torch_backend.fp64_update import UPDATE_ELEMENTS, adamw_8bit_, stochastic_adamw_
from sonar_kernels.ops.triton_backend import shard_update
from sonar_kernels.rules.moments_8bit import quantize, scales_shape, tables

# The tables are made once per device and kept (rules/moments_8bit.py): made here, for real, before a dry
# run's fake tensor mode could make (and keep) a fake one.
tables("cpu")

HYPER = torch.tensor([1e-3, 0.9, 0.95, 1e-8, 0.1], dtype=torch.float64)
KINDS = ("8bit", "8bit-remainder", "8bit-stochastic", "stochastic")


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


def dry_run_launches(kind: str, shape) -> tuple[int, int, int]:
    """(Triton launches, torch ops over the shard's elements, torch ops on 0-dim scalars) of one shard's
    update on the GPU path (``ops/triton_backend/shard_update.py``) at ``shape``, under ``bench/dry_run.py``'s dry run:
    fake tensors (no memory, no time), each Triton launch recorded as sm_90a's JIT would compile it, each
    torch op seen by a dispatch mode. The caller's skip check and norm over the whole gradient (two
    reductions and their collectives, ``ops/torch_backend/fp64_update.py``) are not in it."""
    from dry_run import dry_run
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            if tensors and func._schema.name.startswith("aten::") and not func.is_view:  # a view runs nothing
                self.sizes.append(max(t.numel() for t in tensors))
            return func(*args, **(kwargs or {}))

    with dry_run() as recorded:
        weight, grad, moments, state, remainder, seed = _shard(kind, shape, torch.empty)
        ops = _Ops()
        with ops:
            shard_update.shard_update_triton_(
                weight,
                grad,
                moments,
                state,
                HYPER,
                decided=torch.tensor(False),
                remainder=remainder,
                seed=seed,
            )
    triton = sum(v.launches for v in recorded.variants.values())
    return (
        triton,
        sum(size >= weight.numel() // 32 for size in ops.sizes),
        sum(size <= 2 for size in ops.sizes),
    )


def _shard(kind: str, shape, make):
    """(weight, grad, moments, state, remainder, seed) of a shard of ``kind``, tensors made by ``make``
    (``torch.empty`` under the dry run)."""
    dtype = torch.float32 if kind == "8bit" else torch.bfloat16
    weight, grad = make(shape, dtype=dtype), make(shape, dtype=dtype)
    counters = _state_8bit(torch.zeros(1, 32))[2:6]
    if kind == "stochastic":
        state = [
            make(shape, dtype=torch.float32),
            make(shape, dtype=torch.float32),
            *counters,
            torch.tensor(3),
        ]
        return weight, grad, (state[0], state[1]), state, None, state[6]
    extra = {
        "8bit": [],
        "8bit-remainder": [make(shape, dtype=torch.int16)],
        "8bit-stochastic": [torch.tensor(3)],
    }
    scales = scales_shape(tuple(shape))
    state = [make(shape, dtype=torch.int8), make(shape, dtype=torch.uint8), *counters,
             make(scales, dtype=torch.float32), make(scales, dtype=torch.float32), *extra[kind]]  # fmt: skip
    remainder = extra[kind][0] if kind == "8bit-remainder" else None
    seed = extra[kind][0] if kind == "8bit-stochastic" else None
    return weight, grad, (state[0], state[6], state[1], state[7]), state, remainder, seed


def _problem(kind: str, shape):
    """(update, its state list, weight, gradient) of ``kind`` on a tensor of ``shape``: fp32 weight and
    gradient for 8-bit moments alone, bf16 otherwise (the remainder and stochastic rounding are bf16 kinds),
    moments of one earlier step's size."""
    torch.manual_seed(0)
    dtype = torch.float32 if kind == "8bit" else torch.bfloat16
    weight = torch.randn(shape).to(dtype)
    grad = (1e-2 * torch.randn(shape)).to(dtype)
    counters = _state_8bit(weight)[2:6]
    counters[0].fill_(3.0)
    if kind == "stochastic":
        moments = [1e-3 * torch.randn(shape), 1e-6 * torch.rand(shape)]
        return stochastic_adamw_, [*moments, *counters, torch.tensor(3, dtype=torch.int64)], weight, grad
    m_codes, m_scales = quantize(1e-3 * torch.randn(shape), "exp_avg")
    v_codes, v_scales = quantize(1e-6 * torch.rand(shape), "exp_avg_sq")
    extra = {"8bit": [], "8bit-remainder": [torch.randint(-(2**15), 2**15, shape, dtype=torch.int32).to(torch.int16)],
             "8bit-stochastic": [torch.tensor(3, dtype=torch.int64)]}[kind]  # fmt: skip
    return adamw_8bit_, [m_codes, v_codes, *counters, m_scales, v_scales, *extra], weight, grad


def cpu_times(kind: str, shape, repeats: int, clock=time.perf_counter) -> tuple[list[float], ...]:
    """Seconds of each repeat, interleaved so that all see the same load, on a tensor of ``shape``, of: the
    update of ``kind`` (a whole shard's gradient, as FSDP2's shard update runs it on the CPU: the skip
    check, the norm, then the rule; ``ops/torch_backend/fp64_update.py``); torch's fused AdamW alone (fp32 weight,
    gradient and moments); and the exact update as the library runs it for a shard with exact moments
    (``ops/torch_backend/adamw.py``'s ``torch_adamw_``, what SonarAdamW calls for an FSDP2 expert shard without 8-bit
    moments: the same skip check and norm over the whole gradient, then torch's fused AdamW with the skip
    as its ``found_inf``), the fair baseline; and that exact update on a shard of the kind's weight and gradient
    dtype (bf16 but for "8bit"; the moments in that dtype, the library's default), timed apart only for a bf16
    kind (for "8bit" it is the fp32 one). ``clock``: ``time.perf_counter`` (wall), or
    ``time.process_time`` (the process's CPU time over its threads: what other processes' load leaves
    alone on a shared machine, though not the cache they share)."""
    from sonar_kernels.ops.torch_backend.adamw import torch_adamw_

    update, state, weight, grad = _problem(kind, shape)
    exact_weight, exact_grad = torch.randn(shape), 1e-2 * torch.randn(shape)
    exp_avg, exp_avg_sq, step = torch.zeros(shape), torch.zeros(shape), torch.tensor(0.0)
    library = [torch.randn(shape), 1e-2 * torch.randn(shape), torch.zeros(shape), torch.zeros(shape)]
    same = [t.to(weight.dtype) for t in library]
    library_step, norm_sq, skipped = torch.tensor(0.0), torch.zeros(()), torch.zeros((), dtype=torch.int64)
    lr, beta1, beta2, eps, weight_decay = HYPER.tolist()

    def sharded():
        update(weight, grad, None, state, HYPER, grad_dtype=grad.dtype, chunk_bytes=None)

    def exact():
        torch._fused_adamw_(
            [exact_weight], [exact_grad], [exp_avg], [exp_avg_sq], [], [step], amsgrad=False, lr=1e-3,
            beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, maximize=False,
        )  # fmt: skip

    def exact_library(tensors=library):
        torch_adamw_(
            *tensors, library_step, (lr, beta1, beta2, eps, weight_decay), norm_sq, skipped, foreach=None,
            fused=True,
        )  # fmt: skip

    fns = [sharded, exact, exact_library]
    if weight.dtype != torch.float32:
        fns.append(lambda: exact_library(same))
    for fn in fns:  # warm-up (a compiled rule's or the C update's build)
        fn()
    times = tuple([] for _ in fns)
    for _ in range(repeats):
        for fn, runs in zip(fns, times, strict=True):
            start = clock()
            fn()
            runs.append(clock() - start)
    return times


def _spread(runs: list[float]) -> str:
    """median (p10-p90) in ms."""
    ordered = sorted(runs)
    p10, p90 = ordered[int(0.1 * (len(ordered) - 1))], ordered[math.ceil(0.9 * (len(ordered) - 1))]
    return f"{statistics.median(runs) * 1e3:.1f} ({p10 * 1e3:.1f}-{p90 * 1e3:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[16, 768, 1024])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own)")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="wall time, or the process's CPU time"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    qwen_shard = 128 * 1536 * 2048 // 8  # Qwen3-30B-A3B's gate_up_proj on FSDP2 x 8
    print(f"before issue 61 (torch rules on CUDA): {-(-qwen_shard // UPDATE_ELEMENTS)} slices of {UPDATE_ELEMENTS} "
          "elements for a Qwen3-30B-A3B gate_up_proj shard at FSDP2 x 8, about 40 ops each")  # fmt: skip
    numel = torch.Size(args.shape).numel()
    print(f"CPU: {torch.get_num_threads()} threads, shard {tuple(args.shape)} ({numel} elements), {args.repeats} "
          f"repeats, {args.clock} clock, load average {os.getloadavg()[0]:.2f}; C update (ops/torch_backend/cpu_update.py): "
          f"{'built' if _c_available() else 'not available (the compiled rule runs)'}")  # fmt: skip
    qwen = (128 // 8, 1536, 2048)
    print(
        f"GPU path, per tensor per step, by the dry run at a Qwen3-30B-A3B gate_up_proj shard {qwen}: Triton "
        "launches, and the torch ops of the update over the shard's elements and on 0-dim scalars (the caller's "
        "skip check and norm over the whole gradient, two reductions and their collectives, not included)"
    )
    print("kind | dry run: Triton launches, element ops, scalar ops | CPU ms, median (p10-p90) | fused AdamW "
          "alone ms | ratio to it | exact as the library runs it (skip check, norm, fused AdamW), fp32 ms | "
          "ratio to it (fair) | the same exact update in the kind's dtype ms | ratio to it")  # fmt: skip
    for kind in args.kinds:
        triton, elementwise, scalar = dry_run_launches(kind, qwen)
        clock = time.perf_counter if args.clock == "wall" else time.process_time
        sharded, exact, library, *same = cpu_times(kind, tuple(args.shape), args.repeats, clock)
        same = same[0] if same else library
        ratio = statistics.median(sharded) / statistics.median(exact)
        fair = statistics.median(sharded) / statistics.median(library)
        like = statistics.median(sharded) / statistics.median(same)
        print(f"{kind} | {triton}, {elementwise}, {scalar} | {_spread(sharded)} | {_spread(exact)} | "
              f"{ratio:.2f} | {_spread(library)} | {fair:.2f} | {_spread(same)} | {like:.2f}")  # fmt: skip


def _c_available() -> bool:
    try:
        from sonar_kernels.ops.torch_backend import cpu_update
    except ImportError:  # a checkout before the C update
        return False
    return cpu_update.available()


if __name__ == "__main__":
    main()
