"""sonar-train's report from the finished runs: each arm's results over its seeds, the memory and timing
passes, and the verdicts between arms (the held-out statistics, the bitwise controls, the counted expert
updates). The same records make the report of a run that ran through, of one resumed after Ctrl-C
(``--resume``) and, as far as they go, the partial report of an interrupted one."""

from __future__ import annotations

import statistics
from pathlib import Path

from sonar_kernels.rules.compiled import first_call_seconds
from sonar_kernels.train.arms import CONTROLS
from sonar_kernels.train.stats import heldout_statistics, memory_note, speedup, step_time_summary
from sonar_kernels.train.verdicts import clipping_entry, spike_effect


def aggregate(runs: list[dict]) -> dict:
    """One arm's results over the seeds it ran: per-seed lists and their summaries (``clipping``: the
    expert-clipping arms' per-step telemetry per seed, else None)."""
    heldout = [r["heldout_loss"] for r in runs]
    clip = [r["clip_fraction"] for r in runs]
    return {
        "clipping": None if runs[0]["clipping"] is None else [r["clipping"] for r in runs],
        "seeds": [r["seed"] for r in runs],
        "heldout_losses": heldout,
        "heldout_loss": statistics.fmean(heldout),
        "train_losses": [r["train_losses"] for r in runs],
        "grad_norms": [r["grad_norms"] for r in runs],
        "clip_fractions": clip,
        "clip_fraction": statistics.fmean(clip),
        "step_times_s": [r["step_times_s"] for r in runs],
        "step_time": (timing := step_time_summary([r["step_times_s"] for r in runs])),
        "step_time_s": timing["median_s"],
    }


def by_arm(records: dict, order: list[tuple[int, str]]) -> dict[str, list[dict]]:
    """The finished runs' records ({(seed, arm): record}) per arm, in the run's order of seeds; an arm with
    no finished run is left out."""
    arms = {}
    for key in order:
        if key in records:
            arms.setdefault(key[1], []).append(records[key])
    return arms


