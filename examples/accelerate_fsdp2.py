"""SonarAdamW under FSDP2 the way accelerate and transformers' Trainer apply it: the optimizer is built on the
unsharded model, then ``accelerator.prepare`` shards the model (``fully_shard``) and puts the shards in
the optimizer's ``param_groups``; SonarAdamW takes them over at the first forward and updates the expert
shards as their gradients arrive (docs/frameworks.md, "FSDP2 through accelerate and Trainer").

    torchrun --nproc-per-node 2 examples/accelerate_fsdp2.py [--loop accelerate|trainer]
        [--optimizer sonar|torch] [--steps 3] [--out DIR] [--ep]

``--ep`` (with ``--loop accelerate``): expert parallelism beside FSDP2 (docs/distributed.md, "Expert
parallel with the dense layers on FSDP2"): ``shard_experts`` gives each rank its experts, the plugin's
``ignored_modules`` keeps FSDP2 off them, and SonarAdamW updates them in the backward from their complete
gradient, as on one GPU.

``--loop accelerate``: a plain accelerate training loop (``prepare``, ``backward``,
``clip_grad_norm_``, ``step``). ``--loop trainer``: transformers' Trainer with ``fsdp="full_shard"``,
``fsdp_config={"fsdp_version": 2}`` and the optimizer passed as Trainer documents it under FSDP,
``optimizer_cls_and_kwargs``. Clipping at 1.0 in both: with SonarAdamW the expert gradients never wait in
``.grad``, so the clipping sees the dense ones (the paper's dense-only clipping); ``--optimizer torch``
(``torch.optim.AdamW(fused=True)``, what SonarAdamW's default flags run) clips the same dense parameters,
so both train the same model, bit for bit.

On a machine without CUDA, accelerate replaces FSDP by DDP without a word (its state picks MULTI_CPU
first); this script then sets the accelerator's state to FSDP with the plugin, what a GPU run has, so
that FSDP2 runs on the CPU over gloo (``--no-force`` keeps accelerate's own choice). Rank 0 prints the
number of expert tensors SonarAdamW updates in the backward and how many expert gradients were left in
``.grad`` for the step (none with SonarAdamW); with ``--out`` it saves the full parameters there.
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

import sonar_kernels
from sonar_kernels.integrations import transformers as sonar_transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_data_parallel import Tokens, tiny_olmoe

HYPER = {"lr": 1e-2, "weight_decay": 0.1}
MAX_GRAD_NORM = 1.0


def is_expert(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def force_fsdp(accelerator, plugin) -> None:
    """What accelerate's state holds on a GPU with an FSDP plugin; on a CPU it falls back to DDP."""
    from accelerate.utils import DistributedType

    if accelerator.state.distributed_type != DistributedType.FSDP:
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin


def dense_only_clipping(accelerator, model) -> None:
    """The reference's clipping: accelerate's own, over the dense parameters (the experts left out)."""
    clip = accelerator.clip_grad_norm_

    def clip_dense(parameters, max_norm, norm_type=2):
        # The names now: prepare replaced the parameters by their shards.
        names = {id(p): name for name, p in model.named_parameters()}
        return clip([p for p in parameters if not is_expert(names.get(id(p), ""))], max_norm, norm_type)

    accelerator.clip_grad_norm_ = clip_dense


def optimizer_class_and_kwargs(kind: str):
    if kind == "sonar":
        return sonar_kernels.SonarAdamW, dict(HYPER)
    return torch.optim.AdamW, {**HYPER, "fused": True}


# --ep: the experts modules FSDP2 must leave alone (the plugin's ignored_modules, a regex of module names:
# accelerate passes their tensors to every fully_shard as ignored_params).
EXPERTS_MODULES = r"model\.layers\.\d+\.mlp\.experts"


