"""Data-parallel training on 2 CPU processes: DDP for the dense parameters, SonarAdamW's
``data_parallel_group=`` for the experts (docs/distributed.md, "Distributed training", Data parallel).

    python examples/ddp_data_parallel.py

The script starts its own 2 ranks (torch.multiprocessing, start method "spawn", gloo over localhost); under
torchrun, ``train_sonar`` is the whole training script. Each rank builds the same model, builds SonarAdamW
on the bare module with the group the experts are replicated over, then wraps the module in DDP:
SonarAdamW puts the experts on DDP's ignore list, averages each expert gradient over the group (divided
by the group's size, then summed, as DDP does) while the backward goes on, and updates the experts when
that reduction is done; DDP averages the dense gradients, which ``step()`` clips (dense only) and
updates. Each rank trains on its own batch.

What it checks, in this (parent) process, on the weights each rank saved:

- both ranks end with the same weights, bit for bit;
- they equal, bit for bit, plain DDP (every gradient averaged by DDP in ``.grad``) with
  torch.optim.AdamW(fused=True) clipping the dense gradients only, run by the same ranks on the same
  batches (docs/distributed.md: bitwise on 2 ranks; on more, gloo's reduction order follows DDP's buckets);
- they equal single-process training on the concatenated batch (torch.optim.AdamW(fused=True), the dense
  gradients clipped) within 1e-5 normwise: the mean over the ranks of each rank's mean loss is the mean
  over the concatenated batch, up to the order of the fp32 additions (docs/distributed.md: "within 1e-5 of
  single-process training on the concatenated batch").
"""

import datetime
import gc
import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sonar_kernels

WORLD_SIZE = 2
E, H, I, TOP_K = 8, 32, 16, 2
T = 16  # tokens per rank
STEPS = 3
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
MAX_GRAD_NORM = 0.5
# A collective that waits longer than this fails instead of hanging.
TIMEOUT = datetime.timedelta(seconds=60)


class MoE(torch.nn.Module):
    """docs/distributed.md's model: a router, one SonarExperts layer, a dense head."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False)
        self.experts = sonar_kernels.SonarExperts(E, H, I)  # backend "auto": torch on a CPU
        self.head = torch.nn.Linear(H, H)

    def forward(self, x):
        weights, index = self.router(x).softmax(dim=-1).topk(TOP_K, dim=-1)
        return self.head(x + self.experts(x, index, weights))


def initial_model() -> MoE:
    torch.manual_seed(0)  # the same initial weights on every rank
    return MoE()


def batch(step: int, rank: int):
    """Rank ``rank``'s batch at ``step`` (inputs, targets)."""
    generator = torch.Generator().manual_seed(1000 + 100 * step + rank)
    return torch.randn(T, H, generator=generator), torch.randn(T, H, generator=generator)


