"""One expert tensor's AdamW update from its wgrad, on the Triton backend (docs/design.md, "Backward and the
fused update"): the decision to skip it, made on the device before anything changes; then one of two paths
that give the same bits at the same tile configuration:

- "fused": AdamW in the wgrad's epilogue, one launch, no gradient tensor;
- "split": the wgrad into a scratch buffer of a bounded number of experts (:func:`split_chunk`), then the
  standalone AdamW kernel on those experts, chunk after chunk.

Which one runs, and at which tile configuration, is ``AdamWUpdate.fused`` (True, False) or, when it is None,
the tuner's choice (``ops/triton_backend/configs.py``): on CUDA each option is timed as it ships, on scratch copies of the
first chunk's experts (the weight and its state), once per layer shape, dtype, state kind and clipping.
No host sync on the update's path (the tuning pass syncs once per key).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton

from sonar_kernels import specs
from sonar_kernels.kernels.adamw import ADAMW_CONFIG, ADAMW_MASTER_CONFIG, adamw_kernel
from sonar_kernels.ops import common
from sonar_kernels.ops.arithmetic import adamw_arithmetic
from sonar_kernels.ops.common import is_dense, like
from sonar_kernels.ops.triton_backend import configs, moments_8bit
from sonar_kernels.ops.triton_backend.update_steps import begin_update, end_update
from sonar_kernels.rules.adamw import adamw_scalars, grad_limit
from sonar_kernels.rules.moments_8bit import tables as moments_8bit_tables
from sonar_kernels.update_state import StateKind

# The split path's scratch (the gradient of a chunk of experts): at most 1/SPLIT_SCRATCH_FRACTION of the
# tensor's gradient bytes or SPLIT_SCRATCH_MIN_BYTES, whichever is larger, in whole experts (at least one).
# A tensor whose experts are not its outermost dimension in memory is updated in one chunk.
SPLIT_SCRATCH_FRACTION = 8
SPLIT_SCRATCH_MIN_BYTES = 64 << 20


@contextlib.contextmanager
def split_scratch(fraction: int = SPLIT_SCRATCH_FRACTION, min_bytes: int = SPLIT_SCRATCH_MIN_BYTES):
    """Inside the block the split path's scratch is at most 1/``fraction`` of a tensor's gradient bytes or
    ``min_bytes``, whichever is larger (``fraction=1``: the whole gradient, the Sonar-MoE paper's method:
    one expert tensor's gradient written, applied, released). Process-wide, like the module's defaults.

    Raises:
        ValueError: ``fraction`` not an int >= 1 or ``min_bytes`` not an int >= 0.
    """
    if not specs.is_integer(fraction) or fraction < 1:
        raise ValueError(f"fraction must be an int >= 1, got {fraction!r}")
    if not specs.is_integer(min_bytes) or min_bytes < 0:
        raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
    global SPLIT_SCRATCH_FRACTION, SPLIT_SCRATCH_MIN_BYTES
    saved = SPLIT_SCRATCH_FRACTION, SPLIT_SCRATCH_MIN_BYTES
    SPLIT_SCRATCH_FRACTION, SPLIT_SCRATCH_MIN_BYTES = int(fraction), int(min_bytes)
    try:
        yield
    finally:
        SPLIT_SCRATCH_FRACTION, SPLIT_SCRATCH_MIN_BYTES = saved


def split_chunk(weight: torch.Tensor, grad_dtype: torch.dtype) -> int:
    """Experts per chunk of the split path's scratch for ``weight`` [E, ...] with gradients of
    ``grad_dtype``: the most experts whose gradient fits the bound (:data:`SPLIT_SCRATCH_FRACTION`,
    :data:`SPLIT_SCRATCH_MIN_BYTES`), rounded down to a multiple of 4 when 4 or more fit, at least 1; E when
    they all fit or when the experts are not the tensor's outermost dimension (a chunk would not be a dense
    block of it)."""
    E = weight.shape[0]
    if E <= 1 or not is_dense(weight) or weight.stride(0) * E != weight.numel():
        return max(E, 1)
    itemsize = torch.empty((), dtype=grad_dtype).element_size()
    expert_bytes = weight[0].numel() * itemsize
    bound = max(E * expert_bytes // SPLIT_SCRATCH_FRACTION, SPLIT_SCRATCH_MIN_BYTES)
    chunk = bound // max(expert_bytes, 1)
    if chunk >= E:
        return E
    # A multiple of 4 experts where 4 fit: every chunk's slice of the int32 expert offsets (and of the
    # per-program sums) then starts 16-byte aligned, so all chunks launch one compiled kernel.
    return max(1, chunk - chunk % 4 if chunk >= 4 else chunk)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it when its first element is not 16 bytes into its allocation (whose start the
    CUDA allocator aligns; Triton compiles a pointer it knows aligned into another kernel)."""
    return t if t.storage_offset() * t.element_size() % 16 == 0 else t.clone()


