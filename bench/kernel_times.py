"""The device time of each kernel launch inside a layer's training step, each grouped GEMM against torch.mm
on the same shape and FLOPs, and each launch's roofline floor (docs/benchmarks.md, the `gemms` section).

:func:`timed_kernels` swaps every Triton kernel that ``sonar_kernels.ops`` launches for a stand-in that
brackets the launch with CUDA events (``time.perf_counter`` on the CPU, where the interpreter runs the
kernel synchronously); nothing else changes and no host sync is added inside the step. Each launch is
labelled from its arguments: the grouped GEMM that reads W2 is the forward's down projection, the one
that reads W1 the dgrad dX; a wgrad launch that gathers dO by token is dW2's, the other dW1's, with its
epilogue ("check", "adamw" for the fused update, "store" for a plain gradient); the split path's AdamW
kernel is named by the weight it updates; the combine with routing weights is the forward's. The time of
a label is summed over its launches in one step (a recomputed forward would count twice; the launches of a
wgrad or an update split by chunks of experts add up to the weight's).

On CUDA each timed step starts behind ``torch.cuda._sleep``, so the GPU is still busy when the host
launches the step's kernels: an event pair then brackets the kernel, not the host's launch latency.

The floor of a launch is max(its GEMM at torch.mm's rate on the same (M, K, N), its bytes at the copy
bandwidth), both measured in the same run; the bytes are :func:`traffic`'s. A wgrad launch is also set
against ``torch.bmm`` over equal per-expert slabs: its K per expert is S / E rows (512 at OLMoE-1B-7B and
4096 tokens), which one dense GEMM with K = S does not pay for.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
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
    # Before each update its skip, step and scalars; after it the telemetry (ops/triton_backend/update_steps.py).
    "update_begin_kernel": "update begin",
    "update_end_kernel": "update end",
    # The bound that spares the check pass (ops/triton_backend/update_bound.py): the layer's magnitudes, then every update's
    # flag in one launch (an update with a gradient to add launches its own).
    "bound_magnitudes_kernel": "update bound",
    "bound_table_kernel": "update flags",
    "bound_flag_kernel": "update flag",
    "expert_mlp_fwd_up_tma_kernel": "up",
}
# About 25 ms of GPU time at the H200's clock: longer than the host needs to launch one layer's step.
SLEEP_CYCLES = 50_000_000


def traffic(
    shape,
    *,
    activations: torch.dtype,
    weights: torch.dtype,
    moments: torch.dtype,
    routing_weights: torch.dtype,
) -> dict[str, dict[str, int]]:
    """The bytes each launch of a layer's step must move, by label: tensor -> bytes.

    Each tensor the launch reads or writes is counted once, in its dtype: a gathered operand (X, dO) at
    its own [T, H] size however many routed rows repeat its rows, a tensor that is read and written (the
    updated weight and its moments) twice. The routing indices and the workspaces passed between launches
    (row maps, the routing-weight partial sums, the check pass's flags) are left out: a few bytes per routed
    row, and the floor stays a lower bound. Launches that move none of the layer's tensors (the routing
    histogram, scan and scatter, the routing-weight gradient, the AdamW scalars, the check pass, which
    returns at once unless the gradient may overflow) have no entry.

    Args:
        shape: (T, H, I, E, top_k) of the layer (bench/providers.py's Shape).
        activations: dtype of X, dO and the activations (Hpre, A, dHpre, the rows of Y and of dX).
        weights: dtype of W1 [E, 2I, H] and W2 [E, H, I], and of a plain ("store") gradient.
        moments: dtype of exp_avg and exp_avg_sq.
        routing_weights: dtype of the routing weights [T, top_k].
    Returns:
        label -> {tensor: bytes}, labels as :func:`label` names the launches: the forward's up, down and
        combine, dgrad G, dgrad dX, combine dX, the update bound's magnitudes pass, and for dW2 and dW1 the wgrad with the AdamW epilogue
        ("adamw"), the wgrad that writes the gradient ("store") and the split path's AdamW ("adamw dW1").
    """
    T, H, I, E, top_k = shape
    S = T * top_k

    def nbytes(elements: int, dtype: torch.dtype) -> int:
        return elements * dtype.itemsize

    x = nbytes(T * H, activations)  # X, dO, the output and dX: [T, H]
    hpre, a, rows = nbytes(S * 2 * I, activations), nbytes(S * I, activations), nbytes(S * H, activations)
    routing = nbytes(T * top_k, routing_weights)
    w1, w2 = nbytes(E * 2 * I * H, weights), nbytes(E * H * I, weights)
    out = {
        "up": {"X": x, "W1": w1, "Hpre": hpre, "A": a},
        "down": {"A": a, "W2": w2, "Y rows": rows},
        "combine": {"Y rows": rows, "routing weights": routing, "out": x},
        # dHpre, with A recomputed (the forward frees it); its routing-weight partial sums are a workspace.
        "dgrad G": {"dO": x, "W2": w2, "Hpre": hpre, "routing weights": routing, "dHpre": hpre, "A": a},
        "dgrad dX": {"dHpre": hpre, "W1": w1, "dX rows": rows},
        "combine dX": {"dX rows": rows, "dX": x},
        # The largest |X|, |dO| and routing weight (the check pass's bound, ops/triton_backend/update_bound.py).
        "update bound": {"X": x, "dO": x, "routing weights": routing},
    }
    wgrads = {
        "dW2": ("W2", E * H * I, {"dO": x, "routing weights": routing, "A": a}),
        "dW1": ("W1", E * 2 * I * H, {"dHpre": hpre, "X": x}),
    }
    for grad, (weight, elements, operands) in wgrads.items():
        state = {
            f"{weight} (read, written)": 2 * nbytes(elements, weights),
            "exp_avg (read, written)": 2 * nbytes(elements, moments),
            "exp_avg_sq (read, written)": 2 * nbytes(elements, moments),
        }
        out[f"wgrad {grad} adamw"] = {**operands, **state}
        out[f"wgrad {grad} store"] = {**operands, grad: nbytes(elements, weights)}
        out[f"adamw {grad}"] = {grad: nbytes(elements, weights), **state}
    return out


def label(name: str, args: tuple, kwargs: dict, gate_up_proj, down_proj) -> str:
    """The label of one launch of kernel ``name`` (see the module docstring)."""
    if name == "expert_mlp_grouped_mm_kernel":
        return "down" if _same_storage(args[1], down_proj) else "dgrad dX"
    if name == "expert_mlp_grouped_mm_tma_kernel":  # args[1]: the weight's TMA descriptor
        return "down" if _same_storage(args[1].base, down_proj) else "dgrad dX"
    if name == "expert_mlp_combine_kernel":
        return "combine" if kwargs["HAS_WEIGHTS"] else "combine dX"
    if name == "expert_mlp_bwd_dw_kernel":
        return f"wgrad {'dW2' if kwargs['P_FROM_TOKENS'] else 'dW1'} {kwargs['EPILOGUE']}"
    if name == "adamw_kernel":
        return "adamw dW2" if _same_storage(args[0], down_proj) else "adamw dW1"
    return NAMES.get(name, name)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is a view of ``b``'s storage: a slice of some experts (a chunked launch), a reshaped or
    reinterpreted view (the weight as int16) included; also between fake tensors (the dry run), whose data
    pointers all start at 0."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


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
    # The launcher modules, each with the kernels it launches: every module of sonar_kernels.ops, so that a
    # launch is timed whichever of them launches it.
    modules = [m for n, m in list(sys.modules.items()) if n.startswith(f"{ops.__name__}.") and m is not None]
    originals = {
        (module, n): v
        for module in modules
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
                 rounds: int, *, moved: dict[str, dict[str, int]] | None = None, copy_gbs: float | None = None,
                 bmm_seconds: dict[str, float] | None = None) -> dict:  # fmt: skip
    """Time ``rounds`` steps of ``step`` (a built, warmed-up providers.Step) kernel by kernel.

    Args:
        gemms: (M, K, N) of the layer's GEMMs by name ("up", "down", "dgrad G", "dgrad dX", "wgrad dW2",
            "wgrad dW1"; see gpu_bench.gemm_shapes).
        mm_seconds: torch.mm's seconds on each of those shapes, measured in the same run.
        moved: :func:`traffic`'s bytes by label; with ``copy_gbs`` (the copy bandwidth measured in the same
            run, GB/s of read + write) each launch that has an entry gets its floor.
        bmm_seconds: torch.bmm's seconds over equal per-expert slabs, by wgrad GEMM name ("wgrad dW2",
            "wgrad dW1"), measured in the same run.
    Returns:
        label -> {"seconds"}, and for the launches that compute a GEMM, also "gemm", "tflops" (its 2·M·K·N
        FLOPs over its time), "fraction_of_torch_mm" (torch.mm's time on the same shape over the
        kernel's: 1.0 means as fast as the dense GEMM) and "gemm_only" (False for the fused AdamW
        epilogue, which also reads and writes W, exp_avg and exp_avg_sq). A launch in ``moved`` also gets
        "flops" (2·M·K·N, 0 for a launch without a GEMM), "bytes" and "bytes_by_tensor", "floor_gemm_s"
        (torch.mm's time on its GEMM, 0 without one), "floor_bytes_s" (its bytes at the copy bandwidth),
        "floor_s" (the larger) and "time_over_floor"; a wgrad launch in ``bmm_seconds``, "torch_bmm_s" and
        "time_over_torch_bmm".
    """
    with timed_kernels(cuda, *step.params) as log:
        for _ in range(rounds):
            if cuda:
                torch.cuda._sleep(SLEEP_CYCLES)
            step.run()
            log.append(None)
    if cuda:
        torch.cuda.synchronize()
    moved, bmm_seconds = moved or {}, bmm_seconds or {}
    out = {}
    for label, seconds in per_kernel_seconds(log).items():
        row = {"seconds": seconds}
        gemm = next((g for g in gemms if label == g or label.startswith(g + " ")), None)
        if label.endswith(" check"):  # the check pass only recomputes to flag, and only when it may overflow
            gemm = None
        if gemm is not None:
            M, K, N = gemms[gemm]
            row.update(
                gemm=gemm,
                tflops=2 * M * K * N / seconds / 1e12,
                fraction_of_torch_mm=mm_seconds[gemm] / seconds,
                gemm_only=not label.endswith(" adamw"),
            )
        if label in moved and copy_gbs is not None:
            row.update(floor(moved[label], copy_gbs, seconds, gemms.get(gemm), mm_seconds.get(gemm)))
        if gemm in bmm_seconds:
            row.update(torch_bmm_s=bmm_seconds[gemm], time_over_torch_bmm=seconds / bmm_seconds[gemm])
        out[label] = row
    return out


def floor(moved: dict[str, int], copy_gbs: float, seconds: float, gemm: tuple[int, int, int] | None = None,
          mm_seconds: float | None = None) -> dict:  # fmt: skip
    """The roofline floor of one launch that moves ``moved`` (tensor -> bytes) and, when ``gemm`` is its
    (M, K, N), computes that GEMM, which torch.mm ran in ``mm_seconds``; ``seconds`` is the launch's time.
    Returns the fields :func:`kernel_table` documents."""
    total = sum(moved.values())
    floor_gemm_s = 0.0 if gemm is None else mm_seconds
    floor_bytes_s = total / (copy_gbs * 1e9)
    floor_s = max(floor_gemm_s, floor_bytes_s)
    return {
        "flops": 0 if gemm is None else 2 * gemm[0] * gemm[1] * gemm[2],
        "bytes": total,
        "bytes_by_tensor": dict(moved),
        "floor_gemm_s": floor_gemm_s,
        "floor_bytes_s": floor_bytes_s,
        "floor_s": floor_s,
        "time_over_floor": seconds / floor_s,
    }
