"""The CPU's update in one pass over memory for 8-bit moments (any master kind) and for exact moments with
stochastic rounding: ``cpu_update.c`` (the rule of ``rules/update.py`` written in C operation for
operation), compiled once per process with the machine's C compiler and called through ctypes on a whole
chunk, split among torch's threads (docs/design.md, "The update rules").

The compiled rule (``rules/compiled.py``: inductor's C++) ran the 8-bit update in about 9 ns an element on
2 threads: table lookups as scalar loops, the new moments written out between its passes, and slices of
256 K elements each paying a compiled call's fixed cost. Where this does not apply (expert clipping, a
gradient, weight or moment dtype other than fp32 and bf16, a tensor that is not a contiguous plain CPU
tensor) or cannot be built (no C compiler: a fresh machine with only Python), the caller runs the compiled
rule; a build that fails warns once. ``SONAR_KERNELS_COMPILE=0`` turns it off with the compiled rule.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from sonar_kernels.rules.moments_8bit import BLOCK

__all__ = ["adamw_8bit_cpu_", "adamw_stochastic_cpu_", "available"]

SOURCE = Path(__file__).with_name("cpu_update.c")
# No contraction of a * b + c into an fma and no unsafe math (gcc's defaults but the first): every rounding
# where the rule puts it. -fno-math-errno lets sqrtf be the instruction, -fno-trapping-math lets a division
# whose result a select may drop run in every lane (the loops vectorize); neither changes a result (no
# exception is unmasked). -march=native: built where it runs, once per process.
FLAGS = (
    "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared",
)  # fmt: skip
# Blocks per thread below which one thread runs the whole call (a thread's start costs tens of microseconds).
MIN_BLOCKS_PER_THREAD = 4096
_WEIGHT_KINDS = {"fp32": 0, "bf16": 1, "remainder": 2, "stochastic": 3}

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failed = False
_pool: ThreadPoolExecutor | None = None


def _build() -> ctypes.CDLL:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler (cc, or $CC) on PATH")
    folder = tempfile.mkdtemp(prefix="sonar_kernels_cpu_update_")
    atexit.register(shutil.rmtree, folder, True)  # the loaded library stays mapped; the folder goes at exit
    target = os.path.join(folder, "cpu_update.so")
    done = subprocess.run([compiler, *FLAGS, "-o", target, str(SOURCE)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{compiler} failed: {done.stderr.strip().splitlines()[-1:]}")
    library = ctypes.CDLL(target)
    fn = library.sonar_adamw_8bit
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [i64, i64, ptr, i32, ptr, i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr]
    fn.restype = None
    fn = library.sonar_adamw_stochastic
    fn.argtypes = [i64, i64, ptr, ptr, i32, ptr, i32, ptr, i32, ptr, ptr, i64, ptr, ptr]
    fn.restype = None
    return library


def available() -> bool:
    """Whether the C update runs in this process: enabled (``SONAR_KERNELS_COMPILE`` is not "0") and built;
    the first call builds it (about 2 s of CPU time), and a build that fails warns once and answers False
    from then on."""
    global _library, _failed
    if _failed or os.environ.get("SONAR_KERNELS_COMPILE", "1") == "0":
        return False
    with _lock:
        if _library is None and not _failed:
            try:
                _library = _build()
            except Exception as error:  # no compiler, a compiler error, a library that does not load
                _failed = True
                warnings.warn(
                    f"sonar_kernels: the C update could not be built ({type(error).__name__}: "
                    f"{error}); the CPU runs the compiled rule instead, several times slower "
                    '(docs/design.md, "The update rules")',
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _library is not None


def _weight_kind(weight, remainder, seed) -> int | None:
    if weight.dtype == torch.float32:
        return None if remainder is not None or seed is not None else _WEIGHT_KINDS["fp32"]
    if weight.dtype != torch.bfloat16 or (remainder is not None and seed is not None):
        return None
    return _WEIGHT_KINDS[
        "remainder" if remainder is not None else "stochastic" if seed is not None else "bf16"
    ]


def adamw_8bit_cpu_(
    weight: torch.Tensor,
    grad: torch.Tensor,
    moments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scalars: torch.Tensor,
    hyper: torch.Tensor,
    *,
    remainder: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
    first_index: int = 0,
) -> bool:
    """``rules.update.adamw_update_`` with 8-bit moments, no skip and no expert clipping, in place, bit for
    bit, when it applies: returns False, having changed nothing, where it does not (the caller runs the
    rule).

    Args:
        weight: [..., C] fp32, or bf16 (with ``remainder``, ``seed`` or neither), C a multiple of 32;
            contiguous CPU tensors here and below.
        grad: ``weight``'s shape, fp32 or bf16 (the gradient as the update uses it).
        moments: exp_avg's int8 codes, its fp32 scales, exp_avg_sq's uint8 codes, its scales (codes
            ``weight``'s shape, scales one per block of 32).
        scalars: [2] fp32, ``rules.adamw.adamw_scalars`` at the update's step.
        hyper: [5] fp64 (lr, beta1, beta2, eps, weight_decay); [7] (expert clipping) is not taken here.
        remainder: int16, ``weight``'s shape: the fp32 master is (weight, remainder).
        seed, step, first_index: stochastic rounding: the 0-dim int64 seed, the 0-dim fp32 step (already
            incremented), the stream counter of ``weight``'s first element.
    Returns:
        whether the update ran.
    """
    m_codes, m_scales, v_codes, v_scales = moments
    kind = _weight_kind(weight, remainder, seed)
    tensors = (weight, grad, *moments, scalars, hyper, *(t for t in (remainder, seed, step) if t is not None))
    if (
        kind is None
        or hyper.numel() != 5
        or (hyper.dtype, scalars.dtype) != (torch.float64, torch.float32)
        or tuple(t.dtype for t in moments) != (torch.int8, torch.float32, torch.uint8, torch.float32)
        or (remainder is not None and remainder.dtype != torch.int16)
        or (seed is not None and (seed.dtype != torch.int64 or step is None or step.dtype != torch.float32))
        or grad.dtype not in (torch.float32, torch.bfloat16)
        or weight.numel() % BLOCK
        or m_scales.numel() * BLOCK != weight.numel()
        # plain CPU tensors: no subclass (a fake tensor has no storage to hand to C, a DTensor's is a shard)
        or any(type(t) not in _PLAIN or t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
        or not available()
    ):
        return False
    blocks = weight.numel() // BLOCK
    fixed = (
        weight.data_ptr(), kind, grad.data_ptr(), int(grad.dtype == torch.bfloat16), m_codes.data_ptr(),
        m_scales.data_ptr(), v_codes.data_ptr(), v_scales.data_ptr(),
        None if remainder is None else remainder.data_ptr(), None if seed is None else seed.data_ptr(),
        None if step is None else step.data_ptr(), int(first_index), hyper.data_ptr(), scalars.data_ptr(),
    )  # fmt: skip
    _run(_library.sonar_adamw_8bit, blocks, blocks // MIN_BLOCKS_PER_THREAD, fixed)
    return True


def adamw_stochastic_cpu_(
    weight: torch.Tensor,
    grad: torch.Tensor,
    moments: tuple[torch.Tensor, torch.Tensor],
    scalars: torch.Tensor,
    hyper: torch.Tensor,
    *,
    seed: torch.Tensor,
    step: torch.Tensor,
    first_index: int = 0,
) -> bool:
    """``rules.update.adamw_update_`` with exact moments and stochastic rounding, no skip and no expert
    clipping, in place, bit for bit, when it applies: returns False, having changed nothing, where it does
    not (the caller runs the rule).

    Args:
        weight: bf16, any shape; contiguous CPU tensors here and below.
        grad: ``weight``'s shape, fp32 or bf16.
        moments: (exp_avg, exp_avg_sq), each fp32 or bf16, ``weight``'s shape.
        scalars, hyper, seed, step, first_index: as :func:`adamw_8bit_cpu_` takes them.
    Returns:
        whether the update ran.
    """
    exp_avg, exp_avg_sq = moments
    tensors = (weight, grad, exp_avg, exp_avg_sq, scalars, hyper, seed, step)
    floats = (torch.float32, torch.bfloat16)
    if (
        weight.dtype != torch.bfloat16
        or hyper.numel() != 5
        or (hyper.dtype, scalars.dtype, seed.dtype, step.dtype)
        != (torch.float64, torch.float32, torch.int64, torch.float32)
        or any(t.dtype not in floats for t in (grad, exp_avg, exp_avg_sq))
        or any(t.shape != weight.shape for t in (grad, exp_avg, exp_avg_sq))
        or any(type(t) not in _PLAIN or t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
        or not available()
    ):
        return False
    fixed = (
        weight.data_ptr(), grad.data_ptr(), int(grad.dtype == torch.bfloat16), exp_avg.data_ptr(),
        int(exp_avg.dtype == torch.bfloat16), exp_avg_sq.data_ptr(), int(exp_avg_sq.dtype == torch.bfloat16),
        seed.data_ptr(), step.data_ptr(), int(first_index), hyper.data_ptr(), scalars.data_ptr(),
    )  # fmt: skip
    count = weight.numel()
    _run(_library.sonar_adamw_stochastic, count, count // (MIN_BLOCKS_PER_THREAD * BLOCK), fixed)
    return True


def _run(fn, count: int, most_threads: int, fixed: tuple) -> None:
    """``fn(first, last, *fixed)`` over [0, count), split among at most torch's threads and ``most_threads``."""
    threads = max(1, min(torch.get_num_threads(), most_threads))
    if threads == 1:
        fn(0, count, *fixed)
        return
    bounds = [count * t // threads for t in range(threads + 1)]
    # ctypes releases the GIL during the call: the threads run the C code side by side.
    for future in [_executor().submit(fn, bounds[t], bounds[t + 1], *fixed) for t in range(threads)]:
        future.result()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool._max_workers < torch.get_num_threads():
            _pool = ThreadPoolExecutor(
                max_workers=torch.get_num_threads(), thread_name_prefix="sonar_cpu_update"
            )
        return _pool