class _State(NamedTuple):
    """The tensors one update reads and writes, each of the weight's experts (or a chunk of them)."""

    weight: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_scales: torch.Tensor | None
    exp_avg_sq_scales: torch.Tensor | None
    remainder: torch.Tensor | None
    grad_in: torch.Tensor | None

    def experts(self, e0: int, e1: int) -> _State:
        return _State(*(None if t is None else t[e0:e1] for t in self))

    def clone(self) -> _State:
        return _State(*(None if t is None else t.clone() for t in self))


def apply_update(launch, weight, update, bound, key) -> None:
    """Apply ``update`` (an :class:`sonar_kernels.ops.AdamWUpdate`) to ``weight`` from the wgrad that
    ``launch`` (:class:`sonar_kernels.ops.triton_backend.wgrad_launch.WgradLaunch`) computes: skip decided on the device
    (a gradient entry non-finite or beyond :func:`grad_limit`, see ``AdamWUpdate``), step advanced unless
    skipped, then the fused or the split path; telemetry (norm, skips, clipped entries) written. ``bound``: a callable of (grad_in, entry limit, operand limit) that returns the
    0-dim fp32 flag of ``ops/triton_backend/update_bound.py`` (1.0: the gradient may exceed the limits), the cheap test
    that spares the check pass; ``key``: the wgrad's tuning key (shape, dtypes, operands).

    Raises:
        ValueError: ``bound`` is None.
    """
    if bound is None:
        raise ValueError("an update needs the bound of its gradient")
    E, device = weight.shape[0], weight.device
    kind = update.kind
    eight_bit = kind.moments == "8bit"
    # 8-bit exp_avg_sq is fp32 levels times an fp32 scale: fp32's limit.
    limit = grad_limit(torch.float32 if eight_bit else update.exp_avg_sq.dtype)
    # 8-bit moments and stochastic rounding: the "fp64" arithmetic everywhere, the torch backend's too, and
    # the torch backend's scalars (job.scalars).
    torch_rules = eight_bit or kind.master == "stochastic"
    arithmetic = "fp64" if torch_rules else adamw_arithmetic(device)
    state = _State(
        weight, update.exp_avg, update.exp_avg_sq, update.exp_avg_scales, update.exp_avg_sq_scales,
        update.remainder, update.grad_in,
    )  # fmt: skip
    job = _Update(launch, update, kind, limit, arithmetic, split_chunk(weight, update.grad_dtype))
    choice = job.choose(state, key)
    cfg = choice.config
    # One fp32 per program: the check pass's flags, then the update's sums of squares (telemetry).
    partial = common.empty(launch.grid(cfg, E), torch.float32, device)
    # The check pass of the same kernel and tiles, on both paths: it recomputes each tile's gradient and
    # flags the tiles with an entry beyond the limit (or beyond what the gradient dtype holds: it would round
    # to inf), and returns at once unless the bound says the gradient may exceed it. One tile (or chunk)
    # cannot skip the update once others are stored.
    entry_limit = min(limit, torch.finfo(update.grad_dtype).max)
    maybe = bound(update.grad_in, entry_limit, torch.finfo(launch.dtype).max)
    job.check(cfg, launch.meta.expert_offsets, state, maybe, partial)
    # The skip (the largest flag), the step and the scalars in one launch (ops/triton_backend/update_steps.py). torch's
    # AdamW increments the step before it computes the bias corrections; a skipped update leaves it (as
    # torch's fused AdamW does with found_inf).
    skip, scalars = begin_update(
        partial, update.step, update.hyper, arithmetic, scalars=not torch_rules, interpret=launch.interpret
    )
    applied = False
    try:
        if torch_rules:
            scalars = job.scalars()
        # Stochastic rounding's key and counter base: the tensor's seed and the update's step, on the device.
        rng = None if update.seed is None else torch.stack([update.seed, update.step.to(torch.int64)])
        clipped = job.apply(choice, state, launch.meta.expert_offsets, scalars, skip, rng, 0, partial)
        applied = True
    finally:
        if not applied:
            # A launch that was refused (compile error, bad argument) applied nothing: take the step back
            # (the split path's later chunks launch the kernels its first chunk built, on memory allocated
            # before it).
            update.step.sub_(1.0 - skip)
    if update.grad_norm_sq is not None:
        torch.sum(partial, 0, out=update.grad_norm_sq)
    # The norm inf when skipped, the skip counted, the clipped entries (0 without clipping; a skipped update
    # clipped nothing: its programs returned before counting) in one launch, on the device.
    end_update(skip, update.grad_norm_sq, update.skipped, update.clipped, clipped)


