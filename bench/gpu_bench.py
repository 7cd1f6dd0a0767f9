"""The GPU benchmark as one prepared run that cannot lose what it measured (bench/README.md).

Sections, each a list of units run in order (``--sections`` picks sections):

- ``correctness``: at the OLMoE-1B-7B and Granite-3.1-3B-A800M layer shapes, bf16 and fp32 weights: the
  fused AdamW epilogue against the split path (bitwise) and against torch.optim.AdamW(fused=True) fed the
  split path's gradient; and bf16 weights with 8-bit moments, the remainder and stochastic rounding, fused
  against split, bitwise (bench/check_backward.py);
- ``layers``: one expert-MLP layer of each model in bf16 at 4096 and 16384 routed tokens, the training
  step (forward, backward, AdamW) of standard (transformers' grouped_mm experts + ``clip_grad_norm_`` +
  torch's fused AdamW), the paper's method, sonar, and sonar with 8-bit moments, with the 16-bit remainder
  and with stochastic rounding (bench/providers.py): median time and its p10-p90, TFLOP/s, peak memory;
- ``gemms``: at 4096 tokens, sonar's step kernel by kernel, every grouped GEMM against torch.mm on its
  shape, each launch's roofline floor (max(its GEMM at torch.mm's rate, its bytes at the copy bandwidth
  measured in the unit)) and each wgrad against torch.bmm over equal per-expert slabs
  (bench/kernel_times.py), and the device's copy bandwidth;
- ``full-steps``: whole training steps of OLMoE-1B-7B and Granite-3.1-3B-A800M at reduced depth
  (``--full-step-layers``), sonar-train's standard, sonar and all-in-backward arms;
- ``model`` (not in the default sections: a call of its own, bench/README.md): the article's table, both
  models at full depth, every arm beside its traced peak, sonar against its control bit for bit
  (bench/model_steps.py).

The JSON and a readable .md are written after every unit (a temporary file renamed over the last one), so
the files always hold every unit finished so far. A unit that raises is recorded with its traceback and
the run goes on. ``--deadline SECONDS`` starts no unit whose estimated time would end past the deadline
(those are recorded as not run); SIGTERM or Ctrl-C (what a timeout sends) marks the unit under way as
interrupted, writes the files and exits. Exit status: 0 every unit done and every check passed; 1 a unit
failed or a correctness check did not pass; 2 units left not run (deadline, interrupted).

``--rehearse`` runs every section on the CPU at tiny shapes, with the same code except the device seam
(:class:`Rehearsal` for :class:`Cuda`: timing, peak memory, device facts): the torch backend for the layer
steps and the Triton interpreter where a kernel is measured. The test suite runs it, so a broken GPU path
fails CI here.

Usage (the repository root is found from this file; no install, no PYTHONPATH):

    python3 bench/gpu_bench.py --out $OUT/gpu_bench.json --deadline 420
    python3 bench/gpu_bench.py --rehearse --out runs/bench/rehearsal.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

if "--dry-run" not in sys.argv and ("--rehearse" in sys.argv or not torch.cuda.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton and sonar_kernels are imported

import check_backward  # noqa: E402
import host_work  # noqa: E402
import kernel_times  # noqa: E402
import model_steps  # noqa: E402
import providers  # noqa: E402
import triton  # noqa: E402

from sonar_kernels.ops.triton_backend import configs  # noqa: E402

SECTIONS = ("correctness", "layers", "gemms", "wgrad", "full-steps", "model")
# The prepared command's sections; ``model`` (whole models at full depth, bench/model_steps.py) is a call of
# its own (bench/README.md): both would not fit one call's 7 minutes.
DEFAULT_SECTIONS = SECTIONS[:-1]
MODELS = ("olmoe-1b-7b", "granite-3.1-3b-a800m")
TOKENS = (4096, 16384)
LAYER_PROVIDERS = ("standard-fused", "paper-inbwd", "sonar", *providers.STATE_KIND_PROVIDERS)
# Estimated seconds of each unit on an H200, Triton compilations included (bench/README.md, "Budget"):
# --deadline starts no unit that would end past it. A unit's compilations are counted by --dry-run (at most
# 24, in the first correctness units; none after the first layer unit). A gemms unit took 2 to 6 s on the
# H200 (2026-12-04); its floors add a copy and two torch.bmm timings (about 0.5 s): 35 s still covers it.
# The model section's estimate is per unit (model_steps.estimate).
ESTIMATES = {
    "correctness": 45,
    "layers": 45,
    "gemms": 35,
    "wgrad": 120,
    "full-steps": 75,
    "model": model_steps.estimate,
}
# The wgrad section's providers: sonar (exact bf16 moments: every tile candidate, fused and split) and the
# state kinds whose tiles are fixed (the path only).
WGRAD_PROVIDERS = ("sonar", "sonar-8bit", "sonar-stochastic")
# Rounds of the host issue time per provider of a layer unit (bench/host_work.py: each one holds the GPU for
# twice the step and 10 ms more: at most about 0.3 s per provider at OLMoE-1B-7B T16384).
ISSUE_ROUNDS = 5
# Seconds of one kernel's cold build for sm_90a, with a margin: --dry-run --compile-times measured a mean of
# 0.7 s and a longest of 3.3 s per build on a 2-core CPU (bench/README.md, "Budget").
COMPILE_S = 1.5


class Cuda:
    """The device seam on a CUDA GPU: everything of the run that only a GPU reaches."""

    mode = "gpu"
    kind = "cuda"  # where the tensors are
    gpu = True  # the GPU's choices (bf16 full steps, torch's fused AdamW)
    dtype = torch.bfloat16

    def begin(self, section: str, name: str) -> None:
        """A unit starts (the dry run files its launches under it)."""

    def report(self) -> dict:
        """What the seam adds to the results beyond the units (the dry run: its compilations)."""
        return {}

    def info(self) -> dict:
        props = torch.cuda.get_device_properties(0)
        return {
            "device": torch.cuda.get_device_name(),
            "capability": list(torch.cuda.get_device_capability()),
            "multiprocessors": props.multi_processor_count,
            "memory_bytes": props.total_memory,
            "cuda": torch.version.cuda,
            "driver": _driver(),
        }

    def seconds(self, fn) -> dict:
        """triton.testing.do_bench's p10, median and p90 of ``fn`` in seconds (after its warm-up)."""
        p10, median, p90 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.1, 0.5, 0.9])
        return {"median_s": median / 1000, "p10_s": p10 / 1000, "p90_s": p90 / 1000}

    def peak_bytes(self, step, phase: str) -> int:
        return providers.peak_bytes(step, phase)  # the CUDA allocator's peak (MemTracker on the CPU)

    def issue(self, fn, step_s: float) -> dict:
        """bench/host_work.py's ``issue_time`` of ``fn`` (a step that ``seconds`` timed at ``step_s``): the
        host's time to issue it while the GPU sleeps, against the device time of its work, over
        ``ISSUE_ROUNDS`` rounds. Each hold lasts twice the step and 10 ms more, so that an issue slower
        than the step's device time still ends inside it."""
        hold_s = 2 * step_s + 0.01
        cycles = max(1, int(hold_s * self._sleep_cycles_per_s()))
        return host_work.issue_time(
            fn, ISSUE_ROUNDS, lambda: torch.cuda._sleep(cycles), lambda: torch.cuda.Event(enable_timing=True),
            torch.cuda.synchronize, hold_s,
        )  # fmt: skip

    def _sleep_cycles_per_s(self) -> float:
        """torch.cuda._sleep's cycles per second on this GPU, measured once (an event pair around 10^7)."""
        if getattr(self, "_sleep_rate", None) is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            torch.cuda.synchronize()
            self._sleep_rate = 10_000_000 / (start.elapsed_time(end) / 1000)
        return self._sleep_rate

    def peak_during(self, fn) -> int:
        """The CUDA allocator's peak while ``fn`` runs (everything allocated, not only ``fn``'s)."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())

    def sync(self) -> None:
        torch.cuda.synchronize()

    def release(self) -> None:
        """A fresh state for the next model arm: what is unreferenced collected, the allocator's cache
        emptied, its peaks reset."""
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def max_allocated(self) -> int | None:
        return int(torch.cuda.max_memory_allocated())

    def max_reserved(self) -> int | None:
        """The caching allocator's reserved peak since the last reset (rounding and fragmentation included)."""
        return int(torch.cuda.max_memory_reserved())

    def equal(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Bit for bit (``b`` may wait on the host: it is moved to ``a``'s device first)."""
        return bool(torch.equal(a, b.to(a.device)))


class Rehearsal(Cuda):
    """The device seam of ``--rehearse``: the CPU, one timed call (times mean nothing here), torch's
    MemTracker for the peaks."""

    mode = "rehearsal"
    kind = "cpu"
    gpu = False

    def info(self) -> dict:
        return {"device": f"cpu ({platform.processor() or platform.machine()}), rehearsal", "cuda": None}

    def seconds(self, fn) -> dict:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        return {"median_s": elapsed, "p10_s": elapsed, "p90_s": elapsed}

    def issue(self, fn, step_s: float) -> dict:
        """The GPU's measurement with CPU stand-ins (no hold, the host's clock for the events), one round."""
        return host_work.issue_time(fn, 1, lambda: None)

    def peak_during(self, fn) -> int:
        """The peak of the tensors allocated while ``fn`` runs (torch's MemTracker)."""
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with tracker:
                fn()
        return int(sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values()))

    def sync(self) -> None:
        pass

    def release(self) -> None:
        gc.collect()

    def max_allocated(self) -> int | None:
        return None

    def max_reserved(self) -> int | None:
        return None


class DryRun(Rehearsal):
    """The device seam of ``--dry-run``: the real shapes on the CPU inside bench/dry_run.py's
    :func:`dry_run` (fake tensors, every Triton launch recorded as the compilation the JIT would make for
    sm_90a, nothing computed), the GPU's choices, one call per timed function; times, peaks and checks
    mean nothing. It reports the compilations of each unit, and with ``compile_times`` how long each takes
    to build for sm_90a on this machine's CPU (bench/README.md, "Budget")."""

    mode = "dry-run"
    gpu = True

    def __init__(self, launches, compile_times: bool = False):
        self.launches, self.compile_times = launches, compile_times
        self.target = launches.target_name

    def info(self) -> dict:
        return {"device": f"dry run on the cpu ({platform.processor() or platform.machine()}): fake tensors, "
                          f"Triton launches recorded for {self.target}", "cuda": None}  # fmt: skip

    def peak_bytes(self, step, phase: str) -> int:
        return 1

    def peak_during(self, fn) -> int:
        fn()
        return 1

    def begin(self, section: str, name: str) -> None:
        self.launches.unit = f"{section}: {name}"

    def equal(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return True  # fake tensors have no values: a placeholder (the dry run's checks mean nothing)

    def report(self) -> dict:
        variants = list(self.launches.variants.values())
        out = {"target": self.target, "compilations": len(variants), "by_unit": self.launches.by_unit(),
               "library_host_reads": sorted(set(self.launches.library_reads)), "variants": []}  # fmt: skip
        for v in variants:
            row = {"kernel": v.name, "launches": v.launches, "units": v.units, "identity": v.identity()}
            if self.compile_times:
                row.update(self.launches.compile(v))
            out["variants"].append(row)
        if self.compile_times and variants:
            seconds = sorted(row["compile_s"] for row in out["variants"])
            out["compile_s"] = {
                "total": sum(seconds),
                "median": statistics.median(seconds),
                "max": seconds[-1],
            }
            spills = [r for r in out["variants"] if r["spill_stores"] or r["spill_loads"]]
            out["spilling"] = [f"{r['kernel']} {r['identity']['constexprs']}" for r in spills]
        return out


def _driver() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
        return done.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _versions() -> dict:
    import importlib.metadata as metadata

    out = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    for name in ("transformers", "numpy", "huggingface_hub", "tokenizers", "safetensors"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _commit(given: str | None) -> str:
    """``--commit``, else the SONAR_COMMIT variable, else git's HEAD here (with "+changes" when tracked files
    differ from it), else "unknown" (a copy of the tree without .git)."""
    if given or os.environ.get("SONAR_COMMIT"):
        return given or os.environ["SONAR_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT, check=False).returncode != 0
        return head.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# --- What is measured ---------------------------------------------------------------------------------


class Plan:
    """The shapes of a run: the real ones, or the rehearsal's tiny stand-ins under the same names."""

    def __init__(self, rehearse: bool, full_step_layers: int):
        self.rehearse = rehearse
        self.full_step_layers = full_step_layers
        if rehearse:
            # H and I multiples of 32 (the 8-bit moments' blocks); Granite's expert count is not a power of 2.
            self.layer_shapes = {"olmoe-1b-7b": (64, 32, 8, 2), "granite-3.1-3b-a800m": (32, 32, 5, 2)}
            self.tokens = (16, 32)
            self.check_shape = {"olmoe-1b-7b": "rehearsal-olmoe", "granite-3.1-3b-a800m": "rehearsal-granite"}
            self.presets = {"olmoe-1b-7b": "tiny-olmoe", "granite-3.1-3b-a800m": "tiny-granitemoe"}
            self.model_layers, self.model_batch = 1, (2, 32)  # the model section's reduced size
        else:
            self.layer_shapes = {name: tuple(providers.SHAPES[name])[1:] for name in MODELS}
            self.tokens = TOKENS
            self.check_shape = {name: name for name in MODELS}
            self.presets = {name: name for name in MODELS}
            self.model_layers, self.model_batch = None, None  # full depth, the presets' 4 x 1024 tokens

    def shape(self, model: str, tokens: int) -> providers.Shape:
        return providers.Shape(tokens, *self.layer_shapes[model])


def gemm_shapes(shape: providers.Shape) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of the layer's GEMMs over its S = T * top_k routed rows (docs/design.md's backward):
    forward up and down projections, then G = dO W2, dX rows, dW2 and dW1."""
    S = shape.T * shape.top_k
    H, I = shape.H, shape.I
    return {
        "up": (S, H, 2 * I),
        "down": (S, I, H),
        "dgrad G": (S, H, I),
        "dgrad dX": (S, 2 * I, H),
        "wgrad dW2": (H, S, I),
        "wgrad dW1": (2 * I, S, H),
    }


def correctness(plan: Plan, device, model: str, weight_dtype: torch.dtype) -> dict:
    row = check_backward.check(plan.check_shape[model], weight_dtype, device.kind)
    # On a GPU the same-dtype update is also torch.optim.AdamW(fused=True)'s bits (kernels/adamw.py); the
    # CPU's torch AdamW rounds differently (the rehearsal reports the difference, it does not require 0).
    exact = all(v["differing_fraction"] == 0.0 for v in row["vs_torch_adamw_fused"].values())
    row["bitwise_equal_to_torch_adamw_fused"] = exact
    row["passed"] = bool(row["fused_equals_split_bitwise"]) and (exact or not device.gpu)
    return row


def layer(plan: Plan, device, model: str, tokens: int) -> dict:
    """Every provider of LAYER_PROVIDERS: one training step of the layer, uniform routing; and its host
    path (bench/host_work.py): the launches, torch ops and library Python calls of one step, and the time
    the host takes to issue the step against the device time of its work."""
    shape = plan.shape(model, tokens)
    inputs = providers.make_inputs(shape, device.dtype, device.kind)
    rows = {}
    for name in LAYER_PROVIDERS:
        step = providers.build(name, inputs, backend="auto")
        step.run()  # compile, create the optimizer state
        timing = device.seconds(step.run)
        host = host_work.count(step.run)
        host["issue"] = device.issue(step.run, timing["median_s"])
        rows[name] = {
            **timing,
            "tflops": shape.phase_flops("step") / timing["median_s"] / 1e12,
            "peak_bytes": device.peak_bytes(step, "step"),
            "experts": step.experts,
            "update": step.update,
            "host": host,
        }
        del step
    base = rows[providers.BASELINE]
    for row in rows.values():  # every ratio provider / standard-fused: below 1 is better
        row["time_vs_standard"] = row["median_s"] / base["median_s"]
        row["memory_vs_standard"] = row["peak_bytes"] / base["peak_bytes"]
    return {
        "shape": model,
        "T_H_I_E_top_k": list(shape),
        "dtype": str(device.dtype),
        "expert_grad_bytes": shape.expert_grad_bytes(device.dtype),
        "rows": rows,
    }


def gemms(plan: Plan, device, model: str) -> dict:
    """sonar's step kernel by kernel against torch.mm on each GEMM's shape (the dense roofline), each
    launch's floor (bench/kernel_times.py: max(its GEMM at torch.mm's rate, its bytes at the copy bandwidth
    measured here)) and each wgrad against torch.bmm over equal per-expert slabs."""
    shape = plan.shape(model, plan.tokens[0])
    shapes = gemm_shapes(shape)
    roof = {}
    for name, (M, K, N) in shapes.items():
        a = torch.randn(M, K, device=device.kind, dtype=device.dtype)
        b = torch.randn(K, N, device=device.kind, dtype=device.dtype)
        seconds = device.seconds(lambda a=a, b=b: torch.mm(a, b))["median_s"]
        roof[name] = {"seconds": seconds, "tflops": 2 * M * K * N / seconds / 1e12}
    slabs = {name: wgrad_slabs(device, shape, *shapes[name]) for name in ("wgrad dW2", "wgrad dW1")}
    copy = bandwidth(plan, device)  # before the step's tensors exist (1 GiB each way on the GPU)
    inputs = providers.make_inputs(shape, device.dtype, device.kind)
    step = providers.build("sonar", inputs, backend="triton")
    step.run()
    gate_up_proj = step.params[0]
    dtypes = {
        "activations": device.dtype,
        "weights": gate_up_proj.dtype,
        "moments": step.optimizer.state[gate_up_proj]["exp_avg"].dtype,
        "routing_weights": inputs.weights.dtype,
    }
    moved = kernel_times.traffic(shape, **dtypes)
    kernels = kernel_times.kernel_table(
        step, shapes, {k: v["seconds"] for k, v in roof.items()}, device.kind == "cuda",
        5 if device.kind == "cuda" else 1, moved=moved, copy_gbs=copy["gbs"],
        bmm_seconds={k: v["seconds"] for k, v in slabs.items()},
    )  # fmt: skip
    fractions = {label: row["fraction_of_torch_mm"] for label, row in kernels.items() if row.get("gemm_only")}
    return {
        "shape": model,
        "T_H_I_E_top_k": list(shape),
        "dtypes": {k: str(v) for k, v in dtypes.items()},
        "torch_mm": roof,
        "torch_bmm": slabs,
        "copy_gbs": copy["gbs"],
        "kernels": kernels,
        "min_gemm_fraction_of_torch_mm": min(fractions.values(), default=float("nan")),
        # The step's floor is the sum of its launches' floors; the launches without one move none of the
        # layer's tensors (routing, scalars, the check pass) and count in the measured sum only.
        "floor_s": sum(row.get("floor_s", 0.0) for row in kernels.values()),
        "kernels_s": sum(row["seconds"] for row in kernels.values()),
    }


def wgrad_choices(plan: Plan, device, model: str) -> dict:
    """The tuner's own measurements (ops/triton_backend/configs.py ``timings``) of each expert tensor's wgrad with its
    update, as the first step of a layer takes them with tuning on: the fused and the split path at every
    wgrad tile candidate (the state kinds with fixed tiles: the path only), each timed as it ships on
    scratch copies of the first chunk's experts (ops/triton_backend/wgrad_update.py), and the option kept. Beside each
    time, the floor of that chunk's update bytes at the copy bandwidth measured here (fused: W, exp_avg,
    exp_avg_sq read and written; split: the gradient written and read besides)."""
    from sonar_kernels.ops.triton_backend import wgrad_update

    shape = plan.shape(model, plan.tokens[0])
    copy = bandwidth(plan, device)
    inputs = providers.make_inputs(shape, device.dtype, device.kind)
    out = {"shape": model, "T_H_I_E_top_k": list(shape), "copy_gbs": copy["gbs"], "providers": {}}
    for name in WGRAD_PROVIDERS:
        configs.pin()  # forget every choice: this step tunes its keys afresh
        step = providers.build(name, inputs, backend="triton")
        with configs.tuning(True):
            step.run()
        device.sync()
        tensors = {}
        for key, times in configs.timings().items():
            if " update " not in f" {key} ":
                continue
            tensor = "gate_up_proj" if " gate_up_proj " in f" {key} " else "down_proj"
            weight = step.params[0 if tensor == "gate_up_proj" else 1]
            chunk = wgrad_update.split_chunk(weight, weight.dtype)
            state = step.optimizer.state[weight]
            state_bytes = sum(t.numel() * t.element_size() for t in state.values() if t.shape == weight.shape)
            per_expert = (weight.numel() * weight.element_size() + state_bytes) / weight.shape[0]
            grad_bytes = weight.numel() * weight.element_size() / weight.shape[0]
            rows = []
            for option, seconds in times:
                moved = chunk * 2 * (per_expert + (grad_bytes if option.path == "split" else 0))
                rows.append({
                    "path": option.path, "config": option.config._asdict(), "seconds": seconds,
                    "floor_bytes_s": moved / (copy["gbs"] * 1e9),
                })  # fmt: skip
            chosen = configs.chosen()[key]
            tensors[tensor] = {"key": key, "chunk_experts": chunk, "chosen": {"path": chosen.path,
                               "config": chosen.config._asdict()}, "options": rows}  # fmt: skip
        out["providers"][name] = tensors
        del step
    configs.pin()
    return out


def wgrad_slabs(device, shape: providers.Shape, M: int, S: int, N: int) -> dict:
    """torch.bmm over equal per-expert slabs, [E, M, S / E] x [E, S / E, N] in the run's dtype: the GEMM-only
    reference of a wgrad of (M, S, N) over S routed rows, whose K per expert is S / E (a dense torch.mm with
    K = S runs a K loop E times longer). Both operands token-major, as the wgrad reads its rows."""
    E = shape.E
    rows = max(1, S // E)
    p = torch.randn(E, rows, M, device=device.kind, dtype=device.dtype).transpose(1, 2)  # [E, M, rows]
    q = torch.randn(E, rows, N, device=device.kind, dtype=device.dtype)
    seconds = device.seconds(lambda: torch.bmm(p, q))["median_s"]
    return {"slabs": [E, M, rows, N], "seconds": seconds, "tflops": 2 * E * M * rows * N / seconds / 1e12}


def bandwidth(plan: Plan, device) -> dict:
    """Device-to-device copy bandwidth in GB/s (read + write)."""
    nbytes = 2**20 if plan.rehearse else 2**30
    src = torch.empty(nbytes, dtype=torch.uint8, device=device.kind)
    dst = torch.empty_like(src)
    seconds = device.seconds(lambda: dst.copy_(src))["median_s"]
    return {"bytes": nbytes, "gbs": 2 * nbytes / seconds / 1e9}


def full_step(plan: Plan, device, model: str) -> dict:
    """Median step time (and the peak, through the seam) of sonar-train's standard, sonar and
    all-in-backward arms on ``model`` at ``plan.full_step_layers`` layers (bf16 on CUDA, activation
    checkpointing on)."""
    from sonar_kernels import train
    from sonar_kernels.integrations import transformers as hf
    from sonar_kernels.optim.ownership import UnownedExpertsWarning

    hf.register()
    preset_name = plan.presets[model]
    preset = train.PRESETS[preset_name]
    layers = 1 if plan.rehearse else plan.full_step_layers
    argv = ["--preset", preset_name, "--layers", str(layers), "--device", device.kind, "--quiet"]
    argv += ["--fused"] if device.gpu else []
    args = train.parse_args(argv)
    dtype = torch.bfloat16 if device.gpu else torch.float32
    batch, seq = (2, 32) if plan.rehearse else (preset.batch_size, preset.sequence_length)
    data = train.ByteData(train.default_text(), seq, batch, seed=0)
    steps = 2 if plan.rehearse else 5
    arms = {}
    for name in ("standard", "sonar", "all-in-backward"):
        with warnings.catch_warnings():
            if name == "standard":  # trains the sonar experts as dense parameters, deliberately
                warnings.simplefilter("ignore", UnownedExpertsWarning)
            arms[name] = _arm_steps(train, name, preset, layers, dtype, args, data, steps, device)
    for row in arms.values():
        row["time_vs_standard"] = row["step_time_s"] / arms["standard"]["step_time_s"]
        row["memory_vs_standard"] = row["peak_bytes"] / arms["standard"]["peak_bytes"]
    return {"preset": preset_name, "layers": layers, "batch": batch, "sequence_length": seq, "arms": arms}


def _arm_steps(train, name, preset, layers, dtype, args, data, steps, device) -> dict:
    """Arm ``name``'s two warm-up steps (compilation, optimizer state), ``steps`` timed ones and one more
    under the seam's peak."""
    initial = train.build_model(preset, layers, 0, dtype, args.device_obj)
    arm = train.build_arm(name, initial, args, steps=steps + 2)
    del initial
    tokens = [data.batch(i).to(device.kind) for i in range(steps + 2)]
    for t in tokens[:2]:
        train.train_step(arm, t, args.max_grad_norm)
    times = []
    for t in tokens[2:]:
        device.sync()
        start = time.perf_counter()
        train.train_step(arm, t, args.max_grad_norm)
        device.sync()
        times.append(time.perf_counter() - start)
    peak = device.peak_during(lambda: train.train_step(arm, tokens[-1], args.max_grad_norm))
    return {"step_time_s": statistics.median(times), "step_times_s": times, "peak_bytes": peak}


