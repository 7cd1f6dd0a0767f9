"""Micro-batch gradient accumulation of the tensors updated in the backward (``accumulation_steps``):
how many micro-batches each tensor has counted since the last ``step()``, and where their summed gradient
waits for the last one (docs/usage.md, "Gradient accumulation").

The sum is in the tensor's ``.grad`` when ``grad_dtype`` is its dtype (autograd adds to it), else in a
buffer of ``grad_dtype`` kept here (``.grad`` must have the tensor's dtype). The last micro-batch's update
adds it to its own gradient (:meth:`MicroBatches.grad_in`) and the window ends
(:meth:`MicroBatches.consumed`).
"""

from __future__ import annotations

import torch

from sonar_kernels import ops, specs
from sonar_kernels.ops.common import like

__all__ = ["MicroBatches"]


class MicroBatches:
    """The accumulation window of an optimizer's managed tensors.

    Attributes:
        steps: ``accumulation_steps``, the micro-batches per update (an int >= 1).
        grad_dtype: the dtype the gradients are summed in (None: each tensor's own).
        counts: tensor -> micro-batches counted since the window began.
        buffers: tensor -> the summed gradient of ``grad_dtype``, for tensors whose dtype is another.
    """

    def __init__(self, steps: int, grad_dtype: torch.dtype | None) -> None:
        if not specs.is_integer(steps) or steps < 1:
            raise ValueError(f"accumulation_steps must be an int >= 1, got {steps!r}")
        self.steps = int(steps)
        self.grad_dtype = grad_dtype
        # Keyed by the tensors themselves (identity, as torch.optim's ``state``), never by weak references:
        # torch.utils.swap_tensors refuses a tensor that has one.
        self.counts: dict = {}
        self.buffers: dict = {}

    def accumulating(self, p: torch.Tensor) -> bool:
        """Whether this backward's gradient of ``p`` is a micro-batch before the window's last (it is
        summed, not applied)."""
        return self.counts.get(p, 0) + 1 < self.steps

    def uses_buffer(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s micro-batch gradients are summed in a buffer of ``grad_dtype`` rather than in
        ``p.grad`` (which has ``p``'s dtype)."""
        return (self.grad_dtype or p.dtype) != p.dtype

    def count(self, p: torch.Tensor) -> int:
        """Count one more micro-batch of ``p``; returns the count."""
        count = self.counts.get(p, 0) + 1
        self.counts[p] = count
        return count

    def accumulator_for(self, p: torch.Tensor) -> ops.GradAccumulator | None:
        """Where the Triton backward adds this micro-batch's gradient of ``p`` (not the last of the
        window): None for ``p.grad`` (autograd sums it), else the buffer of ``grad_dtype``. A new buffer
        (the window's first micro-batch) is kept only once its launch is done (:meth:`record`), so a
        backward that fails before leaves nothing unwritten behind."""
        if not self.uses_buffer(p):
            return None
        buffer = self.buffers.get(p)
        add = buffer is not None
        if buffer is None:
            buffer = like(p, self.grad_dtype)
        return ops.GradAccumulator(buffer, add)

    def record(self, p: torch.Tensor, buffer: torch.Tensor | None) -> None:
        """A backward added its micro-batch of ``p`` to ``buffer`` (None: to ``p.grad``): count it."""
        if buffer is not None:
            self.buffers[p] = buffer
        self.count(p)

    def add(self, p: torch.Tensor, other: torch.Tensor) -> None:
        """Add ``other`` to ``p``'s buffer."""
        with torch.no_grad():
            self.buffers[p].add_(other)

    def take_grad(self, p: torch.Tensor) -> None:
        """Move ``p.grad`` (a gradient that reached it) into ``p``'s buffer when it uses one."""
        if not self.uses_buffer(p):
            return
        buffer = self.buffers.get(p)
        with torch.no_grad():
            if buffer is None:
                self.buffers[p] = like(p, self.grad_dtype).copy_(p.grad)
            else:
                buffer.add_(p.grad)
        p.grad = None

    def pending(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient summed so far for ``p``: its buffer, else ``p.grad`` (None when there is none)."""
        return self.buffers.get(p, p.grad)

    def grad_in(self, p: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor | None:
        """The gradient of earlier micro-batches of ``p`` (its buffer or ``.grad``) plus ``other`` (what
        the tensor's other producers gave in this backward), in ``grad_dtype`` with ``p``'s strides, which
        the backward's update adds to its own; None when there is none."""
        grad_dtype = self.grad_dtype or p.dtype
        grad_in = self.buffers.get(p, p.grad)
        if grad_in is not p.grad and p.grad is not None:
            # A buffer, and a part held in .grad (reentrant checkpointing's held gradients).
            other = p.grad if other is None else other + p.grad
        if other is not None:
            with torch.no_grad():
                grad_in = other if grad_in is None else grad_in + other
        if grad_in is not None and (grad_in.dtype != grad_dtype or grad_in.stride() != p.stride()):
            grad_in = torch.empty_like(p, dtype=grad_dtype).copy_(grad_in)
        return grad_in

    def consumed(self, p: torch.Tensor) -> None:
        """An update used ``p``'s summed gradient: its window ends (``.grad`` and the buffer released)."""
        self.counts.pop(p, None)
        self.buffers.pop(p, None)
        p.grad = None

    def reset(self, set_to_none: bool = True) -> None:
        """A new window for every tensor (``step()``, ``zero_grad()``): the counts are forgotten; the
        buffers released, or zeroed with ``set_to_none=False`` (as ``zero_grad`` treats ``.grad``)."""
        self.counts = {}
        if set_to_none:
            self.buffers = {}
        else:
            for buffer in self.buffers.values():
                buffer.zero_()
