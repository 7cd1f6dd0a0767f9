"""Tile configurations of the grouped-GEMM kernels per (dtype, GPU architecture), and their choice at launch.

Each kernel family has a short candidate list per (dtype class, architecture): fp32 keeps its one no-spill
configuration (the fp32 FMA path, docs/design.md), 16-bit dtypes get larger tiles on sm_90 (wgmma) and
sm_80 (mma.sync). Every candidate compiles without spills at aligned shapes for its architecture
(``make kernel-report``, which builds them all) and passes the float64-reference tests under the
interpreter (``tests/test_configs.py``). The first candidate of each list is the default.

The choice for a launch (:func:`choose`) is keyed by the family, (E, H, I), the dtypes, the layout and the
device, never by the token count, so a training run tunes once per layer shape:

- pinned: the default, or the configuration given to :func:`pin` (or ``SONAR_KERNELS_TUNING=0`` in the
  environment: every family at its default; for reproducible benchmarks);
- tuned (CUDA, the default there): the first launch of a key times every candidate and keeps the fastest
  (one host sync per key, then none). A candidate that fails to launch (resources) is skipped.
  The forward, dHpre and dX kernels have no side effects beyond their outputs, which the winner's launch
  writes last. Every candidate is timed as it ships: the plain wgrad's store into a scratch gradient; a
  wgrad with its AdamW update (``ops/triton_backend/wgrad_update.py``) as an :class:`UpdateChoice`, the fused path and the
  split path at every candidate tile, each applied to scratch copies of the first chunk's experts (the
  weight and its state), never to the real ones; the winner then runs the update once. :func:`timings`
  keeps what was measured.

Under the Triton interpreter nothing is tuned unless :func:`tuning` says so (tests), and the default is used.
Tile offsets of the routing metadata are computed for the BLOCK_M a launch uses
(:func:`sonar_kernels.ops.common.tile_offsets_for`), so candidates may differ in BLOCK_M.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from sonar_kernels.kernels.expert_mlp_bwd import DHPRE_CONFIG
from sonar_kernels.kernels.expert_mlp_fwd import FWD_GEMM_CONFIG
from sonar_kernels.kernels.expert_wgrad import WGRAD_8BIT_CONFIG, WGRAD_CONFIG


class Config(NamedTuple):
    """One tile configuration: the BLOCK_* constexprs and the launch options."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    # wgrad: the AdamW epilogue's column slices; dhpre: the rebuilt epilogue's (1: today's, the whole tile)
    EPILOGUE_SPLIT: int = 1
    # wgrad only: each epilogue slice's state loaded before the previous slice's stores; with 8-bit moments
    # also the closed-form quantizer, in the fused epilogue and in the split path's standalone update
    EPILOGUE_PREFETCH: bool = False
    # grouped_mm: both operands through TMA descriptors, up: W1 (kernels/expert_mlp_tma.py; offered where the
    # layout allows it, ops/triton_backend/tma.py); grouped_mm's PERSISTENT: a grid of a few programs per SM walking the tiles
    TMA: bool = False
    PERSISTENT: bool = False

    def blocks(self) -> dict:
        """The BLOCK_* constexprs as kernel keywords."""
        return {"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N, "BLOCK_K": self.BLOCK_K}

    def epilogue(self) -> dict:
        """The wgrad's epilogue constexprs (column slices, prefetch) as kernel keywords."""
        return {"EPILOGUE_SPLIT": self.EPILOGUE_SPLIT, "EPILOGUE_PREFETCH": self.EPILOGUE_PREFETCH}

    def launch(self) -> dict:
        """The launch options (warps, pipeline stages) as kernel keywords."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


class UpdateChoice(NamedTuple):
    """How a wgrad with an AdamW update runs (ops/triton_backend/wgrad.py): ``path`` "fused" (AdamW in the wgrad's epilogue,
    no gradient tensor) or "split" (the wgrad into a bounded scratch, a chunk of experts at a time, then the
    standalone AdamW kernel: the same bits at the same tile), and the wgrad's tile ``config``."""

    path: str
    config: Config


def _config(d: dict) -> Config:
    return Config(
        d["BLOCK_M"],
        d["BLOCK_N"],
        d["BLOCK_K"],
        d["num_warps"],
        d["num_stages"],
        d.get("EPILOGUE_SPLIT", 1),
        d.get("EPILOGUE_PREFETCH", False),
        d.get("TMA", False),
        d.get("PERSISTENT", False),
    )


# The kernel families: the up-projection + GLU ("up"), the grouped GEMM of the down projection and of dX
# ("grouped_mm"), dHpre ("dhpre"), the wgrad with its AdamW epilogue ("wgrad").
FAMILIES = ("up", "grouped_mm", "dhpre", "wgrad")
# The wgrad launch of a fused update with 8-bit moments: one configuration, not tuned (kernels/expert_wgrad.py).
WGRAD_8BIT = _config(WGRAD_8BIT_CONFIG)
_DEFAULTS = {
    "up": _config(FWD_GEMM_CONFIG),
    "grouped_mm": _config(FWD_GEMM_CONFIG),
    "dhpre": _config(DHPRE_CONFIG),
    "wgrad": _config(WGRAD_CONFIG),
}
# The grouped GEMM with both operands through TMA descriptors (kernels/expert_mlp_tma.py), offered on sm_90
# and later where the layout allows it (ops/triton_backend/tma.py): the default's tile (the same bits as the pointer
# kernel under the interpreter; 42 registers, 24 KB, 5 CTAs per SM on sm_90a), 128x128 and 128x64 tiles
# (90 and 58 registers, 96 KB: 2 CTAs per SM), and 128x128 on a persistent grid of 2 programs per SM
# (make kernel-report). A 4th stage of 128x128 (128 KB) would leave 1 CTA per SM.
TMA_CANDIDATES = (
    Config(64, 64, 32, 8, 3, TMA=True),
    Config(128, 128, 64, 8, 3, TMA=True),
    Config(128, 64, 64, 8, 4, TMA=True),
    Config(128, 128, 64, 8, 3, TMA=True, PERSISTENT=True),
)
# The up-projection with W1 through a TMA descriptor (kernels/expert_mlp_tma.py; the gathered X by
# pointers), offered where W1's unit stride is along H (ops/triton_backend/tma.py): the default's tile (the same bits as
# the pointer kernel under the interpreter; 64 registers, 36 KB, 4 CTAs per SM on sm_90a) and 128x64x32 at 4
# stages (100 registers, 64 KB, 2 CTAs per SM; make kernel-report).
UP_TMA_CANDIDATES = (Config(64, 64, 32, 8, 3, TMA=True), Config(128, 64, 32, 8, 4, TMA=True))
# Candidates per family and (dtype class, architecture major), the default first. Chosen by
# `make kernel-report` (no spills at aligned shapes for every 16-bit dtype pair, fp32 master weights
# included, shared memory within the architecture's 227 KB (sm_90) and 163 KB (sm_80), wgmma on sm_90a;
# 128x256 output tiles spill with fp32 weights, and 128x128 dHpre tiles by kilobytes); their speed is
# measured by the tuner on the GPU.
CANDIDATES: dict[str, dict[tuple[str, int | None], tuple[Config, ...]]] = {
    "up": {
        ("fp32", None): (_DEFAULTS["up"],),
        # 128-row tiles of the gathered X at 2 CTAs per SM with deeper pipelines: 106 registers, 64 and 80
        # KB, wait_group 4 and 6 in the loop (make kernel-report).
        ("16bit", 9): (
            _DEFAULTS["up"],
            Config(128, 64, 64, 8, 3),
            Config(64, 128, 64, 8, 3),
            Config(128, 64, 32, 8, 4),
            Config(128, 64, 32, 8, 5),
            *UP_TMA_CANDIDATES,
        ),
        ("16bit", 8): (_DEFAULTS["up"], Config(128, 64, 32, 8, 4), Config(64, 64, 64, 8, 4)),
    },
    "grouped_mm": {
        ("fp32", None): (_DEFAULTS["grouped_mm"],),
        # 128-row tiles at 2 CTAs per SM for the down projection and dX (64 to 113 registers, 60 to 96 KB),
        # 4 and 5 stages: wait_group 4 and 6 in the loop (make kernel-report).
        ("16bit", 9): (
            _DEFAULTS["grouped_mm"],
            Config(128, 128, 64, 8, 3),
            Config(64, 128, 64, 8, 4),
            Config(128, 64, 64, 8, 4),
            Config(128, 64, 32, 8, 5),
            *TMA_CANDIDATES,
        ),
        ("16bit", 8): (_DEFAULTS["grouped_mm"], Config(128, 128, 32, 8, 4), Config(64, 128, 64, 8, 4)),
    },
    "dhpre": {
        ("fp32", None): (_DEFAULTS["dhpre"],),
        # The epilogue in column slices (EPILOGUE_SPLIT 2 or 4; kernels/expert_mlp_bwd.py): at most 122
        # registers, 2 or 3 CTAs per SM where the whole-tile epilogue has 146 to 252 and 1; 56 to 61 epilogue
        # instructions per element instead of 85 to 95 (make kernel-report); 4 stages: wait_group 4.
        ("16bit", 9): (
            _DEFAULTS["dhpre"],
            Config(128, 64, 64, 8, 3),
            Config(64, 128, 64, 8, 3),
            Config(64, 64, 32, 8, 3, 2),
            Config(64, 128, 64, 8, 3, 4),
            Config(128, 64, 64, 8, 4, 4),
        ),
        ("16bit", 8): (_DEFAULTS["dhpre"], Config(64, 64, 64, 8, 4)),
    },
    "wgrad": {
        ("fp32", None): (_DEFAULTS["wgrad"],),
        # s5: 3 operand buffers and a main loop that waits on the copies of 3 iterations back
        # (`cp.async.wait_group 3`), where s3 and s4 give 2 and wait on every copy (the gathered rows'
        # index costs a stage); BLOCK_K 64 halves the iterations per tile; the prefetched epilogue issues
        # each slice's loads before the previous slice's stores (make kernel-report).
        ("16bit", 9): (
            _DEFAULTS["wgrad"],
            Config(128, 128, 64, 8, 3, 4),
            Config(128, 64, 64, 8, 4, 4),
            Config(128, 64, 32, 8, 5, 4),
            Config(128, 64, 64, 8, 5, 4),
            Config(128, 128, 64, 8, 5, 4),
            Config(128, 64, 32, 8, 5, 4, True),
            Config(128, 64, 64, 8, 5, 4, True),
        ),
        ("16bit", 8): (_DEFAULTS["wgrad"], Config(128, 128, 32, 8, 4, 4), Config(64, 128, 32, 8, 3, 4)),
    },
}

# The fused update's tiles with 8-bit moments or bf16 master weights (own_candidates), the default first:
# 64x64x32, and on sm_90 the same with the rebuilt epilogue (the next slice's state loaded ahead; for 8-bit
# moments the closed-form quantizer: make kernel-report, 340 instead of 411 epilogue instructions per
# element). Their split path's wgrad is the plain store, at every wgrad candidate (ops/triton_backend/wgrad_update.py).
OWN_CANDIDATES: dict[int, tuple[Config, ...]] = {
    9: (WGRAD_8BIT, WGRAD_8BIT._replace(EPILOGUE_PREFETCH=True)),
    8: (WGRAD_8BIT,),
}

_pinned: dict[str, Config] = {}
_chosen: dict[tuple, Config] = {}
# The tuner's median seconds per option, by key (for results files: :func:`timings`).
_timings: dict[tuple, dict] = {}
_tuning_override: list[bool] = []


def _dtype_class(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "16bit"


def _arch(device: torch.device) -> int | None:
    if device.type != "cuda":
        return 9  # the interpreter (tests): the sm_90 list, the richest
    return torch.cuda.get_device_capability(device)[0]


def candidates(
    family: str, dtype: torch.dtype, device: torch.device, tma: bool = False
) -> tuple[Config, ...]:
    """The candidate configurations of ``family`` for GEMM operands of ``dtype`` on ``device`` (CPU: the
    interpreter, which takes the sm_90 list); an architecture without a list of its own takes sm_80's
    (sm_90's for 10 and later). The TMA candidates only with ``tma`` (the launch's operands have TMA
    descriptors: :func:`sonar_kernels.ops.triton_backend.tma.grouped_mm_descriptors`, which also checks the device).

    Raises:
        ValueError: an unknown family.
    """
    if family not in CANDIDATES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    lists = CANDIDATES[family]
    kind = _dtype_class(dtype)
    if kind == "fp32":
        return lists[("fp32", None)]
    arch = _arch(device)
    listed = lists[("16bit", 9 if arch is not None and arch >= 9 else 8)]
    return listed if tma else _without_tma(listed)


@functools.cache
def _without_tma(listed: tuple[Config, ...]) -> tuple[Config, ...]:
    """``listed`` less its TMA candidates (cached: :func:`candidates` runs at every launch)."""
    return tuple(c for c in listed if not c.TMA)


def own_candidates(dtype: torch.dtype, device: torch.device) -> tuple[Config, ...]:
    """The tiles of the fused update's wgrad with 8-bit moments or bf16 master weights (whose epilogues spill
    at the exact update's tiles, make kernel-report), :data:`WGRAD_8BIT` first; sm_90 and the interpreter
    add the candidates of :data:`OWN_CANDIDATES`."""
    if _dtype_class(dtype) == "fp32":
        return (WGRAD_8BIT,)
    arch = _arch(device)
    return OWN_CANDIDATES[9 if arch is not None and arch >= 9 else 8]


def tuning_enabled(device: torch.device) -> bool:
    """Whether :func:`choose` times the candidates on ``device``: on CUDA unless ``SONAR_KERNELS_TUNING=0``;
    elsewhere (the interpreter) only inside :func:`tuning`."""
    if _tuning_override:
        return _tuning_override[-1]
    return device.type == "cuda" and os.environ.get("SONAR_KERNELS_TUNING", "1") != "0"


@contextlib.contextmanager
def tuning(enabled: bool = True):
    """Turn tuning on (or off) on every device inside the block (tests run the tuner under the interpreter,
    where its timings mean nothing but its choice must not change any result)."""
    _tuning_override.append(enabled)
    try:
        yield
    finally:
        _tuning_override.pop()


def pin(family: str | None = None, config: Config | None = None) -> None:
    """Pin ``family`` to ``config`` for every later launch (no tuning), or, with ``config`` None, unpin it;
    ``pin()`` unpins every family and forgets every tuned choice.

    Raises:
        ValueError: an unknown family, or a config that is not a :class:`Config`.
    """
    if family is None:
        _pinned.clear()
        _chosen.clear()
        _timings.clear()
        return
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if config is None:
        _pinned.pop(family, None)
        return
    if not isinstance(config, Config):
        raise ValueError(
            f"config must be a sonar_kernels.ops.triton_backend.configs.Config, got {type(config).__name__}"
        )
    _pinned[family] = config


def chosen() -> dict[str, Config | UpdateChoice]:
    """The configuration tuned for each key so far, as {"family E=.. H=.. I=.. ...": Config, or an
    :class:`UpdateChoice` for a wgrad with its update} (for results files)."""
    return {" ".join(str(part) for part in key): config for key, config in _chosen.items()}


def timings() -> dict[str, list[tuple[object, float]]]:
    """What the tuner measured for each key so far (the keys of :func:`chosen`): [(option, median seconds),
    ...] in the candidates' order; inf for an option that could not launch (resources)."""
    return {" ".join(str(part) for part in key): list(times.items()) for key, times in _timings.items()}


def choose(
    family: str,
    key: tuple,
    dtype: torch.dtype,
    device: torch.device,
    run: Callable[[Config], None] | None = None,
    options: tuple | Callable[[], tuple] | None = None,
):
    """The configuration of one launch of ``family``.

    Args:
        key: what the choice depends on besides family, dtype and device: (E, H, I, ...) and the layout;
            never the token count.
        run: launches the kernel (or its side-effect-free variant) with a given option; called once per
            option, timed, when tuning is enabled and ``key`` was not tuned yet.
        options: what to choose from, the default first; None: :func:`candidates` of the family (a
            wgrad with its update passes its :class:`UpdateChoice` options); or a callable giving them,
            called only when the key is tuned (the grouped GEMM's TMA candidates, whose check of the
            operands' layout costs host time), whose first option is :func:`candidates`' first.
    Returns:
        The pinned configuration (a :class:`Config`, whatever ``options`` hold), the option tuned for the
        key, or the default (the first option).
    """
    if family in _pinned:
        return _pinned[family]
    full_key = (family, *key, str(dtype).removeprefix("torch."), device.type, device.index)
    if full_key in _chosen:  # tuned: the options are not needed
        return _chosen[full_key]
    if run is None or not tuning_enabled(device):
        # The default: the first option (of the candidates where ``options`` is a callable or None).
        return candidates(family, dtype, device)[0] if options is None or callable(options) else options[0]
    options = (
        candidates(family, dtype, device) if options is None else options() if callable(options) else options
    )
    if len(options) == 1:
        return options[0]
    best, best_time = options[0], float("inf")
    measured = {}
    for config in options:
        try:
            elapsed = _time(run, config, device)
        except Exception as error:
            if _out_of_resources(error):
                measured[config] = float("inf")
                continue
            raise
        measured[config] = elapsed
        if elapsed < best_time:
            best, best_time = config, elapsed
    _chosen[full_key] = best
    _timings[full_key] = measured
    return best


def _out_of_resources(error: Exception) -> bool:
    name = type(error).__name__
    return name in ("OutOfResources", "OutOfMemoryError") or "out of resource" in str(error).lower()


def _time(run: Callable, config, device: torch.device) -> float:
    """Median seconds of ``run(config)`` over 5 runs after one warm-up run (which also compiles it); one
    run off CUDA, without a warm-up (the interpreter compiles nothing, and its times mean nothing)."""
    if device.type == "cuda":
        run(config)
    repeats = 5 if device.type == "cuda" else 1
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(config)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            run(config)
            times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2]
