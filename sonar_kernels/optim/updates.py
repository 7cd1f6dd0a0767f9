"""What an optimizer's in-backward updates did in the current step, the checks before each one, and the
update of gradients that reach ``.grad`` (docs/design.md, "When the updates run").

:class:`InBackwardUpdates` is the part of :class:`sonar_kernels.optim.in_backward.InBackwardAdamW` that
runs per update: the MLP's backward asks it (through the tensor's update handle) whether a tensor may be
updated now, accumulates or updates, and reports back; a gradient that reaches a managed tensor's
``.grad`` (the torch backend's deferred part, a weight used outside the MLP, FSDP2's reduced shard) is
counted, held, averaged over the data-parallel group or applied by torch's AdamW here. ``step()`` ends
the step here (:meth:`InBackwardUpdates.end_step`).
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch.distributed.tensor import DTensor

from sonar_kernels import ops, specs
from sonar_kernels.ops.grad_update import adamw_8bit_, stochastic_adamw_
from sonar_kernels.ops.torch_backend.adamw import remainder_adamw_
from sonar_kernels.optim import distributed, loss_scaling, ownership
from sonar_kernels.optim.accumulation import MicroBatches
from sonar_kernels.optim.expert_state import moment_tensors
from sonar_kernels.optim.grad_hooks import weak_call
from sonar_kernels.optim.param_groups import (
    GroupHyperparameters,
    check_group_options,
    torch_adamw_flags,
    torch_hyperparameters,
)
from sonar_kernels.optim.reentrant import HeldGradients
from sonar_kernels.rules.clipping import clips
from sonar_kernels.update_state import UpdateState

__all__ = ["InBackwardUpdates"]


class InBackwardUpdates:
    """The per-step record and the update path of one optimizer's managed tensors.

    Holds the optimizer weakly and reads its public ``state``, ``param_groups`` and
    ``data_parallel_group``.

    Attributes:
        micro_batches: the accumulation window (optim/accumulation.py).
        groups: the groups as the updates read them (optim/param_groups.py).
        held: reentrant checkpointing's held gradients (optim/reentrant.py).
        updated: tensors updated since the last ``step()``; ``updated_in_backward`` those the MLP's
            backward updated.
        grad_norm_sq: tensor -> 0-dim float32, the squared L2 norm of the gradient of its update in the
            last step (0 if none, inf if the update was skipped).
        skipped: tensor -> 0-dim int64, its updates skipped for a non-finite or too large gradient.
        clipped: tensor -> 0-dim int64, the gradient entries the spike rule replaced in its update of the
            last step (expert clipping; 0 without it or without an update).
        tensors_by_id: id -> tensor, for the update handles.
    """

    def __init__(self, optimizer, accumulation_steps: int, grad_dtype: torch.dtype | None) -> None:
        self.micro_batches = MicroBatches(accumulation_steps, grad_dtype)
        self._optimizer = weakref.ref(optimizer)
        self.groups = GroupHyperparameters(optimizer)
        self.held = HeldGradients()
        group = optimizer.data_parallel_group
        self.reducer = distributed.GradientReducer(group) if group is not None else None
        # Keyed by the tensors themselves (identity, as torch.optim's ``state``), never by weak references:
        # torch.utils.swap_tensors refuses a tensor that has one.
        self.updated: dict = {}
        self.updated_in_backward: dict = {}
        self.grad_norm_sq: dict = {}
        self.skipped: dict = {}
        self.clipped: dict = {}
        # Tensor updated in this step -> its version counter right after the update (plain tensors; a
        # compiled update records none): a write since shows in check_before_step.
        self.versions: dict = {}
        # Whether grad_norm_sq and clipped were reset for this step (at its first update or micro-batch).
        self.telemetry_reset = False
        # Whether the user was told that DTensor shards are updated from their reduced gradient (once).
        self.told_sharded = False
        # id -> tensor of every tensor an update of the optimizer was built for (the update handles name
        # their tensor by id: optim/update_handle.py).
        self.tensors_by_id: dict[int, torch.Tensor] = {}

    @property
    def owner(self) -> str:
        """The optimizer's class name, for messages."""
        return type(self._optimizer()).__name__

    def add(self, p: torch.Tensor) -> None:
        """Start the record of a newly managed ``p``, or move it to ``p``'s device after a conversion."""
        if p in self.grad_norm_sq:
            self.grad_norm_sq[p] = self.grad_norm_sq[p].to(p.device)
            self.skipped[p] = self.skipped[p].to(p.device)
            self.clipped[p] = self.clipped[p].to(p.device)
        else:
            self.grad_norm_sq[p] = torch.zeros((), dtype=torch.float32, device=p.device)
            self.skipped[p] = torch.zeros((), dtype=torch.int64, device=p.device)
            self.clipped[p] = torch.zeros((), dtype=torch.int64, device=p.device)

    def move(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``new`` takes the place of managed ``old`` (:meth:`InBackwardAdamW.adopt_replacement`): its
        telemetry moves over, and nothing keyed by ``old`` stays (it would keep the old tensor alive). Only
        between a ``step()`` and the next backward: nothing of the step is pending."""
        self.grad_norm_sq[new] = self.grad_norm_sq.pop(old).to(new.device)
        self.skipped[new] = self.skipped.pop(old).to(new.device)
        self.clipped[new] = self.clipped.pop(old).to(new.device)
        self.tensors_by_id.pop(id(old), None)
        self.groups.forget_tensor(old)
        for table in (self.held.without_graph, self.held.held, self.held.arrived_in):
            table.pop(old, None)

    def forget(self, p: torch.Tensor) -> None:
        """Nothing of the record keeps ``p`` (it left the optimizer before any update of it)."""
        self.grad_norm_sq.pop(p, None)
        self.skipped.pop(p, None)
        self.clipped.pop(p, None)
        self.tensors_by_id.pop(id(p), None)
        self.groups.forget_tensor(p)
        for table in (self.held.without_graph, self.held.held, self.held.arrived_in):
            table.pop(p, None)

    # -- The checks ----------------------------------------------------------------------------------------

    def check_not_updated(self, p: torch.Tensor) -> None:
        """Raise RuntimeError when ``p`` was updated since the last ``step()``."""
        if p in self.updated:
            raise RuntimeError(
                f"{self.owner}: the expert tensor of shape {tuple(p.shape)} was already updated in a backward "
                "since the last optimizer.step() (also when that backward raised afterwards: the update had run); "
                "call step() between backward passes (the update is applied in the backward, so another backward "
                "would update it twice), or set accumulation_steps to the number of micro-batches per step"
            )

    def check_may_update(self, p: torch.Tensor) -> None:
        """The checks before a backward updates ``p`` or adds to its gradient, each raising RuntimeError
        before anything is written: not updated since step(), its gradient complete with several ranks,
        not the backward of a GradScaler-scaled loss; ValueError for an option of ``p``'s group that the
        update does not implement. Then ``p``'s group's hyperparameters as they are now are written to the
        tensor the update reads (a value set since the forward included; step() compares them,
        :meth:`GroupHyperparameters.check_unchanged`)."""
        self.check_not_updated(p)
        distributed.check_complete(self.owner, [p], self._optimizer().data_parallel_group, RuntimeError)
        loss_scaling.refuse(self.owner)
        check_group_options(self.owner, self.groups.group(p), True)
        self.groups.tensor(p)
        self.reset_telemetry()

    def reset_telemetry(self) -> None:
        """Before this step's first update (or micro-batch) writes anything: every tensor's norm and clipped
        count read 0, so that from the end of this step's backward a tensor with no gradient in it reads 0
        (not the last step's values), as after ``step()``."""
        if not self.telemetry_reset:
            self.telemetry_reset = True
            # The forwards of this step saved them (the updates write them): their versions are kept.
            with torch.no_grad():
                for table in (self.grad_norm_sq, self.clipped):
                    for value in table.values():
                        with torch.autograd._unsafe_preserve_version_counter(value):
                            value.zero_()

    def reduces_first(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is averaged over the data-parallel group before its update."""
        group = self._optimizer().data_parallel_group
        return self.reducer is not None and distributed.layout(p, group) == "data-parallel"

    # -- The MLP's backward ------------------------------------------------------------------------------

    def accumulating(self, p: torch.Tensor) -> bool:
        """Whether this backward's gradient of ``p`` goes into ``p.grad`` or its buffer (micro-batches
        1 .. k-1 of ``accumulation_steps`` = k) instead of into an update; raises if ``p`` was updated
        since step()."""
        self.check_not_updated(p)
        return self.micro_batches.accumulating(p)

    def accumulated_into(self, p: torch.Tensor, buffer: torch.Tensor | None) -> None:
        """The MLP's backward added its micro-batch of ``p`` to ``buffer``: count it."""
        self.micro_batches.record(p, buffer)
        self.held.mark_counted(p)

    def finish_update(self, p: torch.Tensor) -> None:
        """After the kernels wrote p and its moments: record it, and bump the version counters (Triton
        writes do not), so a graph that saved the old p fails loudly instead of using new values."""
        self.updated[p] = True
        self.updated_in_backward[p] = True
        self.micro_batches.consumed(p)  # the accumulated gradient, consumed by the update
        self.held.forward_with_graph(p)
        state = self._optimizer().state[p]
        torch.autograd.graph.increment_version([p, *moment_tensors(state)])
        self._record_version(p)

    def _record_version(self, p: torch.Tensor) -> None:
        """Remember ``p``'s version counter right after its update (a DTensor's is not followed)."""
        if not isinstance(p, DTensor):
            self.versions[p] = p._version

    def compiled_update(self, p: torch.Tensor) -> None:
        """A compiled backward is about to update ``p``: check and record it."""
        self.check_may_update(p)
        self.updated[p] = True
        self.updated_in_backward[p] = True

    # -- Gradients that reach .grad ------------------------------------------------------------------------

    def apply_grad(self, p: torch.Tensor) -> None:
        """torch's own AdamW on an accumulated ``p.grad``, which is then released (torch backend).

        Skipped, as the Triton update is (see ops.AdamWUpdate), when the gradient has an entry that is
        not finite or beyond ops.grad_limit: with fused=True through torch's ``found_inf`` (no host
        sync); torch's other AdamW paths have no such input, so the decision is read on the host there
        (a sync on a GPU).
        """
        self.check_not_updated(p)
        grad = self.micro_batches.pending(p)
        group = self.groups.group(p)
        foreach, fused = torch_adamw_flags(group, [p])
        hyper = self.groups.tensor(p)
        clipping = {"clip": hyper if clips(hyper) else None, "clipped": self.clipped[p]}
        tensors = UpdateState.of_optimizer(
            self._optimizer().state[p], self.grad_norm_sq[p], self.skipped[p], self.clipped[p]
        )
        kind = tensors.kind
        if kind.moments == "8bit" or kind.master == "stochastic":
            # 8-bit moments (the scheme's update, skipped the same way) or bf16 weights rounded stochastically
            # (AdamW in fp32, then the rounding): the rules in the "fp64" arithmetic.
            update = adamw_8bit_ if kind.moments == "8bit" else stochastic_adamw_
            update(p, grad, None, tensors.tensors(), hyper, grad_dtype=grad.dtype, chunk_bytes=None)
        elif kind.master == "remainder":  # bf16 master weights: torch's AdamW on the merged fp32 master
            remainder_adamw_(
                p, tensors.remainder, grad, tensors.exp_avg, tensors.exp_avg_sq, tensors.step,
                torch_hyperparameters(group), self.grad_norm_sq[p], self.skipped[p], foreach=foreach, fused=fused,
                **clipping,
            )  # fmt: skip
        else:
            ops.torch_adamw_(
                p, grad, tensors.exp_avg, tensors.exp_avg_sq, tensors.step, torch_hyperparameters(group),
                self.grad_norm_sq[p], self.skipped[p], foreach=foreach, fused=fused, **clipping,
            )  # fmt: skip
        self.micro_batches.consumed(p)
        self.updated[p] = True
        self._record_version(p)

    def hold_until_backward_ends(self, p: torch.Tensor) -> None:
        """Gradients of ``p`` that reach ``.grad`` from now on wait for the end of the running backward
        (optim/reentrant.py)."""
        self.held.hold(p, weak_call(self, "release_held", p))

    def release_held(self, p: torch.Tensor) -> None:
        """The end of the backward whose gradients of ``p`` reaching ``.grad`` were held: they join the
        micro-batch the MLP's backward counted, or count as one."""
        counted = self.held.release(p)
        if p.grad is None:
            return
        if counted:
            self.micro_batches.add(p, p.grad)
            p.grad = None
        else:
            self.on_grad_accumulated(p)

    def on_grad_accumulated(self, p: torch.Tensor) -> None:
        """A gradient was added to ``p.grad`` (torch backend, or a micro-batch before the last): keep it
        until the k-th micro-batch, then apply torch's AdamW and release it.

        After a forward without a graph (reentrant activation checkpointing), the part of this backward
        waits for its end: the checkpointed region's backward, nested in this one, may add the MLP's part
        (its update then reads ``.grad``)."""
        if self.held.is_held(p):
            return
        if self.held.waits(p):
            self.hold_until_backward_ends(p)
            return
        if p in self.updated and self.updated_in_backward.get(p, False):
            raise RuntimeError(
                f"{self.owner}: the expert tensor of shape {tuple(p.shape)} received a gradient from "
                "outside the expert MLP (e.g. a penalty on the weights) after the MLP's backward updated it; a "
                "tensor updated in the backward must get its whole gradient from moe_mlp / SonarExperts"
            )
        ownership.check_forward(specs.expert_module_of(p))  # a forward that bypasses "sonar" says so
        self.check_may_update(p)
        if isinstance(p, DTensor) and not self.told_sharded:  # the fused epilogue does not run: say so once
            self.told_sharded = True
            warnings.warn(
                ownership.ShardedExpertsWarning(ownership.sharded_experts_message(self.owner, p)),
                stacklevel=2,
            )
        self.micro_batches.take_grad(p)
        if self.micro_batches.count(p) >= self.micro_batches.steps:
            if self.reduces_first(p):
                # Averaged over the data-parallel group while the backward goes on; updated when done.
                self.reducer.reduce(self.micro_batches.pending(p), weak_call(self, "apply_grad", p))
            else:
                self.apply_grad(p)

    # -- The step ------------------------------------------------------------------------------------------

    def changed_since_update(self, p: torch.Tensor) -> str | None:
        """How ``p``, updated in this step, changed since its update, or None: "replaced" (its experts module
        holds another tensor in its place since: ``load_state_dict(assign=True)``, an assignment) or
        "written" (written in place: ``model.load_state_dict(...)`` copies into it, ``p.copy_(...)``)."""
        held_at = getattr(specs.update_of(p), "held_at", None)
        module = held_at[0]() if held_at is not None else None
        tensors = specs.expert_tensors_of(module) if module is not None else None
        if tensors is not None and held_at[1] < len(tensors) and tensors[held_at[1]] is not p:
            return "replaced"
        version = self.versions.get(p)
        return "written" if version is not None and p._version != version else None

    def rolled_back(self, managed) -> bool:
        """Whether every tensor of ``managed`` updated in this step changed since its update (restored from a
        snapshot): the optimizer's state of the snapshot may then be loaded, which ends this step."""
        updated = [p for p in self.updated if p in managed]
        return bool(updated) and all(self.changed_since_update(p) is not None for p in updated)

    def check_before_step(self, managed) -> None:
        """The checks of ``step()`` before it changes anything (RuntimeError; the step does not end): each
        tensor of ``managed`` updated in this step is where its update left it (:meth:`changed_since_update`;
        else the step would keep weights that do not hold the update with moments and a step that do), and
        the groups' hyperparameters are those its update used (:meth:`GroupHyperparameters.check_unchanged`)."""
        for p in self.updated:
            how = self.changed_since_update(p) if p in managed else None
            if how is not None:
                what = (
                    "replaced in its experts module by another tensor (load_state_dict(assign=True), an assignment)"
                    if how == "replaced"
                    else "written in place (model.load_state_dict() copies into it, copy_)"
                )
                raise RuntimeError(
                    f"{self.owner}: the expert tensor of shape {tuple(p.shape)} was {what} between the backward "
                    "that updated it and step(): its exp_avg, exp_avg_sq and step already hold this step's update, "
                    "so the restored weights would go on with the moments of the step they undo (nothing was "
                    "changed). To roll the step back, load the optimizer's state_dict() saved with the weights "
                    "(load_state_dict(), which ends this step); or put the updated weights back and call step() "
                    '(docs/usage.md, "Checkpoints and resume")'
                )
        self.groups.check_unchanged(self.owner, managed, self.updated)

    def end_rolled_back_step(self) -> None:
        """After the optimizer's state was loaded over a rolled-back step (:meth:`rolled_back`): the step ends
        with nothing applied (the loaded state is the snapshot's)."""
        self.updated, self.updated_in_backward, self.versions = {}, {}, {}
        self.telemetry_reset = False
        self.micro_batches.reset()

    def end_step(self, managed: list[torch.Tensor]) -> None:
        """Apply once a gradient found on a tensor of ``managed`` (it had requires_grad=False when it was
        given, so its hook came later), then end the step: each managed tensor may be updated again."""
        try:
            if self.reducer is not None:
                self.reducer.drain()  # reductions left by a backward that raised
            for p in managed:
                if p.grad is not None and p in self.updated:
                    # Left by a backward that already raised (one more than accumulation_steps).
                    p.grad = None
                elif p.grad is not None or p in self.micro_batches.buffers:
                    if self.reduces_first(p):
                        apply = weak_call(self, "apply_grad", p)
                        self.reducer.reduce(self.micro_batches.pending(p), apply, in_backward=False)
                    else:
                        self.apply_grad(p)
            for p in managed:
                if p not in self.updated:
                    self.grad_norm_sq[p].zero_()  # no gradient this step: it counts as 0
                    self.clipped[p].zero_()
        finally:
            # The step ends even when a gradient above was refused (a tensor updated twice).
            self.updated = {}
            self.updated_in_backward = {}
            self.versions = {}
            self.telemetry_reset = False
            self.micro_batches.reset()
