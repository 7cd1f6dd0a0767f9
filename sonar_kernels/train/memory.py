"""sonar-train's memory pass: the peak of one training step per arm, by category, with torch's MemTracker."""

from __future__ import annotations

import functools
import warnings

import torch

from sonar_kernels.train import distributed
from sonar_kernels.train.arms import build_arm, sync, train_step
from sonar_kernels.train.data import ByteData

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
    result = track_step(arm.model, arm.optimizers, step, device)
    if device.type == "cuda":
        result["cuda_allocator_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
        result["cuda_allocated_before_step_bytes"] = int(base)
    del arm
    return result


def track_step(model: torch.nn.Module, optimizers, step, device: torch.device) -> dict:
    """Run ``step()`` (one training step of ``model`` with ``optimizers``) under torch's MemTracker and
    return its peak on ``device``: ``peak_memory_bytes``, ``peak_memory`` (bytes per label of
    :data:`LABELS`; the optimizer state is what the optimizers hold after the step, counted once per
    storage, a DTensor by its local shard; the rest of what MemTracker files under optimizer state is the
    step's temporaries) and ``peak_phase`` ("forward", "backward" or "optimizer step"). Also used by
    bench/memory_model.py for the layouts sonar-train does not run (FSDP2, EP x DP)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState
    from torch.distributed.tensor import DTensor

    tracker = MemTracker()
    tracker.track_external(model, *optimizers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracker:
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
                    storages[t.device, t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    breakdown[STEP_TEMPORARIES] = max(0, breakdown["optimizer_state"] - sum(storages.values()))
    breakdown["optimizer_state"] -= breakdown[STEP_TEMPORARIES]
    total = int(peak["Total"])
    stats = tracker.memory_tracking[model].snapshots
    phase = "optimizer step"
    for state, label in ((_ModState.PEAK_FW, "forward"), (_ModState.PEAK_BW, "backward")):
        if any(int(snap[tracked]["Total"]) == total for snap in stats.get(state, []) if tracked in snap):
            phase = label
    return {"peak_memory_bytes": total, "peak_memory": breakdown, "peak_phase": phase}