# The paths an update may take, by ``AdamWUpdate.fused``.
_PATHS = {None: ("fused", "split"), True: ("fused",), False: ("split",)}


class _Update(NamedTuple):
    """One update's fixed parts: the wgrad launch, the ``AdamWUpdate`` and its kind, the gradient limit, the
    arithmetic and the split path's experts per chunk."""

    launch: object
    update: object
    kind: StateKind
    limit: float
    arithmetic: str
    chunk: int

    @property
    def has_norm(self) -> bool:
        return self.update.grad_norm_sq is not None

    @property
    def own_tiles(self) -> bool:
        # The fused update with 8-bit moments or bf16 master weights runs its GEMM on its own tiles
        # (configs.own_candidates: the exact update's tiles spill with them); their split path's wgrad is the
        # plain store, which takes every tile.
        return self.kind != StateKind()

    def options(self, device: torch.device) -> tuple[configs.UpdateChoice, ...]:
        """What the tuner chooses among, the untuned default first: the fused path at every tile its epilogue
        takes, then the split path at every tile of the plain wgrad (the prefetched epilogue changes the
        fused update only: on the split path its tiles are duplicates, except with 8-bit moments, where
        the split path's standalone update takes the closed-form quantizer with it). For 8-bit moments and
        bf16 master weights the split path's first tiles are the fused path's default, so that both paths
        untuned run the same tiles (and give the same bits)."""
        u = self.update
        regular = configs.candidates("wgrad", self.launch.dtype, device)
        fused = configs.own_candidates(self.launch.dtype, device) if self.own_tiles else regular
        split = tuple(c for c in regular if not c.EPILOGUE_PREFETCH)
        if self.own_tiles:
            split = (configs.WGRAD_8BIT, *(c for c in split if c != configs.WGRAD_8BIT))
        if self.kind.moments == "8bit":
            # The split path's rebuilt 8-bit update (the closed-form quantizer) at each tile, beside today's.
            split += tuple(c._replace(EPILOGUE_PREFETCH=True) for c in split)
        paths = _PATHS[u.fused]
        return tuple(
            configs.UpdateChoice(path, cfg) for path in paths for cfg in (fused if path == "fused" else split)
        )

    def choose(self, state: _State, key: tuple) -> configs.UpdateChoice:
        """The path and tiles: pinned by ``update.fused`` (the path) or ``configs.pin("wgrad", ...)`` (the
        tiles: for the fused update of 8-bit moments or bf16 master weights only where its epilogue takes
        them, else its default), else tuned on CUDA (each option timed on scratch copies of the first chunk's
        experts), else the first option (the fused path at the default tiles)."""
        u, launch = self.update, self.launch
        device = state.weight.device
        options = self.options(device)
        paths = _PATHS[u.fused]
        moments = "8bit" if self.kind.moments == "8bit" else str(u.exp_avg.dtype).removeprefix("torch.")
        master = self.kind.master
        # The paths allowed are part of the key: a choice among fused and split never serves an update pinned
        # to one path, nor the reverse.
        full_key = (
            *key,
            "update",
            moments,
            master,
            "clip" if u.clipping else "noclip",
            u.grad_in is not None,
        )
        full_key += ("/".join(paths),)
        scratch = []

        def trial(choice: configs.UpdateChoice) -> None:
            # The update as it ships, on copies of the first chunk's experts (made once, outside the timing;
            # each trial updates them again: values that stay finite, results that are dropped).
            n = min(self.chunk, state.weight.shape[0])
            if not scratch:
                scratch.append(state.experts(0, n).clone())
            copy = scratch[0]
            scalars = torch.ones(2, dtype=torch.float32, device=device)  # step_size, sqrt(bc2): any finite
            skip = torch.zeros((), dtype=torch.float32, device=device)
            rng = None if u.seed is None else torch.zeros(2, dtype=torch.int64, device=device)
            partial = common.empty(launch.grid(choice.config, n), torch.float32, device)
            offsets = launch.meta.expert_offsets[: n + 1]
            # The check pass runs first on both paths; with the flag off, as on ordinary gradients (its
            # programs return at once).
            self.check(choice.config, offsets, copy, skip, partial)
            self.apply(choice, copy, offsets, scalars, skip, rng, 0, partial)

        picked = configs.choose("wgrad", full_key, launch.dtype, device, trial, options)
        if isinstance(picked, configs.Config):  # the wgrad's tiles pinned: those tiles, the first path
            own = configs.own_candidates(launch.dtype, device)
            if paths[0] == "fused" and self.own_tiles and picked not in own:
                picked = own[0]
            picked = configs.UpdateChoice(paths[0], picked)
        return picked

    def check(self, cfg, offsets, state, flag, partial) -> None:
        """The check pass at tiles ``cfg`` over the experts ``offsets`` covers: unless ``flag`` is 0, each
        program recomputes its tile's gradient and writes 1.0 to ``partial`` when an entry is beyond the
        limit, else 0.0 (``flag`` 0: every program writes 0.0 and returns). The pass reads no state: the weight stands in for
        each state tensor, so that every state kind launches the same compiled kernel at a tile."""
        u, w = self.update, state.weight
        self.launch(
            "check", cfg, offsets, w, state.grad_in, flag, partial, w, w, w, u.step, u.hyper,
            self.limit, u.grad_dtype, self.arithmetic, False,
        )  # fmt: skip

    def scalars(self) -> torch.Tensor:
        """step_size and sqrt(bc2) of this step ([2] fp32, after the step's increment) for 8-bit moments and
        stochastic rounding: the torch ops that the torch backend's update reads too (the other updates' come
        from ``ops/triton_backend/update_steps.py``'s begin launch)."""
        return adamw_scalars(self.update.step, self.update.hyper)

    def apply(self, choice, state, offsets, scalars, skip, rng, base, partial):
        """AdamW by ``choice`` on ``state`` (the experts ``offsets`` covers), unless ``skip``; ``base``: the
        offset of the state's first element in the whole tensor (stochastic rounding's counter);
        ``partial``: one fp32 per program of ``choice``'s tiles over those experts, receives the sums of
        squares. Returns the number of entries the spike rule replaced (0-dim int32 tensor), or None without
        clipping. The AdamW launches compile without automatic fma contraction, so the arithmetic is the
        one written in kernels/adamw.py (explicit fmas only); the wgrad's other epilogues keep it."""
        u, launch, cfg = self.update, self.launch, choice.config
        clip = u.clipping
        device = state.weight.device
        scales = (
            (state.exp_avg_scales, state.exp_avg_sq_scales, moments_8bit_tables(device))
            if u.moments_8bit
            else None
        )
        if choice.path == "fused":
            counts = torch.zeros(partial.numel(), dtype=torch.int32, device=device) if clip else None
            launch(
                "adamw", cfg, offsets, state.weight, state.grad_in, skip, partial, *state[:3], scalars, u.hyper,
                self.limit, u.grad_dtype, self.arithmetic, self.has_norm, scales=scales, remainder=state.remainder,
                rng=rng, clip_counts=counts, enable_fp_fusion=False,
            )  # fmt: skip
            return None if counts is None else counts.sum()
        experts, tiles = offsets.numel() - 1, launch.tiles(cfg)
        # Allocated before the first chunk: a chunk after the first launches the kernels the first built.
        scratch = like(state.weight[: min(self.chunk, experts)], u.grad_dtype)
        clipped = None
        for e0 in range(0, experts, self.chunk):
            e1 = min(e0 + self.chunk, experts)
            part, grad = state.experts(e0, e1), scratch[: e1 - e0]
            # The store reads no state: the gradient stands in for it (one compiled kernel for every state kind).
            # A chunk of fewer than 4 experts can start its slices of the offsets and of the per-program sums
            # off a 16-byte boundary: copies that start on one keep the first chunk's compiled variant.
            chunk_offsets = _aligned(offsets[e0 : e1 + 1])
            chunk_sums = partial[e0 * tiles : e1 * tiles]
            sums = _aligned(chunk_sums)
            launch(
                "store", cfg, chunk_offsets, grad, part.grad_in, skip, sums, grad, grad, grad, skip, u.hyper, self.limit,
                u.grad_dtype, self.arithmetic, self.has_norm,
            )  # fmt: skip
            if sums is not chunk_sums:
                chunk_sums.copy_(sums)
            counts = self._adamw(part, grad, scalars, skip, rng, base + e0 * state.weight.stride(0), cfg)
            if counts is not None:
                clipped = counts.sum() if clipped is None else clipped + counts.sum()
        return clipped

    def _adamw(self, part, grad, scalars, skip, rng, index_base, cfg):
        """The standalone AdamW kernel on one chunk (``grad`` its gradient; 8-bit moments: the closed-form
        quantizer where ``cfg`` has EPILOGUE_PREFETCH); the spike rule's per-program counts, or None."""
        u = self.update
        if u.moments_8bit:
            return moments_8bit.adamw_8bit_triton_(
                part.weight, grad, (part.exp_avg, part.exp_avg_scales), (part.exp_avg_sq, part.exp_avg_sq_scales),
                scalars, skip, u.hyper, remainder=part.remainder, rng=rng, index_base=index_base,
                closed_form=cfg.EPILOGUE_PREFETCH,
            )  # fmt: skip
        weight, remainder = part.weight, part.remainder
        bits = remainder is not None or rng is not None  # the weight through its int16 bits
        ac = ADAMW_MASTER_CONFIG if bits else ADAMW_CONFIG
        programs = triton.cdiv(weight.numel(), ac["BLOCK"])
        counts = torch.zeros(programs, dtype=torch.int32, device=weight.device) if u.clipping else None
        hyper = u.hyper
        adamw_kernel[(programs,)](
            weight.view(torch.int16) if bits else weight, grad, part.exp_avg, part.exp_avg_sq, scalars,
            skip, hyper, hyper if remainder is None else remainder, hyper if rng is None else rng,
            hyper if counts is None else counts, weight.numel(), index_base,
            BLOCK=ac["BLOCK"], ARITHMETIC=self.arithmetic, REMAINDER=remainder is not None,
            STOCHASTIC=rng is not None, CLIP=u.clipping, INTERPRET=self.launch.interpret, num_warps=ac["num_warps"],
            enable_fp_fusion=False,
        )  # fmt: skip
        return counts
