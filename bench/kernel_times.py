"""The device time of each kernel launch inside a layer's training step, and of each grouped GEMM against
torch.mm on the same shape and FLOPs (the dense roofline of the issue "Benchmarks ...").

:func:`timed_kernels` swaps every Triton kernel that ``sonar_kernels.ops`` launches for a stand-in that
brackets the launch with CUDA events (``time.perf_counter`` on the CPU, where the interpreter runs the
kernel synchronously); nothing else changes and no host sync is added inside the step. Launches are
labelled by the launch order that ``ops.moe_mlp_bwd`` documents: the forward's up projection (with the
activation) and down projection, then dHpre (the dgrad G = dO W2), dW2, the routing-weight reduction, dX,
and dW1; each wgrad is one launch per epilogue ("check", "adamw" for the fused update, "store" for a
plain gradient), followed on the split path by the AdamW kernel.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter

import torch
import triton

from sonar_kernels import ops

# kernel -> labels of its 1st, 2nd ... launch in one step ({} in a label: the wgrad epilogue)
LABELS = {
    "_routing_metadata_kernel": ("routing metadata",),
    "_expert_mlp_fwd_up_kernel": ("up",),
    "_expert_mlp_grouped_mm_kernel": ("down", "dgrad dX"),
    "_expert_mlp_combine_kernel": ("combine", "combine dX"),
    "_expert_mlp_bwd_dhpre_kernel": ("dgrad G",),
    "_expert_mlp_bwd_dweights_kernel": ("routing-weight grad",),
    "_expert_mlp_bwd_dw_kernel": ("wgrad dW2 {}", "wgrad dW1 {}"),
    "_adamw_kernel": ("adamw dW2", "adamw dW1"),
}


class _Timed:
    """Stands in for one @triton.jit kernel: ``kernel[grid](...)`` launches it between two timestamps."""

    def __init__(self, kernel, name: str, log: list, cuda: bool):
        self.kernel, self.name, self.log, self.cuda = kernel, name, log, cuda

    def __getitem__(self, grid):
        launcher = self.kernel[grid]

        def launch(*args, **kwargs):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = launcher(*args, **kwargs)
                end.record()
            else:
                start = time.perf_counter()
                out = launcher(*args, **kwargs)
                end = time.perf_counter()
            self.log.append((self.name, kwargs.get("EPILOGUE"), start, end))
            return out

        return launch


@contextlib.contextmanager
def timed_kernels(cuda: bool):
    """Within the block, every launch by ``sonar_kernels.ops`` appends (kernel name, wgrad epilogue or
    None, start, end) to the yielded list; ``None`` entries appended by the caller separate steps."""
    log: list = []
    names = [n for n, v in vars(ops).items() if isinstance(v, triton.runtime.KernelInterface)]
    originals = {n: getattr(ops, n) for n in names}
    try:
        for name, kernel in originals.items():
            setattr(ops, name, _Timed(kernel, name, log, cuda))
        yield log
    finally:
        for name, kernel in originals.items():
            setattr(ops, name, kernel)


def _seconds(start, end) -> float:
    return start.elapsed_time(end) / 1000 if isinstance(start, torch.cuda.Event) else end - start


def per_kernel_seconds(log: list) -> dict[str, float]:
    """Median seconds per launch label over the steps in ``log`` (after torch.cuda.synchronize())."""
    steps, current = [], {}
    seen = Counter()
    for entry in [*log, None]:
        if entry is None:
            if current:
                steps.append(current)
            current, seen = {}, Counter()
            continue
        name, epilogue, start, end = entry
        labels = LABELS.get(name, (name,))
        label = labels[min(seen[name, epilogue], len(labels) - 1)].format(epilogue)
        seen[name, epilogue] += 1
        current[label] = current.get(label, 0.0) + _seconds(start, end)
    return (
        {label: statistics.median(s[label] for s in steps if label in s) for label in steps[0]}
        if steps
        else {}
    )


def kernel_table(step, gemms: dict[str, tuple[int, int, int]], mm_seconds: dict[str, float], cuda: bool,
                 rounds: int) -> dict:  # fmt: skip
    """Time ``rounds`` steps of ``step`` (a built, warmed-up providers.Step) kernel by kernel.

    Args:
        gemms: (M, K, N) of the layer's GEMMs by name ("up", "down", "dgrad G", "dgrad dX", "wgrad dW2",
            "wgrad dW1"; see gpu_bench.gemm_shapes).
        mm_seconds: torch.mm's seconds on each of those shapes, measured in the same run.
    Returns:
        label -> {"seconds"}, and for the launches that compute a GEMM, also "gemm", "tflops" (its 2·M·K·N
        FLOPs over its time) and "fraction_of_torch_mm" (torch.mm's time on the same shape over the
        kernel's: 1.0 means as fast as the dense GEMM).
    """
    with timed_kernels(cuda) as log:
        for _ in range(rounds):
            step.run()
            log.append(None)
    if cuda:
        torch.cuda.synchronize()
    out = {}
    for label, seconds in per_kernel_seconds(log).items():
        row = {"seconds": seconds}
        gemm = next((g for g in gemms if label == g or label.startswith(g + " ")), None)
        if gemm is not None and not label.endswith(" check"):  # the check pass only recomputes to flag
            M, K, N = gemms[gemm]
            row.update(
                gemm=gemm,
                tflops=2 * M * K * N / seconds / 1e12,
                fraction_of_torch_mm=mm_seconds[gemm] / seconds,
            )
        out[label] = row
    return out
