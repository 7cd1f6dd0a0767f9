"""sonar-train's verdicts on the expert-clipping arms (report.json's ``expert_clipping``) and on the
injected spike (``--spike-baseline``: ``spike_effect``), from the runs' per-seed results with the held-out
statistics of :func:`report.heldout_statistics`."""

from __future__ import annotations

from pathlib import Path

from sonar_kernels.train.arms import CONTROLS
from sonar_kernels.train.clipping import CLIPPING_MODE
from sonar_kernels.train.data import UsageError
from sonar_kernels.train.report import MIN_TIMED_STEPS, heldout_statistics


def clipping_entry(name: str, report: dict, updates: dict | None, equal: bool | None, memory: bool) -> dict:
    """report.json's ``expert_clipping[name]`` for a clipping arm (sonar-spike, sonar-lagged): its held-out
    differences over paired seeds to standard (global clipping) and to sonar (no expert clipping), each
    with its verdict (:func:`heldout_statistics`); its peak memory and median step time over sonar's
    (None when either is not measured, or fewer than ``MIN_TIMED_STEPS`` steps were timed); its clipping
    telemetry per seed (sonar-spike: ``clipped_elements`` over the run, and ``clipped_elements_at_spike``
    with ``--inject-spike``; sonar-lagged: ``smallest_coef``, and ``coef_after_spike``, the coefficient the
    spike's step set for the next); its expert updates counted in the backward and in ``step()``; and whether its parameters equal its control's bit
    for bit (first seed; None when the control did not run; False as well when an expert update was
    missing or ran in ``step()``)."""
    arms = report["arms"]
    arm = arms[name]
    entry = {"mode": CLIPPING_MODE[name]}
    for reference in ("standard", "sonar"):
        if reference in arms:
            entry[f"versus_{reference}"] = heldout_statistics(
                arms[reference]["heldout_losses"], arm["heldout_losses"], name=name, reference=reference
            )
    if "sonar" in arms:
        sonar = arms["sonar"]
        entry["peak_memory_ratio_to_sonar"] = (
            arm["peak_memory_bytes"] / sonar["peak_memory_bytes"] if memory else None
        )
        timed = min(arm["step_time"]["samples"], sonar["step_time"]["samples"]) >= MIN_TIMED_STEPS
        entry["step_time_ratio_to_sonar"] = (
            arm["step_time"]["median_s"] / sonar["step_time"]["median_s"] if timed else None
        )
        entry["step_time_note"] = (
            f"ratio of median step times over {min(arm['step_time']['samples'], sonar['step_time']['samples'])}+ "
            "timed steps per arm"
            if timed
            else f"fewer than {MIN_TIMED_STEPS} timed steps per arm"
        )
    # The telemetry per seed (train_step): the elements the spike rule replaced, over the run and at the
    # injected spike's step; the lagged coefficient's smallest value and the one the spike's step gave.
    spike = report["inject_spike"]
    per_seed = arm["clipping"]
    if name == "sonar-spike":
        entry["clipped_elements"] = [sum(run) for run in per_seed]
        if spike is not None:
            entry["clipped_elements_at_spike"] = [run[spike["step"] - 1] for run in per_seed]
    else:
        entry["smallest_coef"] = [min(run) for run in per_seed]
        if spike is not None:
            entry["coef_after_spike"] = [run[spike["step"] - 1] for run in per_seed]
    if updates is not None:
        entry["expert_updates"] = dict(updates)
    control = CONTROLS[name]
    entry["control"] = control
    entry["equals_control_bitwise"] = (
        None
        if equal is None
        else equal and updates["backward"] == updates["expected"] and updates["step"] == 0
    )
    return entry


# What must agree between a run with --inject-spike and its --spike-baseline for the held-out losses to
# pair up seed by seed (same initialization, batches, schedule and held-out batches).
BASELINE_KEYS = ("source", "layers", "steps", "batch_size", "sequence_length", "lr", "warmup_steps",
                 "max_grad_norm", "activation_checkpointing", "dtype", "backend", "data", "heldout_batches",
                 "seeds")  # fmt: skip


def check_baseline(baseline: dict, report: dict, path: str) -> None:
    """Raises UsageError naming the first setting in which the ``--spike-baseline`` report differs from
    this run (:data:`BASELINE_KEYS`, and the spike threshold when both ran the spike rule)."""
    keys = list(BASELINE_KEYS)
    if baseline.get("spike_threshold") is not None and report["spike_threshold"] is not None:
        keys.append("spike_threshold")
    for key in keys:
        if key not in baseline:
            raise UsageError(
                f"--spike-baseline {path}: the report has no {key!r} (written by an older sonar-train)"
            )
        if baseline[key] != report[key]:
            raise UsageError(
                f"--spike-baseline {path}: {key} {baseline[key]!r} there, {report[key]!r} here; the baseline must be "
                "the same run without --inject-spike"
            )


def spike_effect(baseline: dict, report: dict, path: str) -> dict:
    """report.json's ``spike_effect``: per arm that ran the same seeds in both runs (not the controls, which
    repeat their sonar arm on one seed), the held-out loss with the spike minus without it (the
    ``--spike-baseline`` run), paired over the seeds, with its verdict (:func:`heldout_statistics`;
    positive: the spike hurt)."""
    arms = {}
    for name, arm in report["arms"].items():
        base = baseline["arms"].get(name)
        if base is not None and base["seeds"] == arm["seeds"] and name not in CONTROLS.values():
            arms[name] = heldout_statistics(
                base["heldout_losses"], arm["heldout_losses"], name="the spiked run",
                reference="the run without the spike",
            )  # fmt: skip
    return {"baseline": str(Path(path).resolve()), "baseline_commit": baseline.get("commit"), "arms": arms}
