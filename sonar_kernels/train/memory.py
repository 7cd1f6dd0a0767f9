"""sonar-train's memory: the estimate that decides, before any model is built, whether a run fits the
device (:func:`estimate_training_memory`, :func:`available_memory`, :func:`check_fits`), and the memory
pass: the peak of one training step per arm, by category, with torch's MemTracker."""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

from sonar_kernels.ops import has_torch_fused_adamw
from sonar_kernels.train import distributed
from sonar_kernels.train.arms import EXPERT_PARAMS, build_arm, sync, train_step
from sonar_kernels.train.data import ByteData, UsageError

CATEGORIES = {
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporary",
    "Other": "other",
}


# MemTracker counts every tensor allocated inside optimizer.step() as optimizer state; the part beyond the
# state itself (exp_avg, exp_avg_sq, step) is the step's temporaries, reported apart.
STEP_TEMPORARIES = "optimizer_step_temporaries"


LABELS = (*CATEGORIES.values(), STEP_TEMPORARIES)


def measure_memory(name: str, initial, data: ByteData, args, device: torch.device) -> dict:
    """Peak bytes of one training step of arm ``name`` (after two untracked warm-up steps), by category,
    and the phase of the step in which the peak falls (:func:`track_step`)."""
    arm = build_arm(name, initial, args, steps=3)
    for step in range(2):
        train_step(arm, data.batch(distributed.batch_index(step)).to(device), args.max_grad_norm)
    tokens = data.batch(distributed.batch_index(2)).to(device)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    step = functools.partial(train_step, arm, tokens, args.max_grad_norm)
    masters = getattr(arm.optimizer, "masters", None)  # Fp32Masters' fp32 copies: parameters too
    result = track_step(
        arm.model, arm.optimizers, step, device, modules=() if masters is None else (masters,)
    )
    if device.type == "cuda":
        result["cuda_allocator_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
        result["cuda_allocated_before_step_bytes"] = int(base)
    del arm
    return result


def track_step(model: torch.nn.Module, optimizers, step, device: torch.device, modules=()) -> dict:
    """Run ``step()`` (one training step of ``model`` with ``optimizers``) under torch's MemTracker and
    return its peak on ``device``: ``peak_memory_bytes``, ``peak_memory`` (bytes per label of
    :data:`LABELS`; the optimizer state is what the optimizers hold after the step, counted once per
    storage, a DTensor by its local shard; the rest of what MemTracker files under optimizer state is the
    step's temporaries; the parameters of ``modules``, e.g. fp32 master copies, among the parameters) and
    ``peak_phase`` ("forward", "backward" or "optimizer step"). Also used by
    bench/memory_model/ for the layouts sonar-train does not run (FSDP2, EP x DP)."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import _ModState
    from torch.distributed.tensor import DTensor

    tracker = _root_peak_tracker(model)
    tracker.track_external(model, *optimizers, *modules)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # torch.compile does not run under a dispatch mode (MemTracker is one): a compiled optimizer step
        # (torchao's AdamW8bit) runs eagerly here, with eager temporaries.
        with tracker, torch.compiler.set_stance("force_eager"):
            step()
    sync(device)
    snapshot = tracker.get_tracker_snapshot("peak")
    tracked = next(
        d for d in snapshot if d.type == device.type and (device.index is None or d.index == device.index)
    )
    peak = snapshot[tracked]
    breakdown = {label: int(peak.get(key, 0)) for key, label in CATEGORIES.items()}
    storages = {}
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for t in state.values():
                t = t.to_local() if isinstance(t, DTensor) else t
                if isinstance(t, torch.Tensor) and t.device.type == device.type:
                    # A tensor subclass's (torchao's 8-bit state) are its inner tensors' storages.
                    for storage in get_untyped_storages(t):
                        # Keyed by the storage itself (its C++ object), not its address: every fake
                        # tensor's (FakeTensorMode, bench/dry_run.py) is 0.
                        storages[storage._cdata] = storage.nbytes()
    breakdown[STEP_TEMPORARIES] = max(0, breakdown["optimizer_state"] - sum(storages.values()))
    breakdown["optimizer_state"] -= breakdown[STEP_TEMPORARIES]
    total = int(peak["Total"])
    stats = tracker.memory_tracking[model].snapshots
    phase = "optimizer step"
    for state, label in ((_ModState.PEAK_FW, "forward"), (_ModState.PEAK_BW, "backward")):
        if any(int(snap[tracked]["Total"]) == total for snap in stats.get(state, []) if tracked in snap):
            phase = label
    return {"peak_memory_bytes": total, "peak_memory": breakdown, "peak_phase": phase}


def _root_peak_tracker(root: torch.nn.Module):
    """torch's MemTracker that keeps, besides the global peak, the peak of ``root`` only (the phase is read
    from it). MemTracker updates the running peak of every module it has seen on every op, a cost of
    (ops x modules), quadratic in depth: a 48-layer model's step took minutes under FakeTensorMode, and
    what it computes for the other modules is never read here. Everything else (categories, activation
    checkpointing regions, hooks) is MemTracker's own."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class RootPeakTracker(MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            every = self.memory_tracking
            stats = every.get(root)
            self.memory_tracking = {} if stats is None else {root: stats}
            try:
                super()._update_peak_stats(peak_state)
            finally:
                self.memory_tracking = every

    return RootPeakTracker()


