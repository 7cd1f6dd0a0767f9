"""Quickstart: one MoE expert layer of OLMoE's shape family (scaled down), Triton forward vs the reference.

On a machine without CUDA the Triton kernels run under the interpreter (slow: keep shapes small).
"""

import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before sonar_kernels is imported

import sonar_kernels
from sonar_kernels import reference


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    T, H, I, E, top_k = 256, 128, 64, 16, 4  # OLMoE-1B-7B: H 2048, I 1024, E 64, top-8
    experts = sonar_kernels.SonarExperts(E, H, I, backend="triton", device=device, dtype=torch.bfloat16)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    router_logits = torch.randn(T, E, device=device)
    top_k_logits, top_k_index = router_logits.topk(top_k, dim=-1)
    top_k_weights = torch.softmax(top_k_logits, dim=-1).to(x.dtype)

    start = time.perf_counter()
    out = experts(x, top_k_index, top_k_weights)
    elapsed = time.perf_counter() - start
    exact = reference.moe_mlp(
        x.double(), top_k_index, top_k_weights.double(),
        experts.gate_up_proj.detach().double(), experts.down_proj.detach().double(),
    )  # fmt: skip
    err = float((out.detach().double() - exact).norm() / exact.norm())
    mode = "compiled" if device == "cuda" else "Triton interpreter on CPU"
    print(f"SonarExperts(E={E}, H={H}, I={I}, top_k={top_k}) on {T} tokens, bf16, {mode}")
    print(
        f"  forward: {elapsed:.2f} s; normwise error vs float64 reference: {err:.2e} (bf16 unit roundoff 3.9e-03)"
    )
    out.float().square().mean().backward()
    print(
        f"  backward: grad of gate_up_proj {tuple(experts.gate_up_proj.grad.shape)}, norm {experts.gate_up_proj.grad.float().norm():.3e}"
    )


if __name__ == "__main__":
    main()
