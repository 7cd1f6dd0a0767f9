"""Where AdamW's bias corrections come from on CUDA: beta ** step as torch's fused AdamW computes it, against
torch.pow and against the two powers a Triton kernel could compute itself (kernels/adamw.py says why the
"fp32" arithmetic reads torch.pow's).

    python bench/check_bias_corrections.py --out PATH    # CUDA only; about 10 s

1. torch.optim.AdamW(fused=True) at steps 1..S (one 1-element parameter per step, p = 0, g = 1, lr = 1,
   eps = 0, no weight decay, so p' = -(m / bc1) / (sqrt(v) / sqrt(bc2)) exposes both corrections) against
   the same expression with bc = 1 - torch.pow(fp32 beta, fp32 step): the steps that differ.
2. beta ** step for steps 1..N in fp32: Triton's libdevice pow on fp32 operands, libdevice's fp64 pow rounded
   to fp32, and exp2(step * log2(beta)), each against torch.pow: the steps that differ.
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
import triton
import triton.language as tl
from triton.language.extra import libdevice

ROOT = Path(__file__).resolve().parents[1]
BETA_PAIRS = ((0.9, 0.999), (0.9, 0.95), (0.8, 0.99))
BETAS = (0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9999)
MODES = ("libdevice fp32 pow", "libdevice fp64 pow rounded", "exp2(step * log2(beta))")


@triton.jit
def _powers_kernel(beta_ptr, out_ptr, N, MODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    step = (offs + 1).to(tl.float32)
    beta = tl.load(beta_ptr) + tl.zeros_like(step)
    if MODE == 0:
        power = libdevice.pow(beta, step)
    elif MODE == 1:
        power = libdevice.pow(beta.to(tl.float64), step.to(tl.float64)).to(tl.float32)
    else:
        power = libdevice.exp2(step * libdevice.log2(beta))
    tl.store(out_ptr + offs, power, mask=offs < N)


def fused_adamw_against_torch_pow(beta1: float, beta2: float, steps: int) -> dict:
    params = [torch.nn.Parameter(torch.zeros(1, device="cuda")) for _ in range(steps)]
    optimizer = torch.optim.AdamW(params, lr=1.0, betas=(beta1, beta2), eps=0.0, weight_decay=0.0, fused=True)
    for done, p in enumerate(params):
        p.grad = torch.ones(1, device="cuda")
        optimizer.state[p] = {
            "step": torch.tensor(float(done), device="cuda"),
            "exp_avg": torch.zeros(1, device="cuda"),
            "exp_avg_sq": torch.zeros(1, device="cuda"),
        }
    optimizer.step()
    fused = torch.cat([p.detach() for p in params])
    step = torch.arange(1, steps + 1, dtype=torch.float32, device="cuda")
    b1, b2 = torch.tensor(beta1, device="cuda"), torch.tensor(beta2, device="cuda")
    m, v = 1 - b1, 1 - b2  # fma(b, 0, fma(-b, 1, 1)): 1 - b, rounded once
    bc1, bc2_sqrt = 1 - torch.pow(b1, step), torch.sqrt(1 - torch.pow(b2, step))
    expected = -((1.0 / bc1) * m) / (torch.sqrt(v) / bc2_sqrt)
    differ = (fused != expected).nonzero().flatten()
    return {"steps": steps, "differing_steps": int(differ.numel()), "first": [int(i) + 1 for i in differ[:8]]}


def triton_powers_against_torch_pow(beta: float, steps: int) -> dict:
    b = torch.tensor([beta], dtype=torch.float32, device="cuda")
    expected = torch.pow(b, torch.arange(1, steps + 1, dtype=torch.float32, device="cuda"))
    row = {}
    for mode, name in enumerate(MODES):
        out = torch.empty(steps, dtype=torch.float32, device="cuda")
        _powers_kernel[(triton.cdiv(steps, 1024),)](b, out, steps, MODE=mode, BLOCK=1024)
        differ = (out != expected).nonzero().flatten()
        row[name] = {"differing_steps": int(differ.numel()), "first": [int(i) + 1 for i in differ[:8]]}
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON output path")
    parser.add_argument("--fused-steps", type=int, default=3000)
    parser.add_argument("--power-steps", type=int, default=100_000)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_bias_corrections.py needs a CUDA GPU (torch's fused CUDA AdamW and CUDA's powf)")
        return 2
    commit = os.environ.get("SONAR_COMMIT")  # as gpu_bench.py: a copied tree's git HEAD may be another
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True, check=True).stdout.strip()  # fmt: skip
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    result = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
        "fused_adamw_vs_torch_pow": {
            f"{b1},{b2}": fused_adamw_against_torch_pow(b1, b2, args.fused_steps) for b1, b2 in BETA_PAIRS
        },
        "triton_powers_vs_torch_pow": {
            str(beta): triton_powers_against_torch_pow(beta, args.power_steps) for beta in BETAS
        },
        "power_steps": args.power_steps,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for pair, row in result["fused_adamw_vs_torch_pow"].items():
        print(
            f"fused AdamW vs torch.pow, betas {pair}: {row['differing_steps']} of {row['steps']} steps differ"
        )
    for beta, row in result["triton_powers_vs_torch_pow"].items():
        print(f"beta {beta}: " + "; ".join(f"{k} {v['differing_steps']}" for k, v in row.items())
              + f" of {args.power_steps} steps differ from torch.pow")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
