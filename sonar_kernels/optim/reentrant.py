"""Reentrant activation checkpointing and the in-backward update (docs/design.md, "When the updates run").

With reentrant checkpointing an expert tensor's forward runs without a graph, and the forward that records
its graph runs again inside the backward; its gradient then arrives in the running backward and in the
backward nested in it. Gradients that reach ``.grad`` there wait for the end of the running backward
(:meth:`HeldGradients.hold`), where they count as one micro-batch with the part the MLP's backward gave.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["HeldGradients"]


def current_backward() -> int:
    """The id of the running backward (autograd's graph task), or -1 outside a backward."""
    return torch._C._current_graph_task_id()


class HeldGradients:
    """The managed tensors whose gradients wait for the end of the running backward.

    Attributes:
        without_graph: tensors used by a forward without a graph since their last update.
        held: tensor -> whether the part the MLP's backward gave was counted as a micro-batch (it added to
            the accumulation buffer) while its gradients reaching ``.grad`` wait.
        arrived_in: tensor -> the backward (graph task id) in which such a gradient reached ``.grad``.
    """

    def __init__(self) -> None:
        self.without_graph: dict = {}
        self.held: dict = {}
        self.arrived_in: dict = {}

    def forward_without_graph(self, p: torch.Tensor) -> None:
        self.without_graph[p] = True

    def forward_with_graph(self, p: torch.Tensor) -> None:
        """A forward of ``p`` recorded a graph (or ``p`` was updated): its gradient comes as usual."""
        self.without_graph.pop(p, None)

    def is_held(self, p: torch.Tensor) -> bool:
        return p in self.held

    def hold(self, p: torch.Tensor, release: Callable[[], None]) -> None:
        """From now on gradients of ``p`` that reach ``.grad`` wait; ``release`` runs when the running
        backward ends (autograd's queued callback)."""
        if p not in self.held:
            self.held[p] = False
            torch.autograd.Variable._execution_engine.queue_callback(release)

    def mark_counted(self, p: torch.Tensor) -> None:
        """The MLP's backward counted its micro-batch of ``p`` (it added to the buffer)."""
        if p in self.held:
            self.held[p] = True

    def waits(self, p: torch.Tensor) -> bool:
        """Whether a gradient of ``p`` that just reached ``.grad`` waits for the end of the running backward:
        ``p`` was used by a forward without a graph and a backward runs (the checkpointed region's backward,
        nested in this one, may add the MLP's part). Records the backward it arrived in."""
        if p in self.without_graph and current_backward() != -1:
            self.arrived_in[p] = current_backward()
            return True
        return False

    def arrived_in_this_backward(self, p: torch.Tensor) -> bool:
        """Whether a gradient of ``p`` reached ``.grad`` earlier in the running backward and waits."""
        return self.arrived_in.get(p) == current_backward()

    def release(self, p: torch.Tensor) -> bool:
        """``p`` no longer waits; returns whether its micro-batch was counted (:meth:`mark_counted`)."""
        self.arrived_in.pop(p, None)
        return self.held.pop(p, False)
