"""Resuming a sharded SonarAdamW run from a torch.distributed.checkpoint (DCP) checkpoint, as the multi-rank
scripts of the stacks' routes do it (tests/hf_expert_parallel_ranks.py, tests/titan_expert_parallel_ranks.py;
the recipe of docs/distributed.md)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def load_checkpoint(model: torch.nn.Module, optimizer, checkpoint) -> None:
    """Load the DCP checkpoint at ``checkpoint`` into ``model`` and ``optimizer`` (a SonarAdamW of one
    parameter group): the dense moments DCP loads into are created first by a step with zero gradients
    and lr 0 (as torchtitan does), then torch's ``get_state_dict`` / ``dcp.load`` / ``set_state_dict``."""
    for p in optimizer.dense_parameters():
        p.grad = torch.zeros_like(p)
    assert len(optimizer.param_groups) == 1
    optimizer.param_groups[0]["lr"], lr = 0.0, optimizer.param_groups[0]["lr"]
    optimizer.step()
    optimizer.param_groups[0]["lr"] = lr
    optimizer.zero_grad()
    model_state, optim_state = get_state_dict(model, optimizer)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=checkpoint)
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
