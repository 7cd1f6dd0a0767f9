"""Check the fused AdamW backward at real layer shapes: fused vs split bit for bit, and against
torch.optim.AdamW(fused=True) fed the split path's own gradient (the share of differing elements and the
worst difference in ulps, since the arithmetics may round differently; see sonar_kernels/kernels/adamw.py).

Usage:
    python bench/check_backward.py            # CUDA: an OLMoE-1B-7B expert layer, bf16 and fp32 weights
    python bench/check_backward.py --small    # tiny shapes; on CPU the Triton interpreter (the tests run it)
    python bench/check_backward.py --out PATH # where the JSON goes (default bench/results/<date>-<device>-backward-check.json)

Needs only the package and its dependencies (no network): put the repository on PYTHONPATH or install it
with ``pip install --no-deps --no-build-isolation -e .``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

if __name__ == "__main__" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before sonar_kernels is imported (run as a script)

import triton

import sonar_kernels

ROOT = Path(__file__).resolve().parents[1]
# name: (tokens T, hidden H, expert intermediate I, experts E, top_k)
SHAPES = {
    "olmoe-1b-7b": (4096, 2048, 1024, 64, 8),
    "granite-3.1-3b-a800m": (4096, 1536, 512, 40, 8),
    "small": (48, 96, 40, 6, 2),
    # gpu_bench.py --rehearse's stand-ins of the two models (H and I multiples of the 8-bit moments' block).
    "rehearsal-olmoe": (48, 96, 64, 6, 2),
    "rehearsal-granite": (40, 64, 32, 5, 2),
}
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def _inputs(shape, dtype, device):
    T, H, I, E, top_k = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=generator)
    logits = torch.randn(T, E, generator=generator)
    top_logits, index = logits.topk(top_k, dim=1)
    weights = torch.softmax(top_logits, dim=1)
    w1 = torch.randn(E, 2 * I, H, generator=generator) / H**0.5
    w2 = torch.randn(E, H, I, generator=generator) / I**0.5
    grad_out = torch.randn(T, H, generator=generator)
    act = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    return (
        x.to(device, act),
        index.to(device),
        weights.to(device, act),
        w1.to(device, dtype),
        w2.to(device, dtype),
        grad_out.to(device, act),
    )


def _ulps(actual, expected):
    """Worst |actual - expected| in ulps of ``expected``'s dtype at the magnitude of the larger of the two."""
    scale = torch.maximum(actual.abs(), expected.abs()).float().clamp_min(torch.finfo(expected.dtype).tiny)
    _, exponent = torch.frexp(scale)
    mantissa_bits = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[expected.dtype]
    ulp = torch.ldexp(torch.ones_like(scale), exponent - 1 - mantissa_bits)
    return float(((actual.float() - expected.float()).abs() / ulp).max())