def accelerate_loop(kind: str, steps: int, force: bool, ep: bool = False):
    from accelerate import Accelerator, PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    if ep:  # the process group first: shard_experts needs it, before the optimizer is built
        PartialState(cpu=not torch.cuda.is_available())
    model = tiny_olmoe()
    if ep:  # expert parallelism: rank r keeps experts [r E / P, (r + 1) E / P), reached by all-to-all
        sonar_transformers.shard_experts(model, dist.group.WORLD)
    optimizer_class, kwargs = optimizer_class_and_kwargs(kind)
    params = model.parameters()
    if (
        ep and kind == "torch"
    ):  # torch's fused AdamW takes DTensors or plain tensors in one call: a group each
        named = list(model.named_parameters())
        params = [
            {"params": [p for n, p in named if not is_expert(n)]},
            {"params": [p for n, p in named if is_expert(n)]},
        ]
    # The order accelerate requires under FSDP2: the optimizer on the unsharded model, then prepare.
    optimizer = optimizer_class(params, **kwargs)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, ignored_modules=EXPERTS_MODULES if ep else None)
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=not torch.cuda.is_available())
    if force:
        force_fsdp(accelerator, plugin)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if kind == "torch":
        dense_only_clipping(accelerator, model)
    batches = iter(loader)
    held = 0
    for _ in range(steps):
        loss = model(**next(batches)).loss
        accelerator.backward(loss)
        held += expert_gradients(model)
        accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer.optimizer, held


def expert_gradients(model) -> int:
    """How many expert tensors hold a gradient now (after a backward, before the step)."""
    return sum(p.grad is not None for name, p in model.named_parameters() if is_expert(name))


def trainer_loop(kind: str, steps: int, force: bool, tmp: str):
    class FSDP2Trainer(transformers.Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if force and self.args.fsdp_plugin_args is not None:
                from accelerate.utils import FullyShardedDataParallelPlugin

                force_fsdp(self.accelerator, FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
                self.is_fsdp_enabled = True
            if kind == "torch":
                dense_only_clipping(self.accelerator, self.model)

    training = transformers.TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=2, max_steps=steps, learning_rate=HYPER["lr"],
        weight_decay=HYPER["weight_decay"], max_grad_norm=MAX_GRAD_NORM, lr_scheduler_type="constant",
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0, seed=0, data_seed=0, fsdp="full_shard", fsdp_config={"fsdp_version": 2},
    )  # fmt: skip

    class BeforeTheStep(transformers.TrainerCallback):
        held = 0

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            BeforeTheStep.held += expert_gradients(model)

    model = tiny_olmoe()
    trainer = FSDP2Trainer(
        model=model, args=training, train_dataset=Tokens(), callbacks=[BeforeTheStep()],
        optimizer_cls_and_kwargs=optimizer_class_and_kwargs(kind),
    )  # fmt: skip
    trainer.train()
    optimizer = trainer.optimizer
    return trainer.model_wrapped, getattr(optimizer, "optimizer", optimizer), BeforeTheStep.held


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", choices=("accelerate", "trainer"), default="accelerate")
    parser.add_argument("--optimizer", choices=("sonar", "torch"), default="sonar")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-force", action="store_true", help="keep accelerate's choice (DDP on a CPU)")
    parser.add_argument("--ep", action="store_true",
                        help="with --loop accelerate: expert parallelism over the ranks (shard_experts), the "
                        "experts left out of FSDP2 by the plugin's ignored_modules")  # fmt: skip
    parser.add_argument("--out", type=Path, help="rank 0 saves the full parameters here")
    args = parser.parse_args(argv)
    sonar_transformers.register()
    with tempfile.TemporaryDirectory() as tmp:
        if args.ep and args.loop != "accelerate":
            parser.error("--ep goes with --loop accelerate (Trainer's fsdp_config has no ignored_modules)")
        if args.loop == "accelerate":
            model, optimizer, held = accelerate_loop(args.optimizer, args.steps, not args.no_force, args.ep)
        else:
            model, optimizer, held = trainer_loop(args.optimizer, args.steps, not args.no_force, tmp)
    full = {}
    for name, p in model.named_parameters():
        full[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        sharded = sum(type(p).__name__ == "DTensor" for p in model.parameters())
        experts = len(getattr(optimizer, "expert_tensors", []))
        print(
            f"{args.loop} {args.optimizer}: {sharded} sharded parameters, {experts} expert tensors updated in the "
            f"backward, {held} expert gradients seen before a step"
        )
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save(full, args.out / f"{args.loop}{'-ep' if args.ep else ''}-{args.optimizer}.pt")
    if dist.is_initialized():
        del model, optimizer
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
