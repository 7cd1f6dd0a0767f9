"""The side-by-side table of the layer benchmark (bench/test_layer.py, `make bench`): per (shape, routing,
phase), each provider's median time with its spread (p10-p90 over the rounds), its time over the
baseline's, TFLOP/s (the phase's GEMM FLOPs: forward 6·T·top_k·H·I, otherwise 18·T·top_k·H·I), peak memory
and its peak over the baseline's. The baseline is standard-fused (transformers' experts, clipping,
torch.optim.AdamW(fused=True)).

One ratio convention everywhere: provider / standard-fused, so below 1 is better (faster, or less memory).
Under each training-step table, sonar's two goals read from the rows: its step time over standard-fused's,
and the share of the layer's expert-gradient bytes its peak saves, (standard-fused peak - sonar peak) /
expert_grad_bytes. A row whose p90 / p10 exceeds :data:`BUSY_SPREAD` was timed on a busy machine and is
marked; the last line says whether the machine was quiet or busy (that, or other processes using more than
:data:`BUSY_OTHERS` of the CPU during the run), and when busy that the time ratios cannot be compared.

:func:`run_info` is what every row records besides its measurement: the device, its name, the versions of
torch, triton and transformers, and the repository's commit.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# The provider every ratio divides by (providers.BASELINE), and the one the goals are read for.
BASELINE = "standard-fused"
SONAR = "sonar"
# p90 / p10 of a row's rounds above this: the machine was busy while it ran (on 2 idle cores every row of
# `make bench` measured 1.04 to 1.16; a 30 % spread is larger than most differences the table shows).
BUSY_SPREAD = 1.3
# Other processes' share of the machine's CPU during the run above this: the machine was busy.
BUSY_OTHERS = 0.10
CONVENTION = f"ratios are provider / {BASELINE}: below 1 is better (faster, less memory)"
BUSY_MARK = " (busy: not comparable)"


def git_commit(root: Path | str) -> tuple[str | None, bool | None]:
    """(short hash of HEAD, whether tracked files differ from it) of the git repository at ``root``;
    (None, None) where git or the repository is missing. Untracked files do not make it dirty (as
    ``git describe --dirty``)."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return commit, bool(status.strip())


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def run_info(root: Path | str) -> dict:
    """What every row of a run records besides its measurement: ``device`` ("cuda" or "cpu"),
    ``device_name`` (the GPU's, or the CPU model), ``versions`` (torch, triton, transformers; None where
    not installed), ``commit`` (short hash of the repository at ``root``) and ``dirty`` (tracked files
    differ from it: the run measured uncommitted code)."""
    import torch

    cuda = torch.cuda.is_available()
    commit, dirty = git_commit(root)
    return {
        "device": "cuda" if cuda else "cpu",
        "device_name": torch.cuda.get_device_name() if cuda else _cpu_name(),
        "versions": {name: _version(name) for name in ("torch", "triton", "transformers")},
        "commit": commit,
        "dirty": dirty,
    }


def ratio(value: float, base: float | None) -> float:
    """``value / base`` (time or memory of a provider over the baseline's): below 1 is better; NaN when
    there is no baseline to divide by."""
    if not base:
        return float("nan")
    return value / base


def saved_share(base_peak: float, sonar_peak: float, expert_grad_bytes: float) -> float:
    """(baseline's peak - sonar's peak) / the layer's expert-gradient bytes: the share of those bytes
    that sonar's peak saves (1.0: all of them; negative: sonar's peak is higher). NaN without them."""
    if not expert_grad_bytes:
        return float("nan")
    return (base_peak - sonar_peak) / expert_grad_bytes


def spread(row: dict) -> float:
    """p90 / p10 of a row's rounds (1.0 is no spread at all)."""
    return row["p90_s"] / row["p10_s"] if row["p10_s"] > 0 else float("inf")


