"""Gradient accumulation with SonarAdamW: k micro-batches per optimizer step on a tiny OLMoE whose experts run
"sonar" (docs/usage.md, "What is supported": the SonarAdamW paragraph on ``accumulation_steps``).

    python examples/gradient_accumulation.py

``SonarAdamW(..., accumulation_steps=k)``: the backward passes of micro-batches 1 .. k-1 sum each expert
tensor's gradient in ``.grad``, as autograd does, and the k-th backward adds its own part inside the update
and applies AdamW to the experts; call ``step()`` once per k backward passes (it updates the dense
parameters). The loss convention is standard accumulation's: each micro-batch's mean loss divided by k, so
the k gradients add up to the gradient of the mean over the k micro-batches.

What it checks:

- bitwise: the same training with torch.optim.AdamW(fused=True) (what SonarAdamW's default flags run on the
  CPU) on a copy, accumulating the same micro-batches in ``.grad`` and clipping the dense gradients only;
- within fp32 rounding: one k-times-larger batch per step (the same tokens, one mean loss), trained the
  same way. The sum of k means divided by k is the mean over the large batch up to the order of the fp32
  additions, so the bits differ (torch.optim.AdamW on both sides differs the same way); AdamW's division by
  sqrt(exp_avg_sq) magnifies that rounding where a gradient is small, so the check is a normwise 1e-4
  (about 8e-6 measured here: a hundred fp32 roundoffs).
"""

import copy
import warnings

import torch
import transformers

import sonar_kernels  # registers experts_implementation="sonar" in transformers

K = 4  # micro-batches per optimizer step
STEPS = 3
MICRO_BATCH, SEQ, VOCAB = 2, 12, 64
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
MAX_GRAD_NORM = 0.5
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def tiny_olmoe() -> transformers.PreTrainedModel:
    """A tiny random OLMoE built as README's quick start builds one ("sonar" experts, the torch backend on
    a CPU)."""
    config = transformers.OlmoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, experts_implementation="sonar")


def micro_batch(step: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(3, VOCAB, (MICRO_BATCH, SEQ), generator=generator)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normwise relative difference ||a - b|| / ||b||."""
    return float((a - b).detach().norm() / b.detach().norm())


def dense_parameters(model):
    return [p for name, p in model.named_parameters() if not name.endswith(EXPERTS)]


def train_sonar(model) -> None:
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, max_grad_norm=MAX_GRAD_NORM, accumulation_steps=K)
    expert = model.model.layers[0].mlp.experts.down_proj
    for step in range(STEPS):
        for micro in range(K):
            ids = micro_batch(step, micro)
            (model(input_ids=ids, labels=ids).loss / K).backward()
            # Micro-batches 1 .. k-1 keep the experts' running sum in .grad; the k-th consumes it in the
            # update (the experts are updated here, in the backward) and releases it.
            assert (expert.grad is None) == (micro == K - 1)
        optimizer.step()  # the dense parameters: clipped (dense only), then AdamW
        optimizer.zero_grad()


def train_standard(model, large_batch: bool) -> None:
    """torch.optim.AdamW(fused=True) with the dense gradients clipped: standard accumulation of the same k
    micro-batches, or (``large_batch``) the k micro-batches as one batch."""
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
    for step in range(STEPS):
        batches = [micro_batch(step, micro) for micro in range(K)]
        for ids in [torch.cat(batches)] if large_batch else batches:
            (model(input_ids=ids, labels=ids).loss / (1 if large_batch else K)).backward()
        torch.nn.utils.clip_grad_norm_(dense_parameters(model), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()


def main() -> None:
    sonar = tiny_olmoe()
    initial = copy.deepcopy(sonar)
    standard, large = copy.deepcopy(sonar), copy.deepcopy(sonar)
    train_sonar(sonar)
    with warnings.catch_warnings():
        # torch.optim.AdamW trains the "sonar" experts as dense parameters (their gradients in .grad):
        # what a reference should do; sonar_kernels says so once, with this warning.
        warnings.simplefilter("ignore", sonar_kernels.optim.UnownedExpertsWarning)
        train_standard(standard, large_batch=False)
        train_standard(large, large_batch=True)

    pairs = list(zip(sonar.named_parameters(), standard.parameters(), large.parameters(), strict=True))
    bitwise = all(torch.equal(p, q) for (_, p), q, _ in pairs)
    worst_name, worst = max(((name, rel_err(p, r)) for (name, p), _, r in pairs), key=lambda item: item[1])
    moved = min(rel_err(p, q) for p, q in zip(sonar.parameters(), initial.parameters(), strict=True))
    if not bitwise:
        raise SystemExit(
            "SonarAdamW's accumulation differs from torch.optim.AdamW's on the same micro-batches"
        )
    if not worst <= 1e-4:
        raise SystemExit(f"{worst_name} is {worst:.2e} from the large-batch run (bound 1e-4)")
    if not moved > 0:  # every parameter trained: a comparison of untouched weights would show nothing
        raise SystemExit("a parameter did not move")
    print(
        f"accumulation_steps={K}, {STEPS} steps: bitwise equal to torch.optim.AdamW with dense-only clipping "
        f"accumulating the same micro-batches: {bitwise}; largest normwise difference from one {K}x larger "
        f"batch: {worst:.1e} ({worst_name}), within 1e-4"
    )


if __name__ == "__main__":
    main()