def units(plan: Plan, device, sections: tuple[str, ...]) -> list[tuple[str, str, object]]:
    """(section, unit name, callable) in run order."""
    out = []
    if "correctness" in sections:
        for model in MODELS:
            for dtype in (torch.bfloat16, torch.float32):
                name = f"{model} {str(dtype).removeprefix('torch.')}"
                out.append(("correctness", name, lambda m=model, d=dtype: correctness(plan, device, m, d)))
            out.append(
                ("correctness", f"{model} bfloat16 state kinds",
                 lambda m=model: check_backward.check_state_kinds(plan.check_shape[m], device.kind))
            )  # fmt: skip
    if "layers" in sections:
        for tokens in plan.tokens:
            for model in MODELS:
                out.append(
                    ("layers", f"{model} T{tokens}", lambda m=model, t=tokens: layer(plan, device, m, t))
                )
    if "gemms" in sections:
        for model in MODELS:
            out.append(("gemms", model, lambda m=model: gemms(plan, device, m)))
        out.append(("gemms", "copy bandwidth", lambda: bandwidth(plan, device)))
    if "wgrad" in sections:
        for model in MODELS:
            out.append(("wgrad", model, lambda m=model: wgrad_choices(plan, device, m)))
    if "full-steps" in sections:
        for model in MODELS:
            out.append(("full-steps", model, lambda m=model: full_step(plan, device, m)))
    if "model" in sections:
        out += [("model", name, fn) for name, fn in model_steps.units(plan, device)]
    return out