# The arms whose step holds the gradient of every parameter (clip_grad_norm_ needs them all).
FULL_GRADIENT_ARMS = ("standard", "standard-dense-clip")


GiB = 2**30


def estimate_training_memory(
    model,
    *,
    dtype: torch.dtype,
    batch_size: int,
    sequence_length: int,
    arms,
    checkpointing: bool,
    device: torch.device,
    foreach: bool | None = None,
    fused: bool | None = None,
    local_processes: int = 1,
    loss_chunk_tokens: int | None = None,
) -> dict:
    """The bytes a sonar-train run holds at its peak, from the shapes of ``model`` (built on the meta
    device: nothing allocated) and its config; a deliberately rough upper estimate, not the measurement
    (that is the memory pass).

    The arm being trained holds (on ``device``): ``parameters``; ``gradients`` (every parameter's when a
    standard arm runs, else the dense ones and one expert tensor's); ``optimizer_state`` (AdamW's
    exp_avg and exp_avg_sq in the parameters' dtype); ``optimizer_step_temporaries`` (torch's fused AdamW:
    none, one pass per tensor; foreach: a copy of every parameter; the single-tensor loop: two of the
    largest tensor; ``foreach`` and ``fused`` both None: fused wherever torch has it for ``device`` and
    ``dtype``, sonar-train's default, else torch's default, foreach on CUDA); ``activations``
    (per layer its input under activation checkpointing, and one layer's working set: attention and
    norms about 12 T H, the routed rows T top_k (3 H + 6 I), the attention scores, the router's fp32
    logits; without checkpointing every layer's working set; the logits T V in the dtype, in fp32 for
    the loss and its fp32 gradient; with ``loss_chunk_tokens`` (``--loss-chunk-tokens``, ``train/loss.py``)
    one chunk's: min(T, loss_chunk_tokens) rows instead of T). The run also holds on the host, for the whole run: the initial model
    (each arm's copy is made from it), the first seed's parameters of sonar or its control until the
    other has trained (they are compared bit for bit), and on CUDA the host copy each arm is made from.
    Under torchrun every one of ``local_processes`` holds all of it (expert parallelism's smaller expert
    share is not counted).

    Returns:
        {"device": type, "arm": {category: bytes}, "device_bytes", "host_bytes", "parameters" (count),
        "expert_parameters" (count)}; on the CPU ``device_bytes`` is 0 and the arm is in ``host_bytes``.
    """
    config = model.config
    a = dtype.itemsize
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    n = sum(sizes.values())
    n_expert = sum(v for name, v in sizes.items() if name.endswith(EXPERT_PARAMS))
    largest = max(sizes.values())
    largest_expert = max((v for name, v in sizes.items() if name.endswith(EXPERT_PARAMS)), default=0)
    T = batch_size * sequence_length
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = getattr(config, "num_attention_heads", 1)
    top_k = getattr(config, "num_experts_per_tok", 1) or 1
    E = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 1
    I = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", H)
    layer = (
        a * T * (12 * H + top_k * (3 * H + 6 * I))
        + a * batch_size * heads * sequence_length**2
        + 2 * 4 * T * E
    )
    logit_rows = T if loss_chunk_tokens is None else min(T, loss_chunk_tokens)
    activations = (
        (L * a * T * H + layer if checkpointing else L * layer) + logit_rows * V * (a + 8) + L * 4 * T * E
    )
    if fused is None and foreach is None:
        fused = has_torch_fused_adamw(device, dtype)  # sonar-train's default (cli.py)
    if fused:
        temporaries = 0
    elif foreach or (foreach is None and device.type == "cuda"):  # torch's default on CUDA: foreach
        temporaries = n * a
    else:
        temporaries = 2 * largest * a
    full = any(arm in FULL_GRADIENT_ARMS for arm in arms)
    arm = {
        "parameters": n * a,
        "gradients": (n if full else n - n_expert + largest_expert) * a,
        "optimizer_state": 2 * n * a,
        STEP_TEMPORARIES: temporaries,
        "activations": activations,
    }
    kept = 1 if "sonar" in arms and "standard-dense-clip" in arms else 0
    host = (1 + kept) * n * a
    if device.type == "cuda":
        device_bytes, host = sum(arm.values()), host + n * a
    else:
        device_bytes, host = 0, host + sum(arm.values())
    return {
        "device": device.type,
        "arm": arm,
        "device_bytes": device_bytes,
        "host_bytes": local_processes * host,
        "parameters": n,
        "expert_parameters": n_expert,
    }


