"""sonar-train's statistics: step times over runs, the held-out difference between two arms over paired
seeds with its verdict in words, and the note on peaks that come out alike (what set them)."""

from __future__ import annotations

import math
import statistics

from sonar_kernels_cli.options import TIMING_WARMUP

# Step times: the first TIMING_WARMUP steps of every run are left out (allocator, caches, lazy state);
# a time ratio is given only when both arms have at least MIN_TIMED_STEPS timed steps.
# (TIMING_WARMUP: the command line's, sonar_kernels_cli.options.)
MIN_TIMED_STEPS = 10

# Held-out differences (nats per byte) smaller than this are "negligible" in the verdicts, whatever their
# standard error: a third of the Sonar-MoE paper's 0.003 bar, far below what changes a model's use (a
# checkpoint run's 1e-5 difference read "standard lower" beside a standard error of 1e-6).
NEGLIGIBLE_DELTA = 0.001

# Peaks within this fraction of each other (sonar against standard) get a note saying what set the peak.
MEMORY_ALIKE = 0.01
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def step_time_summary(times_per_run: list[list[float]]) -> dict:
    """The step times of one arm over its runs (seeds), each run's first ``TIMING_WARMUP`` steps left
    out: median, 10th and 90th percentiles (seconds, None without samples) and the number of samples."""
    samples = sorted(t for times in times_per_run for t in times[TIMING_WARMUP:])
    if not samples:
        return {"median_s": None, "p10_s": None, "p90_s": None, "samples": 0, "warmup_steps": TIMING_WARMUP}
    deciles = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else samples * 9
    return {
        "median_s": statistics.median(samples),
        "p10_s": deciles[0],
        "p90_s": deciles[-1],
        "samples": len(samples),
        "warmup_steps": TIMING_WARMUP,
    }


def speedup(standard: dict, sonar: dict) -> tuple[float | None, str]:
    """standard's median step time over sonar's (> 1: sonar faster), or None and the reason when either
    arm has fewer than ``MIN_TIMED_STEPS`` timed steps."""
    fewest = min(standard["samples"], sonar["samples"])
    if fewest < MIN_TIMED_STEPS:
        return None, (
            f"no time ratio: {fewest} timed steps (after {TIMING_WARMUP} warm-up steps per run), fewer than "
            f"{MIN_TIMED_STEPS}"
        )
    ratio = standard["median_s"] / sonar["median_s"]
    return ratio, f"ratio of median step times over {fewest}+ timed steps per arm"


def heldout_statistics(
    standard: list[float], sonar: list[float], name: str = "sonar", reference: str = "standard"
) -> dict:
    """The held-out difference sonar - standard over paired seeds (same initialization and batches per
    seed): per-seed differences, their mean and its standard error (sample standard deviation / sqrt(n)),
    the standard arm's own seed-to-seed standard deviation, and a verdict in words that states the effect
    size first: negligible when |mean| < ``NEGLIGIBLE_DELTA``, however many standard errors it is (one seed
    included; when 2 standard errors exceed the threshold the verdict adds that the seeds cannot rule out a
    difference that matters), else no difference detectable when |mean| <= 2 standard errors, otherwise
    which arm has the lower loss and by how much; one seed gives no statistical verdict beyond that. ``name`` and
    ``reference``: the two arms' names in the verdict."""
    deltas = [b - a for a, b in zip(standard, sonar, strict=True)]
    n = len(deltas)
    mean = statistics.fmean(deltas)
    result = {
        "seeds": n,
        "deltas": deltas,
        "mean_delta": mean,
        "standard_error": None,
        "standard_seed_sd": None,
        "negligible": abs(mean) < NEGLIGIBLE_DELTA,
        "negligible_below": NEGLIGIBLE_DELTA,
    }
    effect = f"{name} - {reference} {nats(mean)} nats per byte"
    negligible = (
        f"negligible (below {NEGLIGIBLE_DELTA} nats per byte, the smallest difference that matters here)"
    )
    if n < 2:
        verdict = negligible if result["negligible"] else "no statistical verdict"
        result["verdict"] = (
            f"{effect} on one seed: {verdict}; run --seeds 2 or more (3 or more for a useful verdict)"
        )
        return result
    se = statistics.stdev(deltas) / math.sqrt(n)
    result["standard_error"] = se
    result["standard_seed_sd"] = statistics.stdev(standard)
    if result["negligible"] and 2 * se < NEGLIGIBLE_DELTA:
        result["verdict"] = (
            f"{effect} ± {nats(se)[1:]} (standard error): {negligible}, however many standard errors"
        )
    elif result["negligible"]:  # small as measured, but the seeds' spread leaves room for one that matters
        result["verdict"] = (
            f"{effect} ± {se:.4f} (standard error): {negligible} as measured; no difference detectable at this "
            f"scale either (2 standard errors, {2 * se:.4f}, span differences that matter)"
        )
    elif abs(mean) <= 2 * se:
        result["verdict"] = (
            f"{effect}: no difference detectable at this scale (|mean| <= 2 standard errors, {2 * se:.4f})"
        )
    else:
        better = name if mean < 0 else reference
        weak = f"; with {n} seeds a weak test, more seeds narrow it" if n < 5 else ""
        result["verdict"] = (
            f"{better} lower by {abs(mean):.4f} nats per byte (more than 2 standard errors, {2 * se:.4f}{weak})"
        )
    return result