def unit_estimate(section: str, name: str) -> float:
    """The deadline's estimate of a unit, in seconds (:data:`ESTIMATES`)."""
    estimate = ESTIMATES[section]
    return estimate(name) if callable(estimate) else estimate


# --- The run: one unit at a time, the files written after each ------------------------------------------


class Terminated(BaseException):
    """SIGTERM arrived (a timeout's kill): the unit under way is abandoned and the files written."""


def _on_sigterm(signum, frame):
    raise Terminated()


def run(plan: Plan, device, sections, out: Path, deadline: float | None, meta: dict) -> int:
    """Run the units of ``sections``, writing ``out`` (JSON) and its .md after each; returns the exit
    status (module docstring)."""
    started = time.monotonic()
    todo = units(plan, device, sections)
    result = {
        "schema": 2,
        "mode": device.mode,
        "meta": meta,
        "sections": {s: {"status": "not run", "seconds": 0.0, "units": {}} for s in sections},
        "seconds": 0.0,
        "finished": False,
    }
    for section, name, _ in todo:
        result["sections"][section]["units"][name] = {"status": "pending"}
    _write(result, out)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    stop = None
    try:
        for section, name, fn in todo:
            entry = result["sections"][section]["units"][name]
            elapsed = time.monotonic() - started
            if stop is not None:
                entry.update(status="not run", reason=stop)
                continue
            estimate = unit_estimate(section, name)  # the GPU's, in the rehearsal too (the same decision)
            if deadline is not None and elapsed + estimate > deadline:
                entry.update(
                    status="not run",
                    reason=f"deadline: {elapsed:.0f} s spent + {estimate:.0f} s estimated > {deadline:.0f} s",
                )
                _finish(result, started, out)
                continue
            print(f"[{elapsed:6.0f} s] {section}: {name}", flush=True)
            device.begin(section, name)
            unit_start = time.monotonic()
            try:
                entry.update(status="done", result=fn())
            except (Terminated, KeyboardInterrupt) as e:
                stop = f"{type(e).__name__}: the run was stopped during {section}: {name}"
                entry.update(status="interrupted", reason=stop)
            except Exception as e:  # recorded; the next unit goes on
                entry.update(
                    status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()
                )
                print(entry["traceback"], file=sys.stderr, flush=True)
            entry["seconds"] = time.monotonic() - unit_start
            _finish(result, started, out)
    except (Terminated, KeyboardInterrupt) as e:  # between units, or while writing
        for section, name, _ in todo:
            entry = result["sections"][section]["units"][name]
            if entry["status"] == "pending":
                entry.update(status="not run", reason=f"{type(e).__name__}: the run was stopped")
    finally:
        signal.signal(signal.SIGTERM, previous)
        result.update(device.report())
        result["finished"] = True
        _finish(result, started, out)
    return _status(result)