def check(shape_name: str, dtype: torch.dtype, device: str) -> dict:
    x, index, weights, w1, w2, grad_out = _inputs(SHAPES[shape_name], dtype, device)
    updated = {}
    for fused in (True, False):
        p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
        optimizer = sonar_kernels.ExpertAdamW([p1, p2], **HYPER, fused_epilogue=fused)
        sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend="triton").backward(grad_out)
        assert p1.grad is None and p2.grad is None
        updated[fused] = [
            (p, optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"]) for p in (p1, p2)
        ]
        del optimizer
    fused_equals_split = all(
        torch.equal(a, b)
        for fa, sa in zip(updated[True], updated[False], strict=True)
        for a, b in zip(fa, sa, strict=True)
    )
    # torch.optim.AdamW(fused=True) fed the gradient the split path writes (the plain-gradient kernels).
    q1, q2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    sonar_kernels.moe_mlp(x, index, weights, q1, q2, backend="triton").backward(grad_out)
    reference = torch.optim.AdamW([q1, q2], **HYPER, fused=True)
    reference.step()
    vs_torch = {}
    for name, (p, m, v), q in zip(("gate_up_proj", "down_proj"), updated[True], (q1, q2), strict=True):
        state = reference.state[q]
        for key, a, b in (
            ("W", p, q),
            ("exp_avg", m, state["exp_avg"]),
            ("exp_avg_sq", v, state["exp_avg_sq"]),
        ):
            vs_torch[f"{name}.{key}"] = {
                "differing_fraction": float((a != b).float().mean()),
                "max_ulps": _ulps(a.detach(), b.detach()),
                # an ulp count is large where both values are near zero: the absolute difference beside it
                "max_abs": float((a.detach().float() - b.detach().float()).abs().max()),
            }
    return {
        "shape": shape_name,
        "T_H_I_E_top_k": SHAPES[shape_name],
        "weight_dtype": str(dtype),
        "fused_equals_split_bitwise": fused_equals_split,
        "vs_torch_adamw_fused": vs_torch,
    }


# The state kinds beyond the paper (docs/design.md): ExpertAdamW's options for each.
STATE_KINDS = {
    "8bit": {"moments_dtype": "8bit"},
    "remainder": {"master_weights": "remainder"},
    "stochastic": {"master_weights": "stochastic", "rounding_seed": 7},
    # Expert clipping's spike rule (docs/design.md, "Expert clipping"), at a threshold low enough that the
    # second update replaces elements (the first has exp_avg_sq 0: the rule does nothing there).
    "spike": {"expert_clipping": "spike", "spike_threshold": 1.0},
}


def check_state_kinds(shape_name: str, device: str) -> dict:
    """bf16 weights with each of :data:`STATE_KINDS`: one update through the fused epilogue and one through
    the split path from the same weights and gradient give the same bits (weights and every state tensor:
    8-bit codes and scales, the remainder, moments), the project's rule for every state kind; with expert
    clipping two updates, the second with the rule firing (``rule_fired``)."""
    x, index, weights, w1, w2, grad_out = _inputs(SHAPES[shape_name], torch.bfloat16, device)
    kinds = {}
    for kind, options in STATE_KINDS.items():
        runs = {}
        for fused in (True, False):
            p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
            optimizer = sonar_kernels.ExpertAdamW([p1, p2], **HYPER, **options, fused_epilogue=fused)
            clipped = 0
            for scale in (1.0, 3.0) if "expert_clipping" in options else (1.0,):
                sonar_kernels.moe_mlp(x, index, weights, p1, p2, backend="triton").backward(grad_out * scale)
                optimizer.step()
                clipped = int(optimizer.expert_clipped_elements())
            assert p1.grad is None and p2.grad is None
            runs[fused] = [p.detach().clone() for p in (p1, p2)] + [
                t.clone()
                for p in (p1, p2)
                for t in optimizer.state[p].values()
                if isinstance(t, torch.Tensor)
            ]
            del optimizer
        moved = not torch.equal(runs[True][0], w1)
        kinds[kind] = {
            "fused_equals_split_bitwise": all(
                torch.equal(a, b) for a, b in zip(runs[True], runs[False], strict=True)
            ),
            "weights_changed": moved,
            "finite": all(bool(torch.isfinite(t.float()).all()) for t in runs[True][:2]),
        }
        if "expert_clipping" in options:
            kinds[kind]["rule_fired"] = clipped > 0
    return {
        "shape": shape_name,
        "T_H_I_E_top_k": SHAPES[shape_name],
        "weight_dtype": "torch.bfloat16",
        "kinds": kinds,
        "passed": all(all(v.values()) for v in kinds.values()),
    }


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU interpreter, tests)")
    parser.add_argument("--out", type=Path, help="JSON output path")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = "small" if args.small or device == "cpu" else "olmoe-1b-7b"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    rows = [check(shape, dtype, device) for dtype in (torch.bfloat16, torch.float32)]
    result = {
        "date": datetime.date.today().isoformat(),
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": _commit(),
        "checks": rows,
    }
    out = (
        args.out
        or ROOT
        / "bench"
        / "results"
        / f"{result['date']}-{device_name.split()[0].lower()}-backward-check.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for row in rows:
        worst = max(v["max_ulps"] for v in row["vs_torch_adamw_fused"].values())
        differing = max(v["differing_fraction"] for v in row["vs_torch_adamw_fused"].values())
        print(
            f"{row['shape']} {row['weight_dtype']}: fused == split bitwise: {row['fused_equals_split_bitwise']}; "
            f"vs torch.optim.AdamW(fused=True): up to {differing:.2e} of elements differ, worst {worst:.1f} ulp"
        )
    print(f"wrote {out}")
    return 0 if all(row["fused_equals_split_bitwise"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
