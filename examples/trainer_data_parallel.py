"""transformers.Trainer on several processes with SonarAdamW: a tiny OLMoE whose experts (running
experts_implementation "sonar") are replicated over the data-parallel ranks and updated inside the
backward from their gradient averaged over the ranks.

    torchrun --nproc-per-node 2 examples/trainer_data_parallel.py [--optimizer sonar|torch] [--out DIR]

Trainer (through Accelerate) initializes torch.distributed when ``TrainingArguments`` is built. SonarAdamW
is then built on the bare model with ``data_parallel_group=torch.distributed.group.WORLD``, before Trainer
wraps the model in DistributedDataParallel: SonarAdamW puts the experts on DDP's ignore list, so DDP
reduces the dense parameters and SonarAdamW the experts. Without the group, SonarAdamW raises at the
experts' first forward, naming
this fix (each rank would otherwise update the experts from its own gradient and the ranks would
diverge). Trainer's own clipping (``max_grad_norm``) sees only the dense gradients: the expert gradients
never wait in ``.grad`` for it (the paper's dense-only clipping). Here there is no clipping, so that
``--optimizer torch`` (whose clipping would include the experts) trains the same model: it runs
``torch.optim.AdamW(fused=True)``, torch's fused AdamW, which is what SonarAdamW's default flags run
wherever torch has it (docs/usage.md, "Which AdamW runs where").

Rank 0 prints whether the ranks' expert weights are identical (a checksum per rank); with ``--out`` each
rank also saves its parameters there.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import sonar_kernels
from sonar_kernels.integrations import transformers as sonar_transformers


def tiny_olmoe() -> transformers.OlmoeForCausalLM:
    config = transformers.OlmoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    config._experts_implementation = "sonar"
    torch.manual_seed(0)  # the same initial weights on every rank
    return transformers.OlmoeForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, samples: int = 16, length: int = 16):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (samples, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def checksum(tensors) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def optimizer_for(kind: str, model: torch.nn.Module, **hyper) -> torch.optim.Optimizer:
    """``kind`` "sonar": SonarAdamW over ``model``, its experts replicated over every rank when
    torch.distributed runs (``data_parallel_group``; build it before the trainer wraps the model in DDP).
    "torch": torch.optim.AdamW(fused=True), what SonarAdamW's default flags run (foreach=None, fused=None)."""
    if kind == "sonar":
        group = dist.group.WORLD if dist.is_initialized() else None
        return sonar_kernels.SonarAdamW(model, **hyper, data_parallel_group=group)
    return torch.optim.AdamW(model.parameters(), **hyper, fused=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("sonar", "torch"), default="sonar")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, help="each rank saves its parameters here")
    args = parser.parse_args(argv)
    sonar_transformers.register()
    with tempfile.TemporaryDirectory() as tmp:
        training = transformers.TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=2, max_steps=args.steps, learning_rate=1e-2,
            weight_decay=0.1, max_grad_norm=0.0, lr_scheduler_type="constant", report_to=[],
            save_strategy="no", logging_strategy="no", use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0, seed=0, data_seed=0,
        )  # fmt: skip
        model = tiny_olmoe()
        optimizer = optimizer_for(args.optimizer, model, lr=1e-2, weight_decay=0.1)
        trainer = transformers.Trainer(
            model=model, args=training, train_dataset=Tokens(), optimizers=(optimizer, None)
        )
        trainer.train()
    experts = [p for name, p in model.named_parameters() if name.endswith(("gate_up_proj", "down_proj"))]
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    sums = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(sums, checksum(experts))
    else:
        sums = [checksum(experts)]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        torch.save(params, args.out / f"{args.optimizer}-{rank}.pt")
    if rank == 0:
        print(f"{args.optimizer}: {world} ranks, expert checksums {sums}, identical: {len(set(sums)) == 1}")
    if dist.is_initialized():
        del trainer, optimizer, model
        gc.collect()  # DDP's reference cycles hold the group's work
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