def _finish(result: dict, started: float, out: Path) -> None:
    """Section statuses and times, the tuning choices so far, then the files."""
    for section in result["sections"].values():
        states = [u["status"] for u in section["units"].values()]
        section["seconds"] = sum(u.get("seconds", 0.0) for u in section["units"].values())
        if states and all(s == "done" for s in states):
            section["status"] = "done"
        elif "failed" in states:
            section["status"] = "failed"
        elif "done" in states:
            section["status"] = "partial"
        else:
            section["status"] = "not run"
    result["seconds"] = time.monotonic() - started
    result["meta"]["configs"] = {key: _option(config) for key, config in configs.chosen().items()}
    _write(result, out)


def _option(option) -> dict:
    """A tuner's choice as a dict: a tile configuration, or a wgrad update's path and tiles."""
    if isinstance(option, configs.UpdateChoice):
        return {"path": option.path, **option.config._asdict()}
    return option._asdict()


def _status(result: dict) -> int:
    entries = [u for s in result["sections"].values() for u in s["units"].values()]
    checked = result["mode"] != "dry-run"  # a dry run's checks compare placeholders
    failed = any(u["status"] == "failed" for u in entries) or any(
        checked and not u["result"].get("passed", True)
        for u in entries
        if u["status"] == "done" and isinstance(u["result"], dict)
    )
    if failed:
        return 1
    return 0 if all(u["status"] == "done" for u in entries) else 2


