"""The side-by-side table of the layer benchmark: per (shape, routing, phase), each provider's median
time, TFLOP/s (the phase's GEMM FLOPs: forward 6·T·top_k·H·I, otherwise 18·T·top_k·H·I), peak memory and
ratios to the standard provider."""

from __future__ import annotations


def side_by_side(rows: list[dict]) -> str:
    """``rows``: dicts with provider, phase, shape, routing, device, flops, median_s, rounds, peak_bytes."""
    lines = []
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
        first = next(iter(group.values()))
        device, backend = first["device"], first.get("backend", "triton")
        if device != "cpu":
            label = device
        elif backend == "torch":
            label = f"CPU ({first.get('threads', '?')} threads), sonar on the torch backend"
        else:
            label = "CPU timings (Triton interpreter for the sonar kernels), not kernel performance"
        what = (
            "training step"
            if phase == "step"
            else f"{phase} (sonar-unfused: the kernels of all four sonar providers)"
        )
        lines.append(f"{shape}, {routing} routing, {what}: {label}")
        lines.append(
            f"  {'provider':<18} {'median ms':>10} {'vs standard':>11} {'TFLOP/s':>8} {'peak MiB':>9} {'vs standard':>11} {'rounds':>6}"
        )
        for name, r in group.items():
            speed = base["median_s"] / r["median_s"] if base else float("nan")
            mem = r["peak_bytes"] / base["peak_bytes"] if base and base["peak_bytes"] else float("nan")
            tflops = r["flops"] / r["median_s"] / 1e12
            lines.append(
                f"  {name:<18} {1000 * r['median_s']:>10.2f} {speed:>10.2f}x {tflops:>8.4f} "
                f"{r['peak_bytes'] / 2**20:>9.3f} {mem:>10.2f}x {r['rounds']:>6}"
            )
        if base and "sonar-fused" in group:
            fused = group["sonar-fused"]
            lines.append(
                f"  sonar-fused / standard: step time {fused['median_s'] / base['median_s']:.2f}x, "
                f"peak memory {fused['peak_bytes'] / base['peak_bytes']:.2f}x"
            )
        lines.append("")
    return "\n".join(lines)
