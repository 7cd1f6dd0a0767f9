"""Which tensors an optimizer updates in the backward, and their life cycle (docs/design.md, "When the
updates run"; docs/usage.md, "Ownership"): :class:`ManagedTensors`, the one object that owns the tables.

A managed tensor carries the optimizer's :class:`~sonar_kernels.optim.update_handle.OwnedUpdate` and
post-accumulate-grad hook, at most one of each: the newest optimizer owns it (an older one lets it go,
and takes it back when the newer one is garbage-collected). Claimed (:meth:`~ManagedTensors.manage`,
:meth:`~ManagedTensors.claim`), rebuilt after a conversion, replaced by a new object
(:meth:`~ManagedTensors.adopt_replacement`), let go and taken back.

Following ``param_groups`` (:meth:`~ManagedTensors.follow`; docs/frameworks.md, "FSDP2 through
accelerate and Trainer"): accelerate's ``prepare`` builds the optimizer on the unsharded model, then puts
the FSDP2 shards (DTensors) in its groups in the originals' places. The expert shards are taken over
(their state created as if the optimizer had been built after ``fully_shard``) and the unsharded
tensors, whose state no update has advanced yet, are forgotten; expert tensors replaced by tensors that
are not experts (DeepSpeed ZeRO's flat partitions) are refused. With several ranks, an expert tensor
neither sharded, expert-parallel nor covered by ``data_parallel_group`` waits, held without state
(:meth:`~ManagedTensors.split_pending`), until its module's first forward or ``step()``.

The optimizer holds this object, which holds the optimizer weakly: no reference cycle, so a dropped
optimizer is collected by reference counting alone, and its finalizer releases the entries.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch.distributed.tensor import DTensor

from sonar_kernels import ops, specs
from sonar_kernels.optim import distributed, ownership
from sonar_kernels.optim.expert_state import check_converted, expert_state
from sonar_kernels.optim.grad_hooks import accumulated_grad_hook
from sonar_kernels.optim.param_groups import check_group_options, torch_adamw_flags
from sonar_kernels.optim.update_handle import OwnedUpdate, expert_optimizer, signature
from sonar_kernels.optim.updates import InBackwardUpdates
from sonar_kernels.rules.master_weights import STOCHASTIC, shard_index_base, tensor_seed
from sonar_kernels.specs import is_expert_tensor
from sonar_kernels.update_state import UpdateState

__all__ = ["ManagedTensors"]


class ManagedTensors:
    """The ownership tables of one in-backward optimizer and the methods that change them.

    Holds ``optimizer`` weakly and ``record`` (its :class:`InBackwardUpdates`); reads and writes the
    optimizer's public ``state`` and ``param_groups`` and its options (``moments_dtype``,
    ``master_weights``, ...). The tables are keyed by the tensors themselves (identity, as torch.optim's
    ``state``), never by weak references: torch.utils.swap_tensors refuses a tensor that has one.
    """

    def __init__(self, optimizer, record: InBackwardUpdates) -> None:
        self._optimizer = weakref.ref(optimizer)
        self.record = record
        # Managed tensors (``p in tensors``); their post-accumulate-grad hooks.
        self.tensors: dict = {}
        self.hooked: dict = {}
        # Expert tensors held but not managed yet (:meth:`split_pending`): decided at their module's first
        # forward (managed if complete by then, else refused) or when param_groups are replaced.
        self.pending: list = []
        # Managed tensor -> the update attached to it.
        self.updates: dict = {}
        # [tensor, update, hook handle] of each managed tensor: removed when the optimizer is
        # garbage-collected (its finalizer holds the list, not the optimizer).
        self.entries: list = []
        # Managed tensor -> weak reference to its previous owner (it takes the tensor back when this one goes).
        self.previous: dict = {}
        # Managed tensor -> the seed of its stochastic rounding's stream (by the order it was given).
        self.seeds: dict = {}
        # Whether an expert tensor was replaced and adopted since the last step() (adopt_replacement).
        self.replaced_since_step = False
        # The ``params`` lists of param_groups as last seen (:meth:`follow`); None: never.
        self.synced_params: list | None = None
        # (weak reference to the module the optimizer was built from, id -> name of each dense parameter
        # taken from it), until the first step() ends (:meth:`remember_source`); None otherwise.
        self.dense_source: tuple | None = None

    @property
    def optimizer(self):
        """The optimizer these tables belong to."""
        return self._optimizer()

    def is_pending(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is held and not decided yet (:meth:`split_pending`)."""
        return any(p is q for q in self.pending)

    # -- Claiming: checks, state, update and hook --------------------------------------------------------

    def check(self, params, complete: bool = True) -> None:
        """Refuse (TypeError, ValueError) tensors the update cannot take; with ``complete``, also those
        whose gradient would be partial (:meth:`check_complete`)."""
        opt = self.optimizer
        name = type(opt).__name__
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{name} params must be tensors, got {type(p).__name__}")
            if p.dtype not in ops.SUPPORTED_DTYPES:
                raise TypeError(f"{name}: expert tensors must be float32, bfloat16 or float16, got {p.dtype}")
            if not ops.is_dense(p):
                raise ValueError(f"{name}: expert tensors must be dense tensors, got strides {p.stride()}")
            if opt.master_weights == STOCHASTIC and isinstance(p, DTensor):
                shard_index_base(p)  # a shard along the first dimension only: ValueError otherwise
            if opt.master_weights is not None and p.dtype != torch.bfloat16:
                raise TypeError(
                    f'{name}: master_weights="{opt.master_weights}" keeps bf16 expert tensors; got one of '
                    f"{p.dtype} (shape {tuple(p.shape)}): its master is itself"
                )
        if complete:
            self.check_complete(params)

    def check_complete(self, params, error=ValueError) -> None:
        """Refuse (``error``) expert tensors whose in-backward update would use a partial gradient: more
        than one rank, and neither sharded nor data-parallel (optim/distributed.py)."""
        opt = self.optimizer
        distributed.check_complete(type(opt).__name__, params, opt.data_parallel_group, error)

    def manage(self, params) -> None:
        """Create the state of ``params`` (already in param_groups), attach their updates (an earlier
        optimizer that owned one lets it go) and register their hooks."""
        opt = self.optimizer
        for p in params:
            if p in self.tensors:
                continue
            previous = expert_optimizer(p)
            if previous is not None and previous is not opt:
                previous.managed.let_go(p)
                self.previous[p] = weakref.ref(previous)
            self.seeds.setdefault(p, tensor_seed(opt.rounding_seed, len(self.seeds)))
            opt.state[p] = expert_state(
                p, opt.state.get(p, {}), opt.moments_dtype, master=opt.master_weights, seed=self.seeds[p]
            )
            self.tensors[p] = True
            self.record.add(p)
            self.attach(p)
        if self.pending:
            self.pending = [q for q in self.pending if q not in self.tensors]
        self.register_hooks()

    def claim(self, p: torch.Tensor) -> None:
        """The optimizer's :meth:`~sonar_kernels.optim.in_backward.InBackwardAdamW.claim` (its docstring
        says what and what is raised)."""
        opt = self.optimizer
        if p in self.tensors:
            update = self.updates.get(p)
            if update is not None and specs.update_of(p) is update and update.signature == signature(p):
                return
            self.rebuild(p)
            return
        if specs.update_of(p) is not None or not getattr(opt, "adopts_expert_tensors", False):
            return
        if not any(q is p for group in opt.param_groups for q in group["params"]):
            return  # a copy of a tensor it holds (a deep-copied model)
        name = type(opt).__name__
        if p.grad is not None:
            raise RuntimeError(
                f"{name}: the expert tensor of shape {tuple(p.shape)} has a gradient from a backward in which it "
                'was trained as a dense parameter (before its experts module ran "sonar"); call step() or '
                'zero_grad() before the first forward of the "sonar" experts'
            )
        check_group_options(name, self.record.groups.group(p), True)
        self.check([p])
        self.manage([p])

    def adopt_replacement(self, old: torch.Tensor, new: torch.Tensor) -> bool:
        """The optimizer's :meth:`~sonar_kernels.optim.in_backward.InBackwardAdamW.adopt_replacement` (its
        docstring says what, what it returns and what is raised)."""
        opt = self.optimizer
        if old not in self.tensors or tuple(new.shape) != tuple(old.shape):
            return False
        where = [
            (group, i)
            for group in opt.param_groups
            for i, q in enumerate(group["params"])
            if q is old or q is new
        ]
        if len(where) != 1 or where[0][0]["params"][where[0][1]] is not old:
            return False
        name = type(opt).__name__
        record = self.record
        if old in record.updated or old in record.micro_batches.counts or old.grad is not None:
            raise RuntimeError(
                f"{name}: the expert tensor of shape {tuple(old.shape)} was replaced by a new tensor (e.g. "
                "load_state_dict(assign=True)) between a backward that updated or accumulated it and step(); "
                "replace the model's parameters after step() (nothing was changed)"
            )
        if new.grad is not None:
            raise RuntimeError(
                f"{name}: the expert tensor of shape {tuple(new.shape)} that replaced one this optimizer updates "
                "has a gradient already; call zero_grad() before its experts module's forward (nothing was changed)"
            )
        self.check([new])
        # Nothing has changed so far.
        group, index = where[0]
        update = self.updates.get(old)
        before = update.signature[0] if update is not None else old.dtype
        same = (old.dtype, old.device, old.stride()) == (new.dtype, new.device, new.stride())
        state = opt.state.pop(old)
        previous = self.previous.pop(old, None)
        seed = self.seeds.pop(old, None)
        self.let_go(old)
        specs.attach_update(old, None)
        group["params"][index] = new
        if previous is not None:
            self.previous[new] = previous
        if seed is not None:
            self.seeds[new] = seed
        record.move(old, new)
        specs.set_holder(new, opt)
        self.tensors[new] = True
        opt.state[new] = state if same else expert_state(
            new, state, opt.moments_dtype, follows=before, master=opt.master_weights,
            seed=self.seeds.get(new, 0),
        )  # fmt: skip
        record.add(new)
        self.attach(new)
        self.register_hooks()
        self.replaced_since_step = True
        return True

    def rebuild(self, p: torch.Tensor) -> None:
        """The update of managed ``p`` after a conversion of ``p`` (``module.to(...)``: its dtype or device
        changed, in place or by torch.utils.swap_tensors, which also drops the attached update): the state
        moves to ``p``'s device, the moments that had the parameter's dtype take its new one, and a state
        that no update has advanced yet starts anew (what building the optimizer after the conversion
        gives)."""
        opt = self.optimizer
        name = type(opt).__name__
        if p in self.record.updated or p in self.record.micro_batches.counts or p.grad is not None:
            raise RuntimeError(
                f"{name}: the expert tensor of shape {tuple(p.shape)} was converted (dtype or device) between a "
                "backward and step(); convert the model before its forward or after step()"
            )
        check_converted(name, p, opt.master_weights)  # before any change of the state
        state = opt.state[p]
        update = self.updates.get(p)
        fresh = float(state["step"]) == 0.0  # reads the device: a conversion is rare
        before = update.signature[0] if update is not None else p.dtype
        opt.state[p] = expert_state(
            p, {} if fresh else state, opt.moments_dtype, follows=before, master=opt.master_weights,
            seed=self.seeds.get(p, 0),
        )  # fmt: skip
        self.record.add(p)
        self.attach(p)

    def attach(self, p: torch.Tensor) -> None:
        """(Re)build the update of ``p`` from its current state tensors and attach it."""
        opt = self.optimizer
        state = opt.state[p]
        record = self.record
        foreach, fused = torch_adamw_flags(record.groups.group(p), [p])
        tensors = UpdateState.of_optimizer(
            state, record.grad_norm_sq[p], record.skipped[p], record.clipped[p]
        )
        update = OwnedUpdate(
            opt, record, p, **tensors._asdict(), hyper=record.groups.tensor(p),
            grad_dtype=opt.grad_dtype or p.dtype, fused=opt.fused_epilogue, foreach=foreach, torch_fused=fused,
            accumulation_steps=opt.accumulation_steps, reduce_first=record.reduces_first(p),
        )  # fmt: skip
        old = self.updates.get(p)
        self.updates[p] = update
        record.tensors_by_id[id(p)] = p
        specs.attach_update(p, update)
        for entry in self.entries:
            if entry[1] is old and entry[0] is p:
                entry[1] = update
                break
        else:
            self.entries.append([p, update, None])

    def register_hooks(self) -> None:
        """The update of gradients that reach a managed tensor's ``.grad``. A hook needs requires_grad:
        tensors frozen now get theirs at the next step()."""
        for entry in self.entries:
            p = entry[0]
            if p.requires_grad and p not in self.hooked:
                hook = accumulated_grad_hook(self.optimizer, self.record, "on_grad_accumulated")
                entry[2] = self.hooked[p] = p.register_post_accumulate_grad_hook(hook)

    # -- Letting go --------------------------------------------------------------------------------------

    def let_go(self, p: torch.Tensor) -> None:
        """A newer optimizer owns ``p`` now: remove this one's hook; ``p`` is no longer updated here in the
        backward (its state is kept)."""
        handle = self.hooked.pop(p, None)
        if handle is not None:
            handle.remove()
        self.tensors.pop(p, None)
        self.updates.pop(p, None)
        self.entries[:] = [entry for entry in self.entries if entry[0] is not p]

    def take_back(self, p: torch.Tensor) -> None:
        """The newer optimizer that took ``p`` was garbage-collected: own it again, with the state kept."""
        opt = self.optimizer
        if p in opt.state and any(q is p for group in opt.param_groups for q in group["params"]):
            self.tensors[p] = True
            self.attach(p)
            self.register_hooks()

    def drop(self, p: torch.Tensor) -> None:
        """Forget managed ``p``, which left ``param_groups`` (replaced by a new tensor there, e.g. its FSDP2
        shard): no update, hook, state or record of the optimizer keeps it."""
        update = self.updates.get(p)
        self.optimizer.state.pop(p, None)
        self.previous.pop(p, None)
        self.seeds.pop(p, None)
        self.let_go(p)
        if update is not None and specs.update_of(p) is update:
            specs.attach_update(p, None)
        self.record.forget(p)

    # -- Following param_groups (the module docstring says how) --------------------------------------------

    def remember_source(self, model: torch.nn.Module) -> None:
        """Keep (weakly) the module the optimizer was built from and the name of each dense parameter it
        took from it, until its first ``step()`` ends (a step post-hook drops them): :meth:`refuse_sharded_after`
        checks them at each experts module's forward and at ``step()`` until then."""
        names = {id(p): name for name, p in model.named_parameters() if not is_expert_tensor(p)}
        self.dense_source = (weakref.ref(model), names)

        # It stays registered: removing it while torch iterates the hooks would break that iteration.
        def forget(opt, args, kwargs):
            opt.managed.dense_source = None

        self.optimizer.register_step_post_hook(forget)

    def refuse_sharded_after(self) -> None:
        """RuntimeError, before anything is updated, when FSDP2 sharded dense parameters of the module the
        optimizer was built from after it was built (``fully_shard``, ``sonar_kernels.nn.fully_shard_dense``)
        and its ``param_groups`` still hold the unsharded tensors: their gradients reach the shards, so it
        would not train them, in silence (torch.optim.AdamW's rule). accelerate's ``prepare`` puts the shards
        in the groups before the first forward (:meth:`follow`), which this accepts."""
        source = self.dense_source
        model = source[0]() if source is not None else None
        if model is None:
            return
        opt = self.optimizer
        current = dict(model.named_parameters())
        stale = []
        for group in opt.param_groups:
            for p in group["params"]:
                name = source[1].get(id(p))
                now = current.get(name) if name is not None else None
                if (
                    now is not None
                    and now is not p
                    and isinstance(now, DTensor)
                    and not isinstance(p, DTensor)
                ):
                    stale.append(name)
        if stale:
            raise RuntimeError(
                f"{type(opt).__name__}: {len(stale)} dense parameter(s) of the model it was built from were "
                f"sharded by FSDP2 since ({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}): it holds the "
                "unsharded tensors, whose gradients no longer arrive, so it would not train them. Build the optimizer "
                'after fully_shard / sonar_kernels.nn.fully_shard_dense (docs/distributed.md, "Expert parallel with '
                "the dense layers on FSDP2\"), or let accelerate's prepare put the shards in its param_groups. Nothing "
                "was updated."
            )

    def split_pending(self, experts: list) -> tuple[list, list]:
        """(ready, pending): with several ranks, an expert tensor neither sharded, expert-parallel nor
        covered by ``data_parallel_group`` waits (no state, no update) until it can be decided: the stacks
        that shard a model (accelerate's ``prepare``, transformers' Trainer with FSDP2) build the optimizer
        on the unsharded model first, then replace its ``param_groups`` entries by the shards
        (:meth:`follow`). A tensor still held at its module's first forward is refused there."""
        if distributed.world_size() <= 1:
            return experts, []
        group = self.optimizer.data_parallel_group
        pending = [p for p in experts if distributed.layout(p, group) == "local"]
        return [p for p in experts if not any(p is q for q in pending)], pending

    def add(self, ready: list, pending: list) -> None:
        """After ``ready`` and ``pending`` (:meth:`split_pending`) joined ``param_groups``: manage the
        first, hold the others undecided."""
        self.manage(ready)
        self.pending.extend(pending)

    def mark_synced(self) -> None:
        """The ``params`` lists of the optimizer's param_groups are the ones :meth:`follow` has seen."""
        self.synced_params = [group["params"] for group in self.optimizer.param_groups]

    def follow(self) -> None:
        """Follow the replaced entries of the optimizer's ``param_groups`` (SonarAdamW.sync_param_groups;
        the module docstring says how)."""
        self.refuse_sharded_after()
        opt = self.optimizer
        lists = [group["params"] for group in opt.param_groups]
        synced = self.synced_params
        if (
            synced is not None
            and len(lists) == len(synced)
            and all(a is b for a, b in zip(lists, synced, strict=True))
        ):
            return
        held = [p for params in lists for p in params]
        ids = {id(p) for p in held}
        gone = [p for p in self.tensors if id(p) not in ids]
        new = [p for p in held if specs.holder_of(p) is not opt]
        name = type(opt).__name__
        record = self.record
        if any(isinstance(p, DTensor) for p in new):
            ownership.mark_fsdp_expert_tensors()  # FSDP2's sharded parameters lost their modules' marks
        experts = [p for p in new if is_expert_tensor(p)]
        left = len(gone) + sum(not any(p is q for q in held) for p in self.pending)
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
            if p in record.updated or p in record.micro_batches.counts or float(opt.state[p]["step"]) != 0.0:
                raise RuntimeError(
                    f"{name}: the expert tensor of shape {tuple(p.shape)} left param_groups (replaced, e.g. by "
                    "accelerate's prepare, which puts the FSDP2 shards of the model in the optimizer's place) after "
                    "an update or a micro-batch of it: its state cannot follow to the new tensor. Prepare the model "
                    "and the optimizer before training (nothing was changed)"
                )
        for p in experts:
            check_group_options(name, record.groups.group(p), True)
        ready, pending = self.split_pending(experts)
        self.check(ready)
        self.check(pending, complete=False)
        # Nothing has changed so far.
        for p in gone:
            self.drop(p)
        self.pending = [p for p in self.pending if id(p) in ids]
        self.add(ready, pending)
        for p in new:
            specs.set_holder(p, opt)
        self.synced_params = lists

    def refuse_pending(self) -> None:
        """RuntimeError, before anything changes, when expert tensors held undecided reach ``step()``:
        their module never ran a forward that could hand them over (torch.compile), and with several ranks
        their gradients are partial."""
        if self.pending:
            raise RuntimeError(
                distributed.partial_gradient_message(
                    type(self.optimizer).__name__, self.pending, " (nothing was changed)"
                )
            )
