"""Loss scaling (``torch.amp.GradScaler``) is refused before the first in-backward update it would spoil.

The in-backward update runs inside the backward, before a scaler could unscale the gradient, check it for
overflow or skip the step: with a scaled loss the experts would take a step from a gradient multiplied by
the scale (65536 by default). So the backward of a scaled loss raises before any expert tensor changes.

How it is seen: :func:`install` (called by the in-backward optimizers) wraps ``GradScaler.scale`` once, so
that each output it scales (when the scaler is enabled) carries a pre-hook on its autograd node; a
backward that starts from such an output runs that hook first, which marks that backward (its autograd
graph task) as scaled until it ends. The optimizer's checks at the start of each update read the mark.
"""

from __future__ import annotations

import functools
import threading

import torch

# The autograd graph tasks (backward calls) that started from a scaled output; an entry is removed when its
# backward ends (one whose backward raised stays, but task ids are not reused).
_scaled_tasks: set[int] = set()
_lock = threading.Lock()


def in_scaled_backward() -> bool:
    """Whether the running backward started from an output of an enabled GradScaler."""
    return torch._C._current_graph_task_id() in _scaled_tasks


def _mark(grad_outputs):
    task = torch._C._current_graph_task_id()
    with _lock:
        _scaled_tasks.add(task)

    def clear():
        with _lock:
            _scaled_tasks.discard(task)

    torch.autograd.Variable._execution_engine.queue_callback(clear)


def _watch(outputs) -> None:
    if isinstance(outputs, torch.Tensor):
        if outputs.grad_fn is not None:
            outputs.grad_fn.register_prehook(_mark)
    elif isinstance(outputs, (list, tuple)):
        for output in outputs:
            _watch(output)


def install() -> None:
    """Wrap ``torch.amp.GradScaler.scale`` (idempotent; ``torch.cuda.amp.GradScaler`` inherits it)."""
    cls = torch.amp.GradScaler
    if getattr(cls.scale, "_sonar_watch", False):
        return
    original = cls.scale

    @functools.wraps(original)
    def scale(self, outputs):
        scaled = original(self, outputs)
        if getattr(self, "_enabled", False):
            _watch(scaled)
        return scaled

    scale._sonar_watch = True
    cls.scale = scale


def refuse(owner: str) -> None:
    """Raise RuntimeError when the running backward is of a scaled loss (before any update)."""
    if in_scaled_backward():
        raise RuntimeError(
            f"{owner}: this backward starts from a loss scaled by torch.amp.GradScaler, and the expert tensors "
            "are updated inside the backward, before a scaler could unscale, check or skip anything: their "
            "step would come from the scaled gradient. Nothing was updated. Train in bf16 or fp32 without a "
            "GradScaler (or GradScaler(enabled=False))."
        )
