"""sonar-train on several processes (``torchrun --nproc-per-node N -m sonar_kernels.train``).

Every rank trains on its own batches (batch ``step * N + rank`` of the data) and DistributedDataParallel
reduces the dense gradients in every arm. The experts:

- data parallel (the default): every rank holds them all; in the sonar arm SonarAdamW is given the world
  as its data-parallel group, so each expert gradient is averaged over the ranks before its in-backward
  update;
- expert parallel (``--ep N``, N the number of ranks): each rank holds E / N experts of every layer
  (``integrations.transformers.shard_experts``), tokens reach them by all-to-all, and their gradient is
  complete on their rank: updated in the backward with no gradient collective. The standard arm's
  global-norm clipping sums the experts' squared norms over the ranks.

Rank 0 writes the report, which names the ranks and the layout and carries checksums of the dense and
expert weights per rank and arm.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import os

import torch
import torch.distributed as dist

LAYOUT = "data parallel: DDP for the dense parameters; SonarAdamW(data_parallel_group=world) for the experts"
EP_LAYOUT = (
    "expert parallel: each rank holds {local} of the {experts} experts of every layer (all-to-all dispatch, "
    "updated in the backward with no gradient collective); DDP for the dense parameters"
)


def setup(args) -> None:
    """Join the process group that torchrun describes (WORLD_SIZE > 1): gloo on the CPU, nccl on CUDA
    (one GPU per rank: ``cuda:LOCAL_RANK``)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    if args.device_obj.type == "cuda":
        args.device_obj = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(args.device_obj)
    dist.init_process_group(
        "nccl" if args.device_obj.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10)
    )


def teardown() -> None:
    """Destroy the process group, after the models and optimizers that hold its work (DDP's reference
    cycles) are collected."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def batch_index(step: int) -> int:
    """The data's batch of this rank at ``step`` (each rank its own)."""
    return step * world_size() + rank()


def group():
    """The data-parallel group of the experts: the world, or None on one process."""
    return dist.group.WORLD if world_size() > 1 else None


def wrap(model):
    """``model`` in DistributedDataParallel on several ranks (after its optimizer was built, so that
    SonarAdamW's experts are on DDP's ignore list); ``model`` itself on one."""
    if world_size() <= 1:
        return model
    return torch.nn.parallel.DistributedDataParallel(model)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks (in place; ``t`` itself on one process)."""
    if world_size() > 1:
        dist.all_reduce(t)
    return t


def checksums(tensors) -> list[str]:
    """One checksum of ``tensors`` (their bytes) per rank, in rank order."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    mine = digest.hexdigest()[:16]
    if world_size() <= 1:
        return [mine]
    every = [None] * world_size()
    dist.all_gather_object(every, mine)
    return every