def nats(x: float) -> str:
    """A held-out difference in nats per byte, signed, with 4 decimals, or in scientific notation when
    those would show 0.0000 (a difference of 1e-5 reads +1.0e-05, not +0.0000)."""
    return f"{x:+.4f}" if x == 0 or abs(x) >= 5e-5 else f"{x:+.1e}"


def memory_note(report: dict) -> str | None:
    """Why sonar's peak memory is within ``MEMORY_ALIKE`` of standard's, when it is (None otherwise, or
    when memory was not measured): what set standard's peak (MemTracker's categories, largest first, and the
    phase) and how large the expert gradients that sonar does not keep are against it; a tiny model's peak
    is mostly its activations, so the experts' share is too small to show."""
    standard, sonar = report["arms"]["standard"], report["arms"]["sonar"]
    peak = standard["peak_memory_bytes"]
    if not peak or abs(sonar["peak_memory_bytes"] / peak - 1) >= MEMORY_ALIKE:
        return None
    change = 100 * (sonar["peak_memory_bytes"] / peak - 1)
    gradients = report["expert_parameters"] * DTYPE_BYTES.get(report["dtype"], 4)
    held = standard["peak_memory"]["gradients"]
    why = (
        f"the expert gradients sonar does not keep ({gradients / 2**20:.2f} MiB) are "
        f"{100 * gradients / peak:.1f} % of it"
        if held
        else "it holds no gradients, so the expert gradients sonar does not keep "
        f"({gradients / 2**20:.2f} MiB) cannot lower it"
    )
    return (
        f"peak memory sonar / standard {change:+.1f} %: standard's peak ({peak / 2**20:.2f} MiB, in the "
        f"{standard['peak_phase']}) is {peak_shares(standard)}; {why}"
    )


def peak_shares(arm: dict) -> str:
    """An arm's peak by category, largest first, e.g. "82 % activations, 11 % parameters" (shares below
    1 % left out)."""
    peak = arm["peak_memory_bytes"]
    parts = sorted(((v, k) for k, v in arm["peak_memory"].items() if v >= 0.01 * peak), reverse=True)
    return ", ".join(f"{100 * v / peak:.0f} % {k.replace('_', ' ')}" for v, k in parts)


def paired_difference(arm: dict, standard: dict) -> float:
    """Mean over the seeds both arms ran of (arm's held-out loss - standard's)."""
    by_seed = dict(zip(standard["seeds"], standard["heldout_losses"], strict=True))
    return statistics.fmean(
        loss - by_seed[seed]
        for seed, loss in zip(arm["seeds"], arm["heldout_losses"], strict=True)
        if seed in by_seed
    )
