"""Checkpoint and resume with SonarAdamW: train a tiny OLMoE whose experts run "sonar", save the model, the
optimizer and the LR scheduler with torch.save, build fresh ones, load, continue (docs/usage.md, "What is
supported": SonarAdamW's ``state_dict()``, one dict for all parameters, as torch.optim.AdamW's).

    python examples/checkpoint_resume.py

The experts' AdamW state (exp_avg, exp_avg_sq, step) lives in ``optimizer.state`` like the dense
parameters', although their update runs in the backward, so the ordinary PyTorch checkpoint recipe applies
unchanged. What it checks, bit for bit:

- the resumed run ends with the weights and optimizer state of a run that never stopped;
- the same checkpoint continued by torch.optim.AdamW(fused=True) with dense-only clipping (the state dict
  moves both ways) ends with the same weights too. SonarAdamW's groups keep ``fused=None`` (its default,
  torch's fused AdamW on the CPU), which torch.optim.AdamW reads as its own default, so set ``fused=True``
  after loading to continue with the same kernel.
"""

import tempfile
import warnings
from pathlib import Path

import torch
import transformers

import sonar_kernels  # registers experts_implementation="sonar" in transformers

STEPS = 6  # the interrupted run stops after STEPS // 2
BATCH, SEQ, VOCAB = 2, 12, 64
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
MAX_GRAD_NORM = 0.5
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def tiny_olmoe(seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random OLMoE built as README's quick start builds one ("sonar" experts, the torch backend on
    a CPU); ``seed`` draws its initial weights."""
    config = transformers.OlmoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, experts_implementation="sonar")


def batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)


def sonar_optimizer(model):
    optimizer = sonar_kernels.SonarAdamW(model, **HYPER, max_grad_norm=MAX_GRAD_NORM)
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)


def train(model, optimizer, scheduler, steps: range, clip_dense: bool = False) -> None:
    """``clip_dense``: clip the dense gradients by hand (torch.optim.AdamW; SonarAdamW's max_grad_norm does
    it in step())."""
    dense = [p for name, p in model.named_parameters() if not name.endswith(EXPERTS)]
    for step in steps:
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        if clip_dense:
            torch.nn.utils.clip_grad_norm_(dense, MAX_GRAD_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def same_bits(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def main() -> None:
    half = STEPS // 2
    straight = tiny_olmoe()
    straight_optimizer, straight_scheduler = sonar_optimizer(straight)
    train(straight, straight_optimizer, straight_scheduler, range(STEPS))

    first = tiny_olmoe()
    optimizer, scheduler = sonar_optimizer(first)
    train(first, optimizer, scheduler, range(half))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        checkpoint = {"model": first.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save({**checkpoint, "scheduler": scheduler.state_dict()}, path)
        del first, optimizer, scheduler

        # Fresh objects (other initial weights: everything comes from the checkpoint), loaded, continued.
        saved = torch.load(path)
        resumed = tiny_olmoe(seed=123)
        resumed.load_state_dict(saved["model"])
        optimizer, scheduler = sonar_optimizer(resumed)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        train(resumed, optimizer, scheduler, range(half, STEPS))

        # The same checkpoint continued by torch.optim.AdamW, the dense gradients clipped by hand. Loaded
        # from the file again: an optimizer's load_state_dict (torch's) keeps the loaded tensors as its
        # state and updates them in place, so one loaded dict must not start two runs.
        saved = torch.load(path)
        standard = tiny_olmoe(seed=123)
        standard.load_state_dict(saved["model"])
        adamw = torch.optim.AdamW(standard.parameters(), **HYPER)
        adamw_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=STEPS)
        adamw.load_state_dict(saved["optimizer"])
        adamw_scheduler.load_state_dict(saved["scheduler"])
        for group in adamw.param_groups:
            group["fused"] = True  # the checkpoint says None (SonarAdamW's default flags): see the docstring
        with warnings.catch_warnings():
            # torch.optim.AdamW trains the "sonar" experts as dense parameters (their gradients in .grad):
            # what this comparison wants; sonar_kernels says so once, with this warning.
            warnings.simplefilter("ignore", sonar_kernels.optim.UnownedExpertsWarning)
            train(standard, adamw, adamw_scheduler, range(half, STEPS), clip_dense=True)

    resumed_equal = same_bits(resumed, straight)
    experts = [
        (p, q)
        for (name, p), q in zip(resumed.named_parameters(), straight.parameters(), strict=True)
        if name.endswith(EXPERTS)
    ]
    state_equal = len(experts) == 4 and all(
        torch.equal(optimizer.state[p][key], straight_optimizer.state[q][key])
        for p, q in experts
        for key in ("exp_avg", "exp_avg_sq", "step")
    )
    torch_equal = same_bits(standard, straight)

    if not (resumed_equal and state_equal):
        raise SystemExit("the resumed run differs from the uninterrupted one")
    if not torch_equal:
        raise SystemExit("torch.optim.AdamW continuing the checkpoint differs from the uninterrupted run")
    print(
        f"saved after {half} of {STEPS} steps, rebuilt, loaded, resumed: weights and expert AdamW state bitwise "
        f"equal to the uninterrupted run: {resumed_equal and state_equal}; the checkpoint continued by "
        f"torch.optim.AdamW with dense-only clipping, bitwise equal too: {torch_equal}"
    )


if __name__ == "__main__":
    main()
