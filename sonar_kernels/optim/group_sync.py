"""How SonarAdamW follows its ``param_groups`` when their entries are replaced after it was built, and its
expert tensors that wait to be decided (docs/frameworks.md, "FSDP2 through accelerate and Trainer").

accelerate's ``prepare`` (and transformers' Trainer, which calls it) requires the optimizer to be built on
the unsharded model; under FSDP2 it then shards the model with ``fully_shard`` and puts the shards
(DTensors) in the optimizer's groups in the originals' places. :func:`follow` takes the expert shards over
(their state created as if the optimizer had been built after ``fully_shard``) and forgets the unsharded
tensors, whose state no update has advanced yet. Expert tensors replaced by tensors that are not experts
(DeepSpeed ZeRO's flat partitions) are refused: their updates could no longer run in the backward.

With several ranks, an expert tensor that is neither sharded, expert-parallel nor covered by the
optimizer's ``data_parallel_group`` when it is given waits, held without state (:func:`split_pending`):
decided at its module's first forward (taken over, or refused by ``InBackwardAdamW.claim``) or at
``step()`` (:func:`refuse_pending`). The functions work on the optimizer's own tables (the
``InBackwardAdamW`` protocol).
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch.distributed.tensor import DTensor

from sonar_kernels import specs
from sonar_kernels.optim import distributed, ownership
from sonar_kernels.optim.in_backward import is_expert_tensor
from sonar_kernels.optim.param_groups import check_group_options

__all__ = ["drop", "follow", "refuse_pending", "refuse_sharded_after", "remember_source", "split_pending"]


def remember_source(optimizer, model: torch.nn.Module) -> None:
    """Keep (weakly) the module ``optimizer`` was built from and the name of each dense parameter it took
    from it, until its first ``step()`` ends (a step post-hook drops them): :func:`refuse_sharded_after`
    checks them at each experts module's forward and at ``step()`` until then."""
    names = {id(p): name for name, p in model.named_parameters() if not is_expert_tensor(p)}
    optimizer._dense_source = (weakref.ref(model), names)

    # It stays registered: removing it while torch iterates the hooks would break that iteration.
    def forget(opt, args, kwargs):
        opt._dense_source = None

    optimizer.register_step_post_hook(forget)


def refuse_sharded_after(optimizer) -> None:
    """RuntimeError, before anything is updated, when FSDP2 sharded dense parameters of the module
    ``optimizer`` was built from after it was built (``fully_shard``, ``sonar_kernels.nn.fully_shard_dense``)
    and its ``param_groups`` still hold the unsharded tensors: their gradients reach the shards, so it would
    not train them, in silence (torch.optim.AdamW's rule). accelerate's ``prepare`` puts the shards in the
    groups before the first forward (:func:`follow`), which this accepts."""
    source = getattr(optimizer, "_dense_source", None)
    model = source[0]() if source is not None else None
    if model is None:
        return
    current = dict(model.named_parameters())
    stale = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = source[1].get(id(p))
            now = current.get(name) if name is not None else None
            if now is not None and now is not p and isinstance(now, DTensor) and not isinstance(p, DTensor):
                stale.append(name)
    if stale:
        raise RuntimeError(
            f"{type(optimizer).__name__}: {len(stale)} dense parameter(s) of the model it was built from were "
            f"sharded by FSDP2 since ({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}): it holds the "
            "unsharded tensors, whose gradients no longer arrive, so it would not train them. Build the optimizer "
            'after fully_shard / sonar_kernels.nn.fully_shard_dense (docs/distributed.md, "Expert parallel with '
            "the dense layers on FSDP2\"), or let accelerate's prepare put the shards in its param_groups. Nothing "
            "was updated."
        )


def split_pending(optimizer, experts: list) -> tuple[list, list]:
    """(ready, pending): with several ranks, an expert tensor neither sharded, expert-parallel nor
    covered by ``data_parallel_group`` waits (no state, no update) until it can be decided: the stacks
    that shard a model (accelerate's ``prepare``, transformers' Trainer with FSDP2) build the optimizer
    on the unsharded model first, then replace its ``param_groups`` entries by the shards
    (:func:`follow`). A tensor still held at its module's first forward is refused there."""
    if distributed.world_size() <= 1:
        return experts, []
    pending = [p for p in experts if distributed.layout(p, optimizer.data_parallel_group) == "local"]
    return [p for p in experts if not any(p is q for q in pending)], pending