def is_busy(row: dict) -> bool:
    """Whether the row's rounds spread too wide to compare it with another row (:data:`BUSY_SPREAD`)."""
    return spread(row) > BUSY_SPREAD


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process), from /proc/stat and
    getrusage; None where /proc/stat does not exist (not Linux)."""
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
        f"BUSY MACHINE ({where}): {'; '.join(why)}. The time ratios are not comparable: rerun `make bench` "
        "on an idle machine"
    )


def _label(first: dict) -> str:
    device, backend = first["device"], first.get("backend", "triton")
    if device != "cpu":
        return f"{device}, sonar on the {backend} backend"
    if backend == "torch":
        return f"CPU ({first.get('threads', '?')} threads), sonar on the torch backend"
    return "CPU timings (Triton interpreter for the sonar kernels), not kernel performance"


def _header(first: dict) -> str:
    """The run's device, versions and commit, from a row (:func:`run_info`'s fields)."""
    versions = first.get("versions") or {}
    commit = first.get("commit") or "unknown"
    dirty = " (uncommitted changes)" if first.get("dirty") else ""
    return (
        f"{first.get('device_name', first['device'])}; "
        + ", ".join(f"{name} {version}" for name, version in versions.items())
        + f"; commit {commit}{dirty}"
    )


def sonar_goals(group: dict[str, dict]) -> list[str]:
    """The lines under a training-step table: sonar's step time over the baseline's, and the share of the
    layer's expert-gradient bytes its peak saves. ``group``: provider -> row of one (shape, routing, step).
    The time is marked busy when either row is (:func:`is_busy`); the peaks are counted allocations, which
    a busy machine does not change."""
    base, sonar = group.get(BASELINE), group.get(SONAR)
    if base is None or sonar is None:
        return []
    busy = BUSY_MARK if is_busy(sonar) or is_busy(base) else ""
    grad = sonar.get("expert_grad_bytes", 0)
    saved = base["peak_bytes"] - sonar["peak_bytes"]
    return [
        f"  {SONAR} / {BASELINE}: step time {ratio(sonar['median_s'], base['median_s']):.2f}{busy}",
        f"  {SONAR}'s peak saves {saved_share(base['peak_bytes'], sonar['peak_bytes'], grad):.2f} of the "
        f"layer's expert-gradient bytes ({BASELINE} peak - {SONAR} peak = {saved / 2**20:.3f} MiB of "
        f"{grad / 2**20:.3f} MiB)",
    ]


def side_by_side(rows: list[dict], others: float | None = None, cores: int | None = None) -> str:
    """``rows``: dicts with provider, phase, shape, routing, device, flops, median_s, p10_s, p90_s, rounds,
    peak_bytes, expert_grad_bytes (and backend, threads, device_name, versions, commit, dirty).
    ``others`` and ``cores``: see :func:`busy_line`."""
    lines = [
        _header(rows[0]) if rows else "",
        CONVENTION + "; p10-p90: the spread of the rounds around the median; ! marks a busy row",
        "",
    ]
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
        base = group.get(BASELINE)
        first = next(iter(group.values()))
        dims = ", ".join(f"{k} {first[k]}" for k in ("T", "H", "I", "E", "top_k") if k in first)
        what = (
            "training step"
            if phase == "step"
            else f"{phase} (sonar-unfused's is sonar's and the paper's, {BASELINE}'s is standard's)"
        )
        lines.append(f"{shape} ({dims}), {routing} routing, {what}: {_label(first)}")
        lines.append(
            f"  {'provider':<18} {'median ms':>10} {'p10-p90 ms':>17} {'time/base':>9} {'TFLOP/s':>8} "
            f"{'peak MiB':>9} {'mem/base':>8} {'rounds':>6}"
        )
        for name, r in group.items():
            time_ratio = ratio(r["median_s"], base and base["median_s"])
            mem_ratio = ratio(r["peak_bytes"], base and base["peak_bytes"])
            tflops = r["flops"] / r["median_s"] / 1e12
            p10_p90 = f"{1000 * r['p10_s']:.2f}-{1000 * r['p90_s']:.2f}"
            lines.append(
                f"  {name:<18} {1000 * r['median_s']:>10.2f} {p10_p90:>17} {time_ratio:>9.2f} {tflops:>8.4f} "
                f"{r['peak_bytes'] / 2**20:>9.3f} {mem_ratio:>8.2f} {r['rounds']:>6}"
                + (" !" if is_busy(r) else "")
            )
        if phase == "step":
            lines += sonar_goals(group)
        lines.append("")
    lines.append(busy_line(rows, others, cores))
    return "\n".join(lines)
