"""What the host does for one training step of a layer: its Triton launches, its torch ops and the Python
calls of the library, counted; and the time the host takes to issue the step against the device time of
its work (docs/benchmarks.md, "The host path of a layer step").

:func:`count` runs a callable once and counts:

- **launches**: every Triton kernel launch (``JITFunction.run`` on a GPU and in ``--dry-run``, where the
  dry run records it instead of running it; ``InterpretedFunction.run`` under the interpreter, whose own
  tensor copies inside a launch are not counted as torch ops), by kernel;
- **torch ops**: every ATen op that reaches the dispatcher's Python mode (a ``TorchDispatchMode`` on top of
  whatever mode runs: the dry run's fake tensors, or none), by op: after autograd and after the composite
  ops' decompositions, so each one is an operator call the host pays for (a view or a slice included), a
  CUDA kernel or not;
- **Python calls** of the library (``sonar_kernels``, its kernels' bodies left out: the interpreter runs
  them), by module: the validation, ownership, tuner and bookkeeping work around the launches.

The counting mode would by itself change the library's path (a dispatch mode sends the expert MLP through
its custom op instead of the eager autograd.Function, ``sonar_kernels/autograd/formula.py``,
``plain_eager``): the library is asked that question with the counting mode set aside.

:func:`issue_time` is the GPU measurement: the device is held busy (``torch.cuda._sleep``) while the host
issues the step, so the host's time is what issuing costs (a hidden host sync shows up as the whole
hold), and an event pair after the hold brackets the step's device work alone. With the CPU stand-ins of
the rehearsal and the dry run it runs the same code and its times mean nothing.
"""

from __future__ import annotations

import collections
import contextlib
import os
import statistics
import sys
import time
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from triton.runtime import interpreter, jit

PACKAGE = f"{os.sep}sonar_kernels{os.sep}"
KERNELS = f"{PACKAGE}kernels{os.sep}"


aten = torch.ops.aten
# A tensor's metadata read through the dispatcher (a fake tensor's size, stride or device is an op; a real
# tensor's is not): not counted, nor the "prim" namespace (prim.device, prim.layout).
METADATA = {
    aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.dim, aten.is_contiguous,
    aten.is_strides_like_format, aten.is_non_overlapping_and_dense,
}  # fmt: skip


class _Ops(TorchDispatchMode):
    """Counts the ATen ops that reach it, then runs each as the next mode (or no mode) would."""

    def __init__(self, counter: collections.Counter):
        super().__init__()
        self.counter = counter
        self.launching = 0  # > 0 inside a launch: the interpreter's own copies are not the library's ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.launching and func.namespace != "prim" and func.overloadpacket not in METADATA:
            self.counter[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _counted(run, counter: collections.Counter, mode: _Ops):
    def wrapper(kernel, *args, **kwargs):
        counter[getattr(getattr(kernel, "fn", None), "__name__", type(kernel).__name__)] += 1
        mode.launching += 1
        try:
            return run(kernel, *args, **kwargs)
        finally:
            mode.launching -= 1

    return wrapper


def _module_of(filename: str) -> str:
    """``sonar_kernels/ops/triton_backend/wgrad.py`` -> ``ops.triton_backend.wgrad``."""
    return filename.rsplit(PACKAGE, 1)[1].removesuffix(".py").replace(os.sep, ".")


def count(fn, python_calls: bool = True) -> dict:
    """Run ``fn()`` once and count its launches, torch ops and (``python_calls``) the library's Python
    calls (see the module docstring).

    Returns:
        {"launches", "torch_ops", "python_calls": totals; "launches_by_kernel", "torch_ops_by_name",
        "python_calls_by_module": the counts behind them, largest first}. ``python_calls`` is None when
        not counted.
    """
    from sonar_kernels.autograd import formula

    launches, ops, calls = collections.Counter(), collections.Counter(), collections.Counter()
    plain_eager = formula.plain_eager

    def plain_eager_without_counting(inputs) -> bool:
        with _pop_mode_temporarily():  # the counting mode, on top of the stack: the question is the library's
            return plain_eager(inputs)

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if PACKAGE in name and KERNELS not in name:
                calls[_module_of(name)] += 1

    mode = _Ops(ops)
    with contextlib.ExitStack() as stack:
        for cls in (jit.JITFunction, interpreter.InterpretedFunction):
            stack.enter_context(mock.patch.object(cls, "run", _counted(cls.run, launches, mode)))
        stack.enter_context(mock.patch.object(formula, "plain_eager", plain_eager_without_counting))
        stack.enter_context(mode)
        previous = sys.getprofile()
        if python_calls:
            sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(previous)
    return {
        "launches": sum(launches.values()),
        "torch_ops": sum(ops.values()),
        "python_calls": sum(calls.values()) if python_calls else None,
        "launches_by_kernel": dict(launches.most_common()),
        "torch_ops_by_name": dict(ops.most_common()),
        "python_calls_by_module": dict(calls.most_common()),
    }


class CpuEvent:
    """A stand-in for ``torch.cuda.Event(enable_timing=True)`` on the CPU: the host's clock at record()."""

    def __init__(self):
        self.at = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: CpuEvent) -> float:
        return 1000 * (end.at - self.at)


def issue_time(fn, reps: int, hold, event=CpuEvent, sync=lambda: None, hold_s: float | None = None) -> dict:
    """The host's time to issue ``fn()`` while the device is busy, against the device time of its work.

    Each of ``reps`` rounds: ``sync()``, ``hold()`` (on a GPU ``torch.cuda._sleep``: the stream busy for
    ``hold_s`` seconds), an event, ``fn()`` timed on the host's clock, an event, ``sync()``. The host's time
    is then the cost of issuing (the launches queue behind the hold; a host sync inside ``fn`` waits for
    the hold and shows up as about ``hold_s``), and the events bracket the device's work of the step alone
    as long as the issue took less than the hold (``covered``).

    Returns:
        {"issue_s", "device_s": the medians over the rounds; "issue_over_device"; "rounds"; "hold_s";
        "covered": every round issued within its hold (else the device time includes host gaps)}.
    """
    issues, devices = [], []
    for _ in range(reps):
        sync()
        hold()
        start, end = event(), event()
        start.record()
        begin = time.perf_counter()
        fn()
        issues.append(time.perf_counter() - begin)
        end.record()
        sync()
        devices.append(start.elapsed_time(end) / 1000)
    issue, device = statistics.median(issues), statistics.median(devices)
    return {
        "issue_s": issue,
        "device_s": device,
        "issue_over_device": issue / device if device > 0 else float("nan"),
        "rounds": reps,
        "hold_s": hold_s,
        "covered": hold_s is None or max(issues) < hold_s,
    }