def dense_parameters(model: MoE) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if not name.startswith("experts.")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_sonar(rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s training: DDP for the dense parameters, the experts averaged over the group by
    SonarAdamW. Under torchrun (``dist.init_process_group("gloo")`` first) this is the whole script."""
    model = initial_model()
    # Built on the bare module, before DDP wraps it (or mesh["dp"] for a DeviceMesh's dimension).
    optimizer = sonar_kernels.SonarAdamW(
        model, **HYPER, max_grad_norm=MAX_GRAD_NORM, data_parallel_group=dist.group.WORLD
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # after: it reduces the dense parameters only
    for step in range(STEPS):
        x, target = batch(step, rank)
        # The experts' gradients are averaged over the ranks, then the experts updated, in here.
        torch.nn.functional.mse_loss(ddp(x), target).backward()
        optimizer.step()  # the dense parameters (averaged by DDP in the backward): clipped, then updated
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def train_ddp_adamw(rank: int) -> dict[str, torch.Tensor]:
    """The same training with plain DDP (every gradient in .grad, averaged by DDP) and
    torch.optim.AdamW(fused=True), what SonarAdamW's default flags run on the CPU, the dense gradients
    clipped."""
    model = initial_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
    with warnings.catch_warnings():
        # torch.optim.AdamW trains the SonarExperts weights as dense parameters (their gradients in .grad):
        # what a reference should do; sonar_kernels says so once, with this warning.
        warnings.simplefilter("ignore", sonar_kernels.optim.UnownedExpertsWarning)
        for step in range(STEPS):
            x, target = batch(step, rank)
            torch.nn.functional.mse_loss(ddp(x), target).backward()
            torch.nn.utils.clip_grad_norm_(dense_parameters(model), MAX_GRAD_NORM)
            optimizer.step()
            optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def run_rank(rank: int, world_size: int, port: int, out: Path) -> None:
    """One spawned rank: both trainings, each rank's weights saved in ``out``."""
    torch.set_num_threads(1)  # the ranks share the CPU's cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=TIMEOUT
    )
    try:
        torch.save(train_sonar(rank), out / f"sonar-{rank}.pt")
        torch.save(train_ddp_adamw(rank), out / f"standard-{rank}.pt")
        gc.collect()  # DDP's reference cycles hold the group's work: let go of it before the group goes
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalization, during which torch 2.13's gloo threads can abort a process
    # that has finished its work ("terminate called without an active exception", pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def single_process() -> dict[str, torch.Tensor]:
    """The reference: one process, the ranks' batches concatenated, torch.optim.AdamW(fused=True) (what
    SonarAdamW's default flags run on the CPU) with the dense gradients clipped."""
    model = initial_model()
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
    dense = dense_parameters(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sonar_kernels.optim.UnownedExpertsWarning)
        for step in range(STEPS):
            x, target = (torch.cat(t) for t in zip(*[batch(step, r) for r in range(WORLD_SIZE)], strict=True))
            torch.nn.functional.mse_loss(model(x), target).backward()
            torch.nn.utils.clip_grad_norm_(dense, MAX_GRAD_NORM)
            optimizer.step()
            optimizer.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normwise relative difference ||a - b|| / ||b||."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # Raises if a rank raises or dies; the ranks import this file as a module (hence the __main__ guard).
        mp.start_processes(
            run_rank, args=(WORLD_SIZE, free_port(), Path(tmp)), nprocs=WORLD_SIZE, start_method="spawn"
        )
        ranks = [torch.load(Path(tmp) / f"sonar-{rank}.pt") for rank in range(WORLD_SIZE)]
        standard = torch.load(Path(tmp) / "standard-0.pt")
    identical = all(torch.equal(ranks[0][name], other[name]) for other in ranks[1:] for name in ranks[0])
    same_as_ddp = all(torch.equal(p, standard[name]) for name, p in ranks[0].items())
    single = single_process()
    worst_name, worst = max(
        ((name, rel_err(p, single[name])) for name, p in ranks[0].items()), key=lambda i: i[1]
    )
    moved = rel_err(single["experts.gate_up_proj"], initial_model().experts.gate_up_proj.detach())

    if not identical:
        raise SystemExit("the ranks' weights differ")
    if not same_as_ddp:
        raise SystemExit("the weights differ from DDP with torch.optim.AdamW and dense-only clipping")
    if not worst <= 1e-5:
        raise SystemExit(f"{worst_name} is {worst:.2e} from single-process training (bound 1e-5)")
    if not moved > 1e-3:  # a comparison of untrained experts would show nothing
        raise SystemExit("training did not move the experts")
    print(
        f"DDP + data_parallel_group, {WORLD_SIZE} gloo ranks, {STEPS} steps: ranks bitwise identical: {identical}, "
        f"and bitwise equal to DDP + torch.optim.AdamW with dense-only clipping: {same_as_ddp}; "
        f"largest normwise difference from single-process training on the concatenated batch: {worst:.1e} "
        f"({worst_name}), within 1e-5"
    )


if __name__ == "__main__":
    main()