def available_memory(device: torch.device) -> dict:
    """Bytes available now: ``host`` (MemAvailable of /proc/meminfo, bounded by the cgroup's limit less
    its usage; psutil where there is no /proc; None when unknown) and on CUDA ``device``
    (``torch.cuda.mem_get_info``'s free bytes)."""
    result = {"host": _host_available(), "device": None}
    if device.type == "cuda":
        result["device"] = int(torch.cuda.mem_get_info(device)[0])
    return result


def _host_available() -> int | None:
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        try:
            import psutil
        except ImportError:
            return None
        return int(psutil.virtual_memory().available)
    # A container's memory limit (cgroup v2) may be far below the machine's.
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            free = max(0, int(limit) - used)
            available = free if available is None else min(available, free)
    except (OSError, ValueError):
        pass
    return available


def check_fits(estimate: dict, available: dict, what: str, remedies: str) -> None:
    """Refuse a run whose estimate exceeds the memory available (memory that cannot be read is not
    checked).

    Raises:
        UsageError: naming ``what`` (the model), the estimate by category, the available bytes and
            ``remedies`` (the options that make the run smaller).
    """
    needs = []
    if available["device"] is not None and estimate["device_bytes"] > available["device"]:
        needs.append(("the GPU", estimate["device_bytes"], available["device"]))
    if available["host"] is not None and estimate["host_bytes"] > available["host"]:
        needs.append(("host memory", estimate["host_bytes"], available["host"]))
    if not needs:
        return
    parts = ", ".join(f"{label.replace('_', ' ')} {b / GiB:.1f}" for label, b in estimate["arm"].items())
    where, need, have = needs[0]
    raise UsageError(
        f"{what} does not fit: training it needs about {need / GiB:.1f} GiB of {where} (estimate; "
        f"{estimate['parameters'] / 1e9:.2f} B parameters; per arm in GiB: {parts}"
        f"{'' if estimate['device'] == 'cuda' else ', plus the initial model and the compared copies'}), "
        f"{have / GiB:.1f} GiB available. {remedies}, or --no-memory-check to try anyway"
    )


def local_processes() -> int:
    """Processes of this run on this machine (torchrun's LOCAL_WORLD_SIZE, 1 without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
