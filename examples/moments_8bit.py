"""8-bit AdamW moments for the experts (``moments_dtype="8bit"``) on a tiny OLMoE whose experts run "sonar"
(docs/usage.md, "8-bit moments").

    python examples/moments_8bit.py

Each expert weight matrix keeps its exp_avg and exp_avg_sq as one 8-bit code per element and one fp32 scale
per block of 32 elements along its last dimension: 2.25 bytes per parameter for both moments, against 8 in
fp32. The update dequantizes them, runs AdamW in fp32 and quantizes them again, inside the backward. The
last dimension of every expert weight must be a multiple of 32 (here H = I = 32); the dense parameters keep
torch.optim.AdamW's fp32 moments.

What it checks:

- the optimizer state of the expert tensors takes 2.25 bytes per parameter (8 with fp32 moments);
- ``state_dict()`` holds torch.optim.AdamW's fp32 ``exp_avg`` and ``exp_avg_sq`` (dequantized) with the
  codes: loaded into a fresh SonarAdamW it restores the codes and scales bit for bit, and training resumed
  from it equals the run that never stopped, bit for bit; torch.optim.AdamW loads the same dict.

It also prints how far the 8-bit run's expert weights are from the same training with fp32 moments (a
measurement, not a promise: docs/design.md, "Against torchao's AdamW8bit").
"""

import io

import torch
import transformers

import sonar_kernels  # registers experts_implementation="sonar" in transformers

STEPS = 4  # the checkpoint is taken after STEPS // 2
BATCH, SEQ, VOCAB = 2, 12, 64
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "max_grad_norm": 0.5}
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
STATE_8BIT = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")


def tiny_olmoe(seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random OLMoE built as README's quick start builds one ("sonar" experts, the torch backend on
    a CPU), with intermediate_size 32: down_proj's last dimension is a whole block of 32."""
    config = transformers.OlmoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, experts_implementation="sonar")


def train(model, optimizer, steps: range) -> None:
    for step in steps:
        ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))
        model(input_ids=ids, labels=ids).loss.backward()  # the experts are updated here
        optimizer.step()  # the dense parameters
        optimizer.zero_grad()


def experts_of(model) -> list[torch.Tensor]:
    return [p for name, p in model.named_parameters() if name.endswith(EXPERTS)]


def state_bytes_per_parameter(model, optimizer) -> float:
    """Bytes of the expert tensors' moments (codes and scales, or exp_avg and exp_avg_sq; not the step
    counter) per expert parameter."""
    experts = experts_of(model)
    state_bytes = sum(t.nbytes for p in experts for key, t in optimizer.state[p].items() if key != "step")
    return state_bytes / sum(p.numel() for p in experts)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normwise relative difference ||a - b|| / ||b||."""
    return float((a - b).detach().norm() / b.detach().norm())


def main() -> None:
    half = STEPS // 2
    model = tiny_olmoe()
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, moments_dtype="8bit")
    train(model, optimizer, range(half))

    # A checkpoint half-way (in memory here; torch.save to a file is the same).
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    entries = [s for s in optimizer.state_dict()["state"].values() if "exp_avg_codes" in s]  # the experts'
    holds_fp32_moments = len(entries) == 4 and all(
        s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in entries
    )

    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = tiny_olmoe(seed=123)  # other initial weights: everything comes from the checkpoint
    resumed.load_state_dict(saved["model"])
    resumed_optimizer = sonar_kernels.SonarAdamW(resumed, **HYPER, moments_dtype="8bit")
    resumed_optimizer.load_state_dict(saved["optimizer"])
    codes_restored = all(
        torch.equal(optimizer.state[p][key], resumed_optimizer.state[q][key])
        for p, q in zip(experts_of(model), experts_of(resumed), strict=True)
        for key in STATE_8BIT
    )
    # torch.optim.AdamW takes the same dict: its exp_avg and exp_avg_sq are the dequantized fp32 moments.
    buffer.seek(0)
    adamw = torch.optim.AdamW(tiny_olmoe().parameters())
    adamw.load_state_dict(torch.load(buffer)["optimizer"])
    loads_into_torch = all(
        adamw.state[p]["exp_avg_sq"].dtype == torch.float32 and adamw.state[p]["exp_avg"].shape == p.shape
        for p in adamw.param_groups[0]["params"]
    )

    train(model, optimizer, range(half, STEPS))
    train(resumed, resumed_optimizer, range(half, STEPS))
    resumed_equal = all(
        torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters(), strict=True)
    )

    exact = tiny_olmoe()
    exact_optimizer = sonar_kernels.SonarAdamW(exact, **HYPER)  # fp32 moments
    train(exact, exact_optimizer, range(STEPS))
    bytes_8bit = state_bytes_per_parameter(model, optimizer)
    bytes_fp32 = state_bytes_per_parameter(exact, exact_optimizer)
    distance = max(rel_err(p, q) for p, q in zip(experts_of(model), experts_of(exact), strict=True))

    if not (bytes_8bit == 2.25 and bytes_fp32 == 8.0):
        raise SystemExit(f"moments take {bytes_8bit} (8-bit) and {bytes_fp32} (fp32) bytes per parameter")
    if not (holds_fp32_moments and codes_restored and loads_into_torch and resumed_equal):
        raise SystemExit(
            f"state dict round trip: fp32 moments saved {holds_fp32_moments}, codes and scales restored "
            f"{codes_restored}, loads into torch.optim.AdamW {loads_into_torch}, resumed bitwise {resumed_equal}"
        )
    print(
        f'moments_dtype="8bit", {STEPS} steps: expert moments take {bytes_8bit:.2f} bytes per parameter '
        f"against {bytes_fp32:.2f} in fp32; state_dict round trip restores codes and scales and resumes "
        f"bitwise: {resumed_equal}; expert weights {distance:.1e} (normwise) from the fp32-moments run"
    )


if __name__ == "__main__":
    main()