def follow(optimizer) -> None:
    """Follow the replaced entries of ``optimizer.param_groups`` (SonarAdamW.sync_param_groups; the
    module docstring says how)."""
    refuse_sharded_after(optimizer)
    lists = [group["params"] for group in optimizer.param_groups]
    synced = getattr(optimizer, "_synced_params", None)
    if (
        synced is not None
        and len(lists) == len(synced)
        and all(a is b for a, b in zip(lists, synced, strict=True))
    ):
        return
    held = [p for params in lists for p in params]
    ids = {id(p) for p in held}
    gone = [p for p in optimizer._managed if id(p) not in ids]
    new = [p for p in held if specs.holder_of(p) is not optimizer]
    name = type(optimizer).__name__
    record = optimizer._record
    if any(isinstance(p, DTensor) for p in new):
        ownership.mark_fsdp_expert_tensors()  # FSDP2's sharded parameters lost their modules' marks
    experts = [p for p in new if is_expert_tensor(p)]
    left = len(gone) + sum(not any(p is q for q in held) for p in optimizer._pending)
    # First: after steps or a checkpoint load the check below would name accelerate's shards instead.
    if left > len(experts):
        # Expert tensors replaced by tensors that are not experts: DeepSpeed's ZeRO puts flat partitions
        # of all parameters in the optimizer's groups; anything else doing so would train the experts as
        # dense parameters of another optimizer's making.
        who = " by DeepSpeed's ZeRO optimizer" if "deepspeed" in sys.modules else ""
        raise RuntimeError(
            f"{name}: {left} expert tensor(s) in this optimizer's param_groups were replaced{who} by tensors "
            "that are not expert tensors (e.g. flat partitions of several parameters): their updates could no "
            f"longer run in the backward from their complete gradient (nothing was changed)."
            f"{distributed.deepspeed_note() or ' Give the optimizer the expert tensors themselves.'}"
        )
    for p in gone:
        if (
            p in record.updated
            or p in record.micro_batches.counts
            or float(optimizer.state[p]["step"]) != 0.0
        ):
            raise RuntimeError(
                f"{name}: the expert tensor of shape {tuple(p.shape)} left param_groups (replaced, e.g. by "
                "accelerate's prepare, which puts the FSDP2 shards of the model in the optimizer's place) after "
                "an update or a micro-batch of it: its state cannot follow to the new tensor. Prepare the model "
                "and the optimizer before training (nothing was changed)"
            )
    for p in experts:
        check_group_options(name, record.groups.group(p), True)
    ready, pending = split_pending(optimizer, experts)
    optimizer._check_managed(ready)
    optimizer._check_managed(pending, complete=False)
    # Nothing has changed so far.
    for p in gone:
        drop(optimizer, p)
    optimizer._pending = [p for p in optimizer._pending if id(p) in ids]
    optimizer._manage(ready)
    optimizer._pending.extend(pending)
    for p in new:
        specs.set_holder(p, optimizer)
    optimizer._synced_params = lists


def refuse_pending(optimizer) -> None:
    """RuntimeError, before anything changes, when expert tensors held undecided reach ``step()``:
    their module never ran a forward that could hand them over (torch.compile), and with several ranks
    their gradients are partial."""
    if optimizer._pending:
        raise RuntimeError(
            distributed.partial_gradient_message(
                type(optimizer).__name__, optimizer._pending, " (nothing was changed)"
            )
        )


def drop(optimizer, p: torch.Tensor) -> None:
    """Forget managed ``p``, which left ``param_groups`` (replaced by a new tensor there, e.g. its FSDP2
    shard): no update, hook, state or record of ``optimizer`` keeps it."""
    update = optimizer._updates.get(p)
    optimizer.state.pop(p, None)
    optimizer._previous.pop(p, None)
    optimizer._seeds.pop(p, None)
    optimizer._let_go(p)
    if update is not None and specs.update_of(p) is update:
        specs.attach_update(p, None)
    optimizer._record.forget(p)