def assemble(report: dict, args, records: dict, order: list, memory: dict, timing: tuple) -> dict:
    """Completes ``report`` (the run's header) from every run's record (``cli``: its ``run_arm`` result with
    ``seed``, ``updates``, ``expert_tensors``, ``checksums``, ``saved`` and, for the second of a bitwise
    pair, ``equal``), the memory pass (per arm) and the timing pass ((step times per arm or None, note))."""
    runs = by_arm(records, order)
    times, report["timing"] = timing
    # The torch backend's compiled update rules (8-bit moments, master weights): the seconds their first
    # calls took in this process (compilation included), which no reported step time contains.
    report["rule_compile_s"] = round(first_call_seconds(), 2)
    # Per sonar arm with a control: its expert updates counted in the backward and in step(), and expected.
    updates = {
        name: {kind: sum(r["updates"][kind] for r in runs[name]) for kind in ("backward", "step", "expected")}
        for name in CONTROLS
        if name in args.arms
    }
    equal = {}  # sonar arm -> its parameters equal its control's, bit for bit (first seed)
    for record in records.values():
        if record.get("expert_tensors") is not None:
            report["expert_tensors"] = record["expert_tensors"]
        if record.get("saved") is not None:
            report["saved"] = record["saved"]
        if record.get("equal") is not None:
            equal[record["equal"]["arm"]] = record["equal"]["value"]
        if record.get("checksums") is not None:
            for kind, sums in record["checksums"].items():
                report["distributed"][f"{kind}_checksums"][record["arm"]] = sums
    for name in args.arms:
        report["arms"][name] = aggregate(runs[name])
        report["arms"][name].update(memory[name])
        if times is not None:  # the side-by-side rounds replace the training runs' times
            arm = report["arms"][name]
            arm["training_step_time"] = arm["step_time"]
            arm["step_time"] = step_time_summary([times[name]])
            arm["step_time_s"] = arm["step_time"]["median_s"]
    if "sonar" in args.arms:
        report["sonar_expert_updates_in_backward"] = updates["sonar"]["backward"]
        report["sonar_expert_updates_in_step"] = updates["sonar"]["step"]
        report["sonar_expert_updates_expected"] = updates["sonar"]["expected"]
    if "sonar" in equal:
        counted = updates["sonar"]
        report["sonar_equals_control_bitwise"] = (
            counted["backward"] == counted["expected"] and counted["step"] == 0 and equal["sonar"]
        )
    if "sonar-remainder" in equal:  # its experts' fp32 masters (weight and remainder) and dense weights
        report["remainder_equals_control_bitwise"] = equal["sonar-remainder"]
    if "sonar" in report["arms"] and "standard" in report["arms"]:
        sonar_arm, standard_arm = report["arms"]["sonar"], report["arms"]["standard"]
        report["heldout"] = heldout_statistics(standard_arm["heldout_losses"], sonar_arm["heldout_losses"])
        report["heldout_loss_delta"] = report["heldout"]["mean_delta"]
        report["peak_memory_reduction"] = (
            1 - sonar_arm["peak_memory_bytes"] / standard_arm["peak_memory_bytes"] if args.memory else None
        )
        report["peak_memory_note"] = memory_note(report) if args.memory else None
        report["speedup"], report["speedup_note"] = speedup(standard_arm["step_time"], sonar_arm["step_time"])
    clipped = [name for name in ("sonar-spike", "sonar-lagged") if name in report["arms"]]
    if clipped:
        report["expert_clipping"] = {
            name: clipping_entry(name, report, updates.get(name), equal.get(name), args.memory)
            for name in clipped
        }
    if args.baseline_report is not None:
        report["spike_effect"] = spike_effect(args.baseline_report, report, args.spike_baseline)
    if "mixed-precision" in report["arms"]:  # bf16 arms against standard mixed-precision AdamW
        reference = report["arms"]["mixed-precision"]
        report["versus_mixed_precision"] = {
            name: {
                "heldout": heldout_statistics(
                    reference["heldout_losses"], arm["heldout_losses"], name=name, reference="mixed-precision"
                ),
                "peak_memory_ratio": (
                    arm["peak_memory_bytes"] / reference["peak_memory_bytes"] if args.memory else None
                ),
            }
            for name, arm in report["arms"].items()
            if name != "mixed-precision" and name not in CONTROLS.values()
        }
    for arm, suffix in (("sonar-8bit", "8bit"), ("torchao-8bit", "torchao_8bit")):
        if arm in report["arms"] and "standard" in report["arms"]:
            eight_bit, standard_arm = report["arms"][arm], report["arms"]["standard"]
            report[f"heldout_{suffix}"] = heldout_statistics(
                standard_arm["heldout_losses"], eight_bit["heldout_losses"], name=arm
            )
            report[f"peak_memory_ratio_{suffix}"] = (
                eight_bit["peak_memory_bytes"] / standard_arm["peak_memory_bytes"] if args.memory else None
            )
    if "distributed" in report:
        # Replicated weights must be identical on every rank: the dense ones always, the experts when
        # they are replicated (data parallel).
        replicated = ("dense",) if args.ep > 1 else ("dense", "expert")
        report["distributed"]["ranks_agree"] = all(
            len(set(sums)) == 1
            for kind in replicated
            for sums in report["distributed"][f"{kind}_checksums"].values()
        )
    return report


def partial(report: dict, records: dict, order: list, memory: dict | None, folder: Path) -> dict:
    """The report of an interrupted run: its header, ``partial`` (what finished and what is missing, and the
    command that resumes it) and, per arm with a finished run, its results over the seeds that finished (no
    verdict: they need every seed)."""
    report = dict(report, arms={})
    for name, runs in by_arm(records, order).items():
        report["arms"][name] = aggregate(runs)
        if memory is not None:
            report["arms"][name].update(memory[name])
    report["partial"] = {
        "finished": [f"seed {seed} {name}" for seed, name in order if (seed, name) in records],
        "missing": [f"seed {seed} {name}" for seed, name in order if (seed, name) not in records],
        "memory_pass": memory is not None,
        "resume": f"sonar-train --resume {folder}",
    }
    return report
