"""The device time of each kernel launch inside a layer's training step, and of each grouped GEMM against
torch.mm on the same shape and FLOPs (the dense roofline of the issue "Benchmarks ...").

:func:`timed_kernels` swaps every Triton kernel that ``sonar_kernels.ops`` launches for a stand-in that
brackets the launch with CUDA events (``time.perf_counter`` on the CPU, where the interpreter runs the
kernel synchronously); nothing else changes and no host sync is added inside the step. Each launch is
labelled from its arguments: the grouped GEMM that reads W2 is the forward's down projection, the one
that reads W1 the dgrad dX; a wgrad launch that gathers dO by token is dW2's, the other dW1's, with its
epilogue ("check", "adamw" for the fused update, "store" for a plain gradient); the split path's AdamW
kernel is named by the weight it updates; the combine with routing weights is the forward's. The time of
a label is summed over its launches in one step (a recomputed forward would count twice).

On CUDA each timed step starts behind ``torch.cuda._sleep``, so the GPU is still busy when the host
launches the step's kernels: an event pair then brackets the kernel, not the host's launch latency.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import triton

from sonar_kernels import ops

NAMES = {
    "routing_histogram_kernel": "routing histogram",
    "routing_scan_kernel": "routing scan",
    "routing_scatter_kernel": "routing scatter",
    "expert_mlp_fwd_up_kernel": "up",
    "expert_mlp_bwd_dhpre_kernel": "dgrad G",
    "expert_mlp_bwd_dweights_kernel": "routing-weight grad",
    # The bias-corrected step size of one update (one program; both weights' launches share the label).
    "adamw_scalars_kernel": "adamw scalars",
}
# About 25 ms of GPU time at the H200's clock: longer than the host needs to launch one layer's step.
SLEEP_CYCLES = 50_000_000


def label(name: str, args: tuple, kwargs: dict, gate_up_proj, down_proj) -> str:
    """The label of one launch of kernel ``name`` (see the module docstring)."""
    if name == "expert_mlp_grouped_mm_kernel":
        return "down" if args[1].data_ptr() == down_proj.data_ptr() else "dgrad dX"
    if name == "expert_mlp_combine_kernel":
        return "combine" if kwargs["HAS_WEIGHTS"] else "combine dX"
    if name == "expert_mlp_bwd_dw_kernel":
        return f"wgrad {'dW2' if kwargs['P_FROM_TOKENS'] else 'dW1'} {kwargs['EPILOGUE']}"
    if name == "adamw_kernel":
        return "adamw dW2" if args[0].data_ptr() == down_proj.data_ptr() else "adamw dW1"
    return NAMES.get(name, name)


class _Timed:
    """Stands in for one @triton.jit kernel: ``kernel[grid](...)`` launches it between two timestamps."""

    def __init__(self, kernel, name: str, log: list, cuda: bool, weights):
        self.kernel, self.name, self.log, self.cuda, self.weights = kernel, name, log, cuda, weights

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
            self.log.append((label(self.name, args, kwargs, *self.weights), start, end))
            return out

        return launch


@contextlib.contextmanager
def timed_kernels(cuda: bool, gate_up_proj: torch.Tensor, down_proj: torch.Tensor):
    """Within the block, every launch by ``sonar_kernels.ops`` appends (label, start, end) to the
    yielded list; ``None`` entries appended by the caller separate steps. ``gate_up_proj`` and
    ``down_proj`` are the layer's weights (they name the launches that read them)."""
    log: list = []
    # The launcher modules, each with the kernels it launches.
    originals = {
        (module, n): v
        for module in (ops.forward, ops.backward, ops.wgrad)
        for n, v in vars(module).items()
        if isinstance(v, triton.runtime.KernelInterface)
    }
    try:
        for (module, name), kernel in originals.items():
            setattr(module, name, _Timed(kernel, name, log, cuda, (gate_up_proj, down_proj)))
        yield log
    finally:
        for (module, name), kernel in originals.items():
            setattr(module, name, kernel)


def _seconds(start, end) -> float:
    return start.elapsed_time(end) / 1000 if isinstance(start, torch.cuda.Event) else end - start


def per_kernel_seconds(log: list) -> dict[str, float]:
    """Median seconds per launch label over the steps in ``log`` (after torch.cuda.synchronize())."""
    steps, current = [], {}
    for entry in [*log, None]:
        if entry is None:
            if current:
                steps.append(current)
            current = {}
            continue
        name, start, end = entry
        current[name] = current.get(name, 0.0) + _seconds(start, end)
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
        FLOPs over its time), "fraction_of_torch_mm" (torch.mm's time on the same shape over the
        kernel's: 1.0 means as fast as the dense GEMM) and "gemm_only" (False for the fused AdamW
        epilogue, which also reads and writes W, exp_avg and exp_avg_sq).
    """
    with timed_kernels(cuda, *step.params) as log:
        for _ in range(rounds):
            if cuda:
                torch.cuda._sleep(SLEEP_CYCLES)
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
                gemm_only=not label.endswith(" adamw"),
            )
        out[label] = row
    return out
