"""The update handle an optimizer attaches to each tensor it updates in the backward: what the expert MLP's
autograd layer (``sonar_kernels.specs.ExpertUpdate``'s protocol, docs/design.md, "When the updates run")
calls in eager mode to learn whether and how the tensor is updated, and to report what it did.
"""

from __future__ import annotations

import weakref

import torch

from sonar_kernels import specs
from sonar_kernels.optim.grad_hooks import check_no_user_hooks
from sonar_kernels.optim.param_groups import torch_hyperparameters
from sonar_kernels.optim.updates import InBackwardUpdates
from sonar_kernels.specs import update_of

__all__ = ["OwnedUpdate", "expert_optimizer", "release_entries", "signature"]


class OwnedUpdate(specs.ExpertUpdate):
    """The update of one managed tensor, with its owner's bookkeeping (``record``: the optimizer's
    :class:`InBackwardUpdates`). It holds the optimizer and the record weakly and the tensor not at all (by
    its id, which the record maps back to it while the optimizer holds it): the update is an attribute of
    the tensor, and a weak reference to a parameter would make ``torch.utils.swap_tensors`` (module
    conversions in swap mode) refuse it.

    ``signature``: the tensor's (dtype, device, shape) when the update was built; a conversion of the
    tensor since (``module.to(...)``, in place or by swapping) shows as another signature."""

    def __init__(self, optimizer, record: InBackwardUpdates, param: torch.Tensor, **fields):
        super().__init__(**fields)
        self._optimizer = weakref.ref(optimizer)
        self._record = weakref.ref(record)
        self._key = id(param)
        self.signature = signature(param)
        # The autograd graphs recorded over the tensor that have not run their backward yet.
        self.live = weakref.WeakSet()
        self._buffer = None

    @property
    def optimizer(self):
        return self._optimizer()

    def tensor(self) -> torch.Tensor | None:
        """The tensor this update was built for, while its optimizer lives and holds it; else None."""
        return self._lookup()[1]

    def _lookup(self):
        """(the record, the tensor), or Nones once the optimizer was garbage-collected."""
        record = self._record()
        return record, None if record is None else record.tensors_by_id.get(self._key)

    def _owner(self):
        record, param = self._lookup()
        if record is None or param is None:
            raise RuntimeError("the optimizer that owned this expert tensor was garbage-collected")
        return record, param

    def accumulating(self) -> bool:
        record, param = self._owner()
        return record.accumulating(param)

    def track(self, graph) -> None:
        # A graph recorded while a backward runs is activation checkpointing's recomputation: non-reentrant,
        # it is thrown away once its saved tensors are taken, though a collective can hold one of its tensors
        # a while longer (gloo's and NCCL's work objects keep their inputs until their own threads release
        # them), which kept it in this set when the running backward came to the update; reentrant, its
        # backward runs at once, nested in the running one. Neither is another graph whose backward would
        # see updated weights, so neither is tracked (a graph recorded in a backward hook and backpropagated
        # after the update is still refused, by _Watched.check_unchanged, before its backward writes anything).
        if torch._C._current_graph_task_id() == -1:
            self.live.add(graph)
        record, param = self._lookup()
        if record is not None and param is not None:
            record.held.forward_with_graph(param)  # a forward with a graph came after it

    def untrack(self, graph) -> None:
        self.live.discard(graph)

    def begin_backward(self, graph) -> None:
        record, param = self._owner()
        self.live.discard(graph)
        if update_of(param) is not self:
            raise RuntimeError(
                f"an expert tensor of shape {tuple(param.shape)}: its in-backward update changed between this "
                "graph's forward and its backward (an optimizer was built over it, or load_state_dict() replaced "
                "its state), so the state this forward recorded is no longer the optimizer's; nothing was "
                "updated: run the forward again"
            )
        if len(self.live):
            raise RuntimeError(
                f"an expert tensor of shape {tuple(param.shape)}: {len(self.live)} other live autograd graph(s) use "
                f"it, which {record.owner} updates in this backward; their backward would then see the "
                "updated weights. Call the experts once per forward (or once per backward), or free the other "
                "graph first."
            )
        record.check_may_update(param)
        check_no_user_hooks(record.owner, param)

    def grad_in(self, other=None):
        record, param = self._owner()
        return record.micro_batches.grad_in(param, other)

    def hyperparameters(self):
        record, param = self._owner()
        return torch_hyperparameters(record.groups.group(param))

    def add_to_buffer(self, other) -> None:
        """Add ``other`` (the gradient the tensor's other producers gave in this backward, or None) to
        the micro-batch buffer the backward just added to."""
        if other is not None:
            record, param = self._owner()
            record.micro_batches.add(param, other)

    def accumulation_buffer(self):
        record, param = self._owner()
        accumulator = record.micro_batches.accumulator_for(param)
        if accumulator is None:
            return None
        self._buffer = accumulator.buffer
        return accumulator.buffer, accumulator.add

    def finish(self, applied: bool) -> None:
        record, param = self._owner()
        if applied:
            record.finish_update(param)
        else:
            record.accumulated_into(param, self._buffer)
        self._buffer = None

    def compiled_update(self) -> None:
        record, param = self._owner()
        record.compiled_update(param)

    def forward_without_graph(self) -> None:
        record, param = self._owner()
        record.held.forward_without_graph(param)

    def forward_in_backward(self, accumulates: bool) -> bool:
        record, param = self._owner()
        record.held.forward_with_graph(param)
        if accumulates:
            record.hold_until_backward_ends(param)
        return record.held.arrived_in_this_backward(param)


def expert_optimizer(param: torch.Tensor):
    """The live optimizer that updates ``param`` in the backward (the one whose update it carries), or None."""
    update = update_of(param)
    return update.optimizer if isinstance(update, OwnedUpdate) else None


def signature(t: torch.Tensor) -> tuple:
    """(dtype, device, shape) of ``t``: what a module conversion (``module.to(...)``) changes."""
    return (t.dtype, t.device, tuple(t.shape))


def release_entries(entries: list, previous: dict) -> None:
    """Remove the hooks and updates of a garbage-collected optimizer (entries: [tensor, update, hook
    handle or None]); a tensor it took from an optimizer still alive goes back to that one
    (``previous``: tensor -> weak reference to it), so the tensor is never left without its owner."""
    for param, update, handle in entries:
        if handle is not None:
            handle.remove()
        if update_of(param) is update:
            specs.attach_update(param, None)
            before = previous.get(param)
            before = before() if before is not None else None
            if before is not None:
                before.managed.take_back(param)
    entries.clear()
