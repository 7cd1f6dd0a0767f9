"""Layer check: one MoE expert layer of OLMoE's shape family (scaled down): the Triton forward and backward
against the float64 reference, then training steps with ExpertAdamW, the AdamW update applied inside the
backward's wgrad kernels (no expert gradient tensor), checked bit for bit against the split path.

On a machine without CUDA the Triton kernels run under the interpreter (slow: keep shapes small).
"""

import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before sonar_kernels is imported

import sonar_kernels
from sonar_kernels import reference


def main(T=256, H=128, I=64, E=16, top_k=4):  # OLMoE-1B-7B: H 2048, I 1024, E 64, top-8
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    experts = sonar_kernels.SonarExperts(E, H, I, backend="triton", device=device, dtype=torch.bfloat16)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    router_logits = torch.randn(T, E, device=device)
    top_k_logits, top_k_index = router_logits.topk(top_k, dim=-1)
    top_k_weights = torch.softmax(top_k_logits, dim=-1).to(x.dtype)

    if device == "cpu":
        print("Triton interpreter on CPU: the forward, the backward and 4 training steps take a few minutes")
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
    # The bound the tests hold the bf16 forward to (tests/numerics.py): it rounds four times (Hpre, the
    # activation, each expert output, the combined output), so 4 unit roundoffs, 4 * 2**-8.
    bound = 4 * 2.0**-8
    verdict = "within" if err <= bound else "ABOVE"
    print(
        f"  forward: {elapsed:.2f} s; normwise error vs float64 reference: {err:.2e}, {verdict} the bf16 "
        f"bound {bound:.2e} (4 unit roundoffs)"
    )
    if not err <= bound:
        raise SystemExit(f"the forward's error {err:.2e} exceeds the bf16 bound {bound:.2e}")
    start = time.perf_counter()
    out.float().square().mean().backward()
    elapsed = time.perf_counter() - start
    grad = experts.gate_up_proj.grad
    print(
        f"  backward: {elapsed:.2f} s; grad of gate_up_proj {tuple(grad.shape)} {grad.dtype}, norm {grad.float().norm():.3e}"
    )

    # Training with the update in the backward: the wgrad epilogue applies AdamW to W, exp_avg and
    # exp_avg_sq; .grad stays None. The split path (gradient written, then a standalone AdamW kernel)
    # must give the same bits.
    results = []
    for fused in (True, False):
        model = sonar_kernels.SonarExperts(E, H, I, backend="triton", device=device, dtype=torch.bfloat16)
        model.load_state_dict(experts.state_dict())
        optimizer = sonar_kernels.ExpertAdamW(
            model.parameters(), lr=1e-3, weight_decay=0.1, fused_epilogue=fused
        )
        for _ in range(2):
            loss = model(x, top_k_index, top_k_weights).float().square().mean()
            loss.backward()
            assert model.gate_up_proj.grad is None and model.down_proj.grad is None
            optimizer.step()
            optimizer.zero_grad()
        results.append([t.detach().clone() for t in model.parameters()])
    same = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    moved = float((results[0][0].float() - experts.gate_up_proj.detach().float()).norm())
    print(
        f"  ExpertAdamW, 2 steps: .grad stays None; ||W1 - W1_0|| = {moved:.3e}; fused == split bitwise: {same}"
    )
    if not same:
        raise SystemExit("fused and split updates differ")


if __name__ == "__main__":
    main()
