"""The side-by-side table of the layer benchmark (bench/test_layer.py, `make bench`): per (shape, routing,
phase), each provider's median time with its spread (p10-p90 over the rounds), its time over standard's,
TFLOP/s (the phase's GEMM FLOPs: forward 6·T·top_k·H·I, otherwise 18·T·top_k·H·I), peak memory and its
peak over standard's.

One ratio convention everywhere: provider / standard, so below 1 is better (faster, or less memory).
A row whose p90 / p10 exceeds :data:`BUSY_SPREAD` was timed on a busy machine and is marked; the last line
says whether the machine was quiet or busy (that, or other processes using more than :data:`BUSY_OTHERS`
of the CPU during the run), and when busy that the ratios cannot be compared.
"""

from __future__ import annotations

# p90 / p10 of a row's rounds above this: the machine was busy while it ran (on 2 idle cores every row of
# `make bench` measured 1.04 to 1.16; a 30 % spread is larger than most differences the table shows).
BUSY_SPREAD = 1.3
# Other processes' share of the machine's CPU during the run above this: the machine was busy.
BUSY_OTHERS = 0.10
CONVENTION = "ratios are provider / standard: below 1 is better (faster, less memory)"


def ratio(value: float, standard: float | None) -> float:
    """``value / standard`` (time or memory of a provider over standard's): below 1 is better; NaN when
    there is no standard to divide by."""
    if not standard:
        return float("nan")
    return value / standard


def spread(row: dict) -> float:
    """p90 / p10 of a row's rounds (1.0 is no spread at all)."""
    return row["p90_s"] / row["p10_s"] if row["p10_s"] > 0 else float("inf")


def is_busy(row: dict) -> bool:
    """Whether the row's rounds spread too wide to compare it with another row (:data:`BUSY_SPREAD`)."""
    return spread(row) > BUSY_SPREAD


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process), from /proc/stat and
    getrusage; None where /proc/stat does not exist (not Linux)."""
    import os
    import resource

    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    own = resource.getrusage(resource.RUSAGE_SELF)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), own.ru_utime + own.ru_stime


def others_share(before, after, wall_s: float, cores: int) -> float | None:
    """The share of the machine's CPU (``cores`` x ``wall_s``) that other processes used between two
    :func:`cpu_seconds` readings; None without them."""
    if before is None or after is None or wall_s <= 0:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(others, 0.0) / (wall_s * cores)


def busy_line(rows: list[dict], others: float | None = None, cores: int | None = None) -> str:
    """The verdict under the table. Busy when a row's p90/p10 exceeds :data:`BUSY_SPREAD` or other
    processes used more than :data:`BUSY_OTHERS` of the machine's CPU during the run (``others``, from
    :func:`others_share`; ``cores``: the CPU count), else quiet."""
    busy = [r for r in rows if is_busy(r)]
    widest = max((spread(r) for r in rows), default=1.0)
    where = f"widest p90/p10 {widest:.2f}"
    if others is not None:
        where += f"; other processes used {100 * others:.0f} % of the {cores} cores during the run"
    if not busy and (others is None or others <= BUSY_OTHERS):
        return f"quiet machine ({where}): the ratios can be compared"
    why = []
    if busy:
        why.append(f"p90/p10 above {BUSY_SPREAD} in {len(busy)} of {len(rows)} rows (marked !)")
    if others is not None and others > BUSY_OTHERS:
        why.append(f"other processes above {100 * BUSY_OTHERS:.0f} % of the CPU")
    return (
        f"BUSY MACHINE ({where}): {'; '.join(why)}. The ratios are not comparable: rerun `make bench` "
        "on an idle machine"
    )


def _label(first: dict) -> str:
    device, backend = first["device"], first.get("backend", "triton")
    if device != "cpu":
        return f"{device}, sonar on the {backend} backend"
    if backend == "torch":
        return f"CPU ({first.get('threads', '?')} threads), sonar on the torch backend"
    return "CPU timings (Triton interpreter for the sonar kernels), not kernel performance"


def side_by_side(rows: list[dict], others: float | None = None, cores: int | None = None) -> str:
    """``rows``: dicts with provider, phase, shape, routing, device, flops, median_s, p10_s, p90_s, rounds,
    peak_bytes (and backend, threads). ``others`` and ``cores``: see :func:`busy_line`."""
    lines = [CONVENTION + "; p10-p90: the spread of the rounds around the median; ! marks a busy row", ""]
    order = {"forward": 0, "forward+backward": 1, "step": 2}
    keys = sorted(
        {(r["shape"], r["routing"], r["phase"]) for r in rows}, key=lambda k: (k[0], k[1], order[k[2]])
    )
    for shape, routing, phase in keys:
        group = {
            r["provider"]: r
            for r in rows
            if (r["shape"], r["routing"], r["phase"]) == (shape, routing, phase)
        }
        base = group.get("standard")
        what = (
            "training step"
            if phase == "step"
            else f"{phase} (sonar-unfused: the kernels of all four sonar providers)"
        )
        lines.append(f"{shape}, {routing} routing, {what}: {_label(next(iter(group.values())))}")
        lines.append(
            f"  {'provider':<18} {'median ms':>10} {'p10-p90 ms':>17} {'time/std':>8} {'TFLOP/s':>8} "
            f"{'peak MiB':>9} {'mem/std':>7} {'rounds':>6}"
        )
        for name, r in group.items():
            time_ratio = ratio(r["median_s"], base and base["median_s"])
            mem_ratio = ratio(r["peak_bytes"], base and base["peak_bytes"])
            tflops = r["flops"] / r["median_s"] / 1e12
            p10_p90 = f"{1000 * r['p10_s']:.2f}-{1000 * r['p90_s']:.2f}"
            lines.append(
                f"  {name:<18} {1000 * r['median_s']:>10.2f} {p10_p90:>17} {time_ratio:>8.2f} {tflops:>8.4f} "
                f"{r['peak_bytes'] / 2**20:>9.3f} {mem_ratio:>7.2f} {r['rounds']:>6}"
                + (" !" if is_busy(r) else "")
            )
        if base and "sonar-fused" in group:
            fused = group["sonar-fused"]
            lines.append(
                f"  sonar-fused / standard: step time {ratio(fused['median_s'], base['median_s']):.2f}, "
                f"peak memory {ratio(fused['peak_bytes'], base['peak_bytes']):.2f}"
                + (" (busy: not comparable)" if is_busy(fused) or is_busy(base) else "")
            )
        lines.append("")
    lines.append(busy_line(rows, others, cores))
    return "\n".join(lines)
