"""TRL's SFTTrainer with SonarAdamW: supervised fine-tuning of a tiny OLMoE whose experts run "sonar", on one
process or several (torchrun: DDP, the experts replicated over the ranks and averaged by SonarAdamW).

    python examples/trl_sft.py [--optimizer sonar|torch] [--out DIR]
    torchrun --nproc-per-node 2 examples/trl_sft.py [--optimizer sonar|torch] [--out DIR]

SFTTrainer is transformers' Trainer: SonarAdamW goes in ``optimizers=(optimizer, None)``, built on the bare
model before the trainer wraps it (on several processes with ``data_parallel_group``, as in
examples/trainer_data_parallel.py). Trainer's clipping (``max_grad_norm`` 1.0 here) sees only the dense
gradients, since the experts are updated in the backward (the paper's dense-only clipping).
``--optimizer torch`` runs ``torch.optim.AdamW(fused=True)`` (what SonarAdamW's default flags run) with
accelerate's clipping restricted to the same dense parameters: the two train the same model, bit for bit.
The text is random words of a 60-word vocabulary, tokenized by a word-level tokenizer built here (no
download). Rank 0 prints the number of expert tensors updated in the backward; with ``--out`` it saves the
parameters there.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from sonar_kernels.integrations import transformers as sonar_transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accelerate_fsdp2 import dense_only_clipping, is_expert
from trainer_data_parallel import optimizer_for, tiny_olmoe

HYPER = {"lr": 1e-2, "weight_decay": 0.1}
WORDS = [f"w{i}" for i in range(60)]


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over :data:`WORDS` and 4 special tokens (64 ids, the tiny model's vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate([*WORDS, "<unk>", "<pad>", "<bos>", "<eos>"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def texts(samples: int = 16, length: int = 12) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(WORDS), (samples, length), generator=generator)
    return [" ".join(WORDS[i] for i in row) for row in ids.tolist()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("sonar", "torch"), default="sonar")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, help="rank 0 saves the parameters here")
    args = parser.parse_args(argv)
    import datasets
    import trl

    sonar_transformers.register()
    with tempfile.TemporaryDirectory() as tmp:
        config = trl.SFTConfig(
            output_dir=tmp, per_device_train_batch_size=2, max_steps=args.steps, learning_rate=HYPER["lr"],
            weight_decay=HYPER["weight_decay"], max_grad_norm=1.0, lr_scheduler_type="constant", report_to=[],
            save_strategy="no", logging_strategy="no", use_cpu=not torch.cuda.is_available(), bf16=False,
            dataloader_num_workers=0, seed=0, data_seed=0, max_length=16,
        )  # fmt: skip
        model = tiny_olmoe()
        optimizer = optimizer_for(args.optimizer, model, **HYPER)
        trainer = trl.SFTTrainer(
            model=model, args=config, train_dataset=datasets.Dataset.from_dict({"text": texts()}),
            processing_class=tokenizer(), optimizers=(optimizer, None),
        )  # fmt: skip
        if args.optimizer == "torch":
            dense_only_clipping(trainer.accelerator, model)
        trainer.train()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if rank == 0:
        experts = len(getattr(optimizer, "expert_tensors", []))
        total = sum(is_expert(name) for name, _ in model.named_parameters())
        print(
            f"sft {args.optimizer}: {world} ranks, {experts} of {total} expert tensors updated in the backward"
        )
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            params = {name: p.detach().clone() for name, p in model.named_parameters()}
            torch.save(params, args.out / f"sft-{args.optimizer}-{world}.pt")
    if dist.is_initialized():
        del trainer, optimizer, model
        gc.collect()  # DDP's reference cycles hold the group's work
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
