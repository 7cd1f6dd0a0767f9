"""The element-wise rules run as one compiled kernel on the CPU: torch's own compiler (``torch.compile``,
inductor's vectorized C++), with the floating-point flags that keep every rounding where the rule puts it.

A rule written in torch ops is a dozen passes over memory when run op by op (each fp64 temporary, each
gather, each comparison one pass); compiled, one or two. The compiled kernel computes the same IEEE
operations in the same order, so it gives the same bits as the ops run one by one (tests/test_rules.py
checks every state kind both ways). Compiled only on the CPU: elsewhere the ops run as they are (on a GPU
the Triton backend is the fast path, and inductor's Triton code would divide with an approximate
reciprocal).

The first call of each kind of call (state kind, dtypes, number of dimensions) compiles: seconds, once per
process, then served from inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``) in later processes;
:func:`first_call_seconds` reports the time those first calls took. ``SONAR_KERNELS_COMPILE=0`` in the
environment runs the ops as they are, as do a call traced by a compiler (it becomes part of that graph) and
one under a dispatch mode (torch's MemTracker, FakeTensorMode: they must see each op); a compiler that fails
(no C++ compiler on the machine) does the same, after one warning that says so.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable

import torch

__all__ = ["CompiledRule", "compile_enabled", "first_call_seconds"]

# Tensors smaller than this run op by op: a compiled call's fixed cost (guards, the wrapper: tens of
# microseconds) outweighs its gain there, and a test's tiny shapes would each pay a compilation.
COMPILE_MIN_ELEMENTS = 1 << 15
# inductor's settings that bear on the bits: every cast to bf16 or fp16 rounds (by default inductor keeps
# such a value in fp32 when it is read back as fp32), no contraction of a * b + c into an fma, no unsafe
# math.
_INDUCTOR_OPTIONS = {
    "emulate_precision_casts": True,
    "cpp.enable_floating_point_contract_flag": "off",
    "cpp.enable_unsafe_math_opt_flag": False,
}
# A rule is called with a few dtypes and state kinds; each is one compiled graph (dynamo's default limit is
# 8 per function).
_RECOMPILE_LIMIT = 64
_lock = threading.Lock()
_first_calls: dict[tuple, float] = {}


def compile_enabled() -> bool:
    """Whether the rules may be compiled: ``SONAR_KERNELS_COMPILE`` is not "0"."""
    return os.environ.get("SONAR_KERNELS_COMPILE", "1") != "0"


def first_call_seconds() -> float:
    """Seconds spent, in this process, in the first call of each kind of compiled rule call (the compilation
    and one run; inductor's cache makes it shorter in later processes)."""
    with _lock:
        return sum(_first_calls.values())


def _traced_or_observed() -> bool:
    """Whether the rule runs under a compiler's trace (it is traced into that graph as ops) or a dispatch
    mode (torch's MemTracker, FakeTensorMode: they must see every op, which compiled code does not
    dispatch)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


class CompiledRule:
    """``fn`` (an element-wise rule in torch ops that writes its results in place) run compiled on the CPU
    for tensors of at least :data:`COMPILE_MIN_ELEMENTS` elements (:meth:`wanted`), op by op otherwise
    (module docstring).

    ``key(*args)`` names the kind of a call (what a compiled graph specializes on) for the first-call
    accounting. A compilation that fails (inductor compiles before anything runs: the call changed
    nothing) is run op by op; when that succeeds, the compiler was at fault: one warning, and the rule stays
    op by op for the process. When it fails too, its error is raised."""

    def __init__(self, fn: Callable, key: Callable[..., tuple]):
        self.fn = fn
        self.key = key
        self._compiled = None
        self._failed = False
        self._seen: set[tuple] = set()  # the kinds of call already compiled

    def wanted(self, size: int, device: torch.device) -> bool:
        """Whether a call on a tensor of ``size`` elements on ``device`` (a whole tensor, or the chunk a
        driver cuts into slices) should run compiled."""
        return (
            not self._failed
            and device.type == "cpu"
            and size >= COMPILE_MIN_ELEMENTS
            and compile_enabled()
            and not _traced_or_observed()
        )

    def __call__(self, compiled: bool, *args, **kwargs):
        """``fn(*args, **kwargs)``, compiled when ``compiled`` (:meth:`wanted`) and the compiler works."""
        if not compiled or self._failed:
            return self.fn(*args, **kwargs)
        key = (self.fn.__name__, *self.key(*args, **kwargs))
        first = key not in self._seen
        start = time.perf_counter()
        try:
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
                result = self._compiled_fn()(*args, **kwargs)
        except Exception as error:
            if not first:
                raise
            result = self.fn(*args, **kwargs)  # raises itself when the call, not the compiler, is at fault
            self._failed = True
            message = str(error).splitlines()[0] if str(error) else ""
            warnings.warn(
                f"sonar_kernels: torch.compile of the update rule {self.fn.__name__} failed "
                f"({type(error).__name__}: {message}); it runs op by op, several times slower "
                '(docs/design.md, "The update rules")',
                RuntimeWarning,
                stacklevel=3,
            )
            return result
        if first:
            self._seen.add(key)
            with _lock:
                _first_calls[key] = _first_calls.get(key, 0.0) + time.perf_counter() - start
        return result

    def _compiled_fn(self):
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=True, fullgraph=True, options=_INDUCTOR_OPTIONS)
        return self._compiled