def _write(result: dict, out: Path) -> None:
    """The JSON and the .md, each through a temporary file renamed over the last one (never half written)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, text in (
        (out, json.dumps(result, indent=1, default=str)),
        (out.with_suffix(".md"), markdown(result)),
    ):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


# --- The readable report ----------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    meta = result["meta"]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    lines = [
        f"# gpu_bench {result['mode']}: {meta['device']['device']}, {meta['date']}",
        "",
        f"Commit {meta['commit']}; {versions}; driver {meta['device'].get('driver')}, CUDA {meta['device'].get('cuda')}. "
        f"{result['seconds']:.0f} s{'' if result['finished'] else ' so far'}. Every ratio is provider / "
        "standard-fused: below 1 is better.",
    ]
    for section_name, section in result["sections"].items():
        lines += ["", f"## {section_name}: {section['status']} ({section['seconds']:.0f} s)", ""]
        if section_name == "model":  # one table of every unit (unfinished ones among its rows)
            lines += model_steps.table_lines(section["units"])
            continue
        for name, unit in section["units"].items():
            if unit["status"] != "done":
                why = unit.get("error") or unit.get("reason") or ""
                lines.append(f"- {name}: **{unit['status']}** {why}".rstrip())
                continue
            lines += _unit_lines(section_name, name, unit)
    if "compilations" in result:
        lines += ["", f"## Compilations for {result['target']}: {result['compilations']}", ""]
        lines += [f"- {unit or '(outside the units)'}: {n}" for unit, n in result["by_unit"].items()]
        reads = result["library_host_reads"]
        lines += ["", f"Host reads on the library's kernel path: {', '.join(reads) if reads else 'none'}."]
        if "compile_s" in result:
            c = result["compile_s"]
            lines += ["", f"Cold builds on this CPU: {c['total']:.0f} s in all, median {c['median']:.2f} s, "
                          f"longest {c['max']:.2f} s; {len(result['spilling'])} spill."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _unit_lines(section: str, name: str, unit: dict) -> list[str]:
    r = unit["result"]
    if section == "correctness" and "kinds" in r:
        kinds = "; ".join(
            f"{kind}: fused == split bitwise {v['fused_equals_split_bitwise']}"
            + (f", rule fired {v['rule_fired']}" if "rule_fired" in v else "")
            for kind, v in r["kinds"].items()
        )
        return [f"- {name}: {kinds} ({unit['seconds']:.0f} s)"]
    if section == "correctness":
        versus = r["vs_torch_adamw_fused"].values()
        worst = max(v["max_ulps"] for v in versus)
        differing = max(v["differing_fraction"] for v in versus)
        largest = max((v.get("max_abs", float("nan")) for v in versus), default=float("nan"))
        return [
            f"- {name}: fused == split bitwise: {r['fused_equals_split_bitwise']}; against "
            f"torch.optim.AdamW(fused=True): {differing:.2e} of the elements differ, worst {worst:.1f} ulp, "
            f"{largest:.2e} absolute ({unit['seconds']:.0f} s)"
        ]
    if section == "layers":
        lines = [
            "", f"{name}: (T, H, I, E, top_k) = {tuple(r['T_H_I_E_top_k'])}, {r['dtype']} ({unit['seconds']:.0f} s)", "",
            "| provider | step ms (p10-p90) | TFLOP/s | time / standard | peak MiB | memory / standard |",
            "|---|---|---|---|---|---|",
        ]  # fmt: skip
        for provider, row in r["rows"].items():
            lines.append(
                f"| {provider} | {1000 * row['median_s']:.3f} ({1000 * row['p10_s']:.3f}-{1000 * row['p90_s']:.3f}) | "
                f"{row['tflops']:.1f} | {row['time_vs_standard']:.2f} | {row['peak_bytes'] / 2**20:.1f} | "
                f"{row['memory_vs_standard']:.2f} |"
            )
        return [*lines, *_host_lines(r["rows"]), ""]
    if section == "gemms":
        return _gemm_lines(name, r)
    if section == "wgrad":
        return _wgrad_lines(name, r)
    lines = [
        "", f"{name} ({r['preset']}, {r['layers']} layers, batch {r['batch']} x {r['sequence_length']}):", "",
        "| arm | step ms | time / standard | peak MiB | memory / standard |", "|---|---|---|---|---|",
    ]  # fmt: skip
    for arm, row in r["arms"].items():
        lines.append(
            f"| {arm} | {1000 * row['step_time_s']:.1f} | {row['time_vs_standard']:.2f} | "
            f"{row['peak_bytes'] / 2**20:.0f} | {row['memory_vs_standard']:.2f} |"
        )
    return [*lines, ""]


def _host_lines(rows: dict) -> list[str]:
    """A layer unit's host path per provider (bench/host_work.py); reports from before it have none."""
    if not all("host" in row for row in rows.values()):
        return []
    lines = [
        "", "Host path of one step: Triton launches, torch ops (ATen ops dispatched), the library's Python calls; "
        "the time to issue the step while the device is held busy, against the device time of its work "
        "(issue / device above 1: the step waits on the host).", "",
        "| provider | launches | torch ops | Python calls | issue ms | device ms | issue / device |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for provider, row in rows.items():
        h, issue = row["host"], row["host"]["issue"]
        covered = "" if issue["covered"] else " (hold too short)"
        lines.append(
            f"| {provider} | {h['launches']} | {h['torch_ops']} | {h['python_calls']} | {_ms(issue['issue_s'])} | "
            f"{_ms(issue['device_s'])} | {issue['issue_over_device']:.2f}{covered} |"
        )
    return lines


def _wgrad_lines(name: str, r: dict) -> list[str]:
    """The wgrad section's unit: per provider and expert tensor, every option the tuner timed."""
    lines = [
        "", f"{name}: the tuner's times of each wgrad with its update (T, H, I, E, top_k) = "
        f"{tuple(r['T_H_I_E_top_k'])}, on the first chunk's experts; copy {r['copy_gbs']:.0f} GB/s", "",
        "| provider | tensor | path | BMxBNxBK w s split pf | ms | floor ms | ms / floor | chosen |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for provider, tensors in r["providers"].items():
        for tensor, t in tensors.items():
            for row in t["options"]:
                c = row["config"]
                tiles = (
                    f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} {c['num_warps']} {c['num_stages']} "
                    f"{c['EPILOGUE_SPLIT']} {'y' if c.get('EPILOGUE_PREFETCH') else 'n'}"
                )
                chosen = t["chosen"]["path"] == row["path"] and t["chosen"]["config"] == c
                lines.append(
                    f"| {provider} | {tensor} ({t['chunk_experts']} experts) | {row['path']} | {tiles} | "
                    f"{_ms(row['seconds'])} | {_ms(row['floor_bytes_s'])} | "
                    f"{row['seconds'] / row['floor_bytes_s']:.1f} | {'**yes**' if chosen else ''} |"
                )
    return [*lines, ""]


def _gemm_lines(name: str, r: dict) -> list[str]:
    """The gemms section's unit: the copy bandwidth, or a layer's step launch by launch with its floors."""
    if "gbs" in r:
        return [f"- copy bandwidth: {r['gbs']:.0f} GB/s"]
    lines = [
        "", f"{name}: sonar's step kernel by kernel, (T, H, I, E, top_k) = {tuple(r['T_H_I_E_top_k'])}; slowest "
        f"GEMM at {r['min_gemm_fraction_of_torch_mm']:.2f} of torch.mm", "",
    ]  # fmt: skip
    if "floor_s" in r:  # reports written before the floors were measured have none
        moments = r["dtypes"]["moments"].removeprefix("torch.")
        bmm = "; ".join(
            f"{gemm.removeprefix('wgrad ')} {' x '.join(map(str, v['slabs']))} {1000 * v['seconds']:.3f} ms "
            f"({v['tflops']:.1f} TFLOP/s)"
            for gemm, v in r["torch_bmm"].items()
        )
        lines += [
            f"Floor of a launch: max(its GEMM at torch.mm's rate on the same (M, K, N), its bytes at the copy "
            f"bandwidth measured in this unit, {r['copy_gbs']:.4g} GB/s); bytes: each tensor read or written once "
            f"({moments} moments); no floor for the launches that move none of the layer's tensors. Sum of the "
            f"floors {1000 * r['floor_s']:.3f} ms, of the launches {1000 * r['kernels_s']:.3f} ms. torch.bmm over "
            f"equal per-expert slabs [E, M, S/E, N] (a wgrad's GEMM-only reference): {bmm}.",
            "",
        ]  # fmt: skip
    lines += [
        "| launch | ms | TFLOP/s | of torch.mm on the same GEMM | GFLOP | MB moved | GEMM ms at torch.mm's rate "
        "| bytes ms at the copy bandwidth | floor ms | ms / floor | torch.bmm ms | ms / torch.bmm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, row in r["kernels"].items():
        gemm = f"{row['tflops']:.1f} | {row['fraction_of_torch_mm']:.2f}" if "tflops" in row else " | "
        what = label if row.get("gemm_only", True) else f"{label} (GEMM + AdamW)"
        floor = " | | | | | "
        if "floor_s" in row:  # "-": a launch without a GEMM
            flops = f"{row['flops'] / 1e9:.4g}" if row["flops"] else "-"
            gemm_ms = _ms(row["floor_gemm_s"]) if row["flops"] else "-"
            floor = (
                f"{flops} | {row['bytes'] / 1e6:.4g} | {gemm_ms} | {_ms(row['floor_bytes_s'])} | "
                f"{_ms(row['floor_s'])} | {row['time_over_floor']:.1f}"
            )
        bmm = (
            f"{_ms(row['torch_bmm_s'])} | {row['time_over_torch_bmm']:.1f}" if "torch_bmm_s" in row else " | "
        )
        lines.append(f"| {what} | {1000 * row['seconds']:.3f} | {gemm} | {floor} | {bmm} |")
    floored = [row for row in r["kernels"].values() if "floor_s" in row]
    if floored:  # the sums over the launches with a floor; the measured sum is over every launch
        lines.append(
            f"| all launches | {1000 * r['kernels_s']:.3f} | | | {sum(f['flops'] for f in floored) / 1e9:.4g} | "
            f"{sum(f['bytes'] for f in floored) / 1e6:.4g} | {_ms(sum(f['floor_gemm_s'] for f in floored))} | "
            f"{_ms(sum(f['floor_bytes_s'] for f in floored))} | {_ms(r['floor_s'])} | "
            f"{r['kernels_s'] / r['floor_s']:.1f} | | |"
        )
    return [*lines, ""]


def _ms(seconds: float) -> str:
    """Milliseconds to 3 decimals, or 2 significant digits below 0.01 ms (the rehearsal's tiny floors)."""
    ms = 1000 * seconds
    return f"{ms:.3f}" if ms >= 0.01 or ms == 0 else f"{ms:.2g}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="the JSON's path (the .md goes beside it); on the GPU machine, under $OUT")  # fmt: skip
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(DEFAULT_SECTIONS),
                        help="the sections to run, in the order of %(choices)s (default: all but model, "
                        "whole models at full depth: a call of its own, bench/README.md)")  # fmt: skip
    parser.add_argument("--deadline", type=float, help="seconds: start no unit that would end past it")
    parser.add_argument("--rehearse", action="store_true",
                        help="every section at tiny shapes on the CPU (the torch backend, the Triton interpreter)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true",
                        help="every section at the real shapes on the CPU, computing nothing (bench/dry_run.py): "
                        "counts the kernels the GPU run compiles, unit by unit")  # fmt: skip
    parser.add_argument("--compile-times", action="store_true",
                        help="with --dry-run: build each of those kernels for sm_90a here and time it")  # fmt: skip
    parser.add_argument("--arithmetic", choices=("fp32", "fp64"),
                        help="with --dry-run: the GPU torch's AdamW arithmetic (default: the CPU's, fp64)")  # fmt: skip
    parser.add_argument("--full-step-layers", type=int, default=2,
                        help="decoder layers of the full-step models (default: %(default)s)")  # fmt: skip
    parser.add_argument("--tune", action="store_true",
                        help="tune the kernels' tile configurations at their first launch (default: the pinned "
                        "defaults, SONAR_KERNELS_TUNING=0: no tuning runs in the budget)")  # fmt: skip
    parser.add_argument("--commit", help="the commit measured (default: SONAR_COMMIT, else git's HEAD)")
    args = parser.parse_args(argv)
    if args.full_step_layers < 1:
        parser.error(f"--full-step-layers must be >= 1, got {args.full_step_layers}")
    if args.deadline is not None and args.deadline <= 0:
        parser.error(f"--deadline must be > 0 seconds, got {args.deadline}")
    if args.rehearse and args.dry_run:
        parser.error("--rehearse and --dry-run are two different CPU runs: pass one")
    if (args.compile_times or args.arithmetic) and not args.dry_run:
        parser.error("--compile-times and --arithmetic go with --dry-run")
    if args.dry_run and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("--dry-run records GPU compilations: unset TRITON_INTERPRET")
    if not (args.rehearse or args.dry_run) and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --rehearse for the CPU rehearsal")
    if not args.tune:
        os.environ["SONAR_KERNELS_TUNING"] = "0"
    if "model" in args.sections:  # before cuBLAS starts: its deterministic workspace (model_steps.py)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with contextlib.ExitStack() as stack:
        if args.dry_run:
            import dry_run

            launches = stack.enter_context(dry_run.dry_run(arithmetic=args.arithmetic))
            device = DryRun(launches, args.compile_times)
        else:
            device = Rehearsal() if args.rehearse else Cuda()
        status = _main(args, device, argv)
    print(args.out.with_suffix(".md").read_text())
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}; exit status {status}")
    return status


def _main(args, device, argv) -> int:
    sections = tuple(s for s in SECTIONS if s in args.sections)
    meta = {
        "date": datetime.date.today().isoformat(),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "device": device.info(),
        "versions": _versions(),
        "commit": _commit(args.commit),
        "deadline_s": args.deadline,
        "tuning": configs.tuning_enabled(torch.device(device.kind)),
    }
    return run(Plan(args.rehearse, args.full_step_layers), device, sections, args.out, args.deadline, meta)


if __name__ == "__main__":
    sys.exit(main())
