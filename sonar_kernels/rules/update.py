"""One update of one element, for every state kind the "fp64" arithmetic covers: the rules composed.

A state kind is a moments kind (exact exp_avg and exp_avg_sq in fp32 or bf16, or 8-bit codes and block
scales: ``rules/moments_8bit.py``) times a master kind (none: the weight itself in its dtype; the 16-bit
remainder or stochastic rounding of a bf16 weight: ``rules/master_weights.py``), with or without expert
clipping (``rules/clipping.py``). :func:`adamw_update_` reads the master and the moments, clips, runs
AdamW (``rules/adamw.py``) and writes them back, in that order; the Triton tiles that compute the same
(``sonar_kernels/kernels/adamw.py``'s ``adamw_tile``, ``kernels/moments_8bit.py``'s ``adamw_8bit_tile``,
with ``kernels/master_weights.py``'s ``load_weight`` and ``store_weight``) follow the same order. Exact
moments without a master kind are not here: torch's own AdamW updates them (``ops/torch_backend/adamw.py``).

:data:`adamw_update` is :func:`adamw_update_` compiled on the CPU (``rules/compiled.py``): the torch backend's
update. The driver that feeds it a slice at a time is ``sonar_kernels/ops/torch_backend/fp64_update.py``.
"""

from __future__ import annotations

import torch

from sonar_kernels.rules.adamw import adamw_fp64
from sonar_kernels.rules.clipping import clip_elements
from sonar_kernels.rules.compiled import CompiledRule
from sonar_kernels.rules.master_weights import merge, split, stochastic_round
from sonar_kernels.rules.moments_8bit import BLOCK, dequantize_blocks, quantize_blocks

__all__ = ["adamw_update", "adamw_update_", "remainder_merge", "remainder_split_"]


def adamw_update_(
    weight: torch.Tensor,
    grad: torch.Tensor,
    moments: tuple[torch.Tensor, ...],
    scalars: torch.Tensor,
    hyper: torch.Tensor,
    found: torch.Tensor | None,
    tables: torch.Tensor,
    *,
    grad_dtype: torch.dtype,
    remainder: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
    first_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """One AdamW update of ``weight`` and its state, in place, each element (each block of :data:`BLOCK`
    for 8-bit moments) from its own state alone; nothing changes where ``found`` is set.

    Args:
        weight: [..., C], any float dtype; bf16 with ``remainder`` or ``seed``.
        grad: ``weight``'s shape, any float dtype, read as fp32: the gradient as the update uses it (values
            of ``grad_dtype``).
        moments: (exp_avg, exp_avg_sq), fp32 or bf16, ``weight``'s shape; or 8-bit: (exp_avg's int8 codes,
            its fp32 scales, exp_avg_sq's uint8 codes, its scales), codes ``weight``'s shape, scales
            [..., C // BLOCK], ``weight`` contiguous.
        scalars: [2] fp32, ``rules.adamw.adamw_scalars`` at the update's step.
        hyper: [5] fp64 (lr, beta1, beta2, eps, weight_decay); [7] with expert clipping (spike_threshold,
            grad_scale follow): the gradient clipped against exp_avg_sq before the update.
        found: 0-dim bool: the update is skipped (a non-finite gradient, decided by the caller); None: not
            skipped (a caller that can read the decision, on the CPU, skips the call instead: no blend).
        tables: ``rules.moments_8bit.tables`` on the weight's device (read with 8-bit moments).
        grad_dtype: the gradient dtype (clipping rounds to it).
        remainder: int16, ``weight``'s shape: the fp32 master is (weight, remainder) (``merge``, ``split``).
        seed, step, index: stochastic rounding: the tensor's 0-dim int64 seed, the 0-dim fp32 step (already
            incremented), each element's int64 counter (``rules.master_weights.stochastic_round``); or,
            for a contiguous ``weight``, ``first_index`` (0-dim int64), the first element's counter.
    Returns:
        the 0-dim int64 count of the gradient entries expert clipping replaced (0 without it, or skipped).
    """
    return adamw_update(
        False, weight, grad, moments, scalars, hyper, found, tables, grad_dtype=grad_dtype, remainder=remainder,
        seed=seed, step=step, index=index, first_index=first_index,
    )  # fmt: skip


def _moments_(
    weight, grad, moments, scalars, hyper, found, tables, *, grad_dtype, remainder, master: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:func:`adamw_update_` up to the master's store: reads the master and the moments, clips, runs AdamW,
    writes the moments (and a weight without a master kind); returns the new fp32 master (None without a
    master kind) and the clipping count. No 16-bit integer here (inductor's C++ vectorizes none: a loop
    that holds one runs a lane at a time), so the remainder is read through ``merge``'s float path."""
    eight_bit = len(moments) == 4
    if eight_bit:
        m_codes, m_scales, v_codes, v_scales = moments
        m = dequantize_blocks(_blocks(m_codes), m_scales.reshape(-1, 1), "exp_avg", tables[:128])
        v = dequantize_blocks(_blocks(v_codes), v_scales.reshape(-1, 1), "exp_avg_sq", tables[128:])
        m, v = m.reshape(weight.shape), v.reshape(weight.shape)
    else:
        exp_avg, exp_avg_sq = moments
        m, v = exp_avg.float(), exp_avg_sq.float()
    weight_in = weight if remainder is None else merge(weight, remainder)
    grad = grad.float()
    count = torch.zeros((), dtype=torch.int64, device=weight.device)
    if hyper.shape[0] == 7:
        grad, count = clip_elements(grad, v, hyper, grad_dtype)
        count = count if found is None else torch.where(found, 0, count)
    p, m, v = adamw_fp64(weight_in, grad, m, v, scalars, hyper)
    if not master:
        weight.copy_(_keep(found, weight, p.to(weight.dtype)))
    if eight_bit:
        for codes, scales, values, kind, table in (
            (m_codes, m_scales, m, "exp_avg", tables[:128]),
            (v_codes, v_scales, v, "exp_avg_sq", tables[128:]),
        ):
            new_codes, new_scales = quantize_blocks(_blocks(values), kind, table)
            codes.copy_(_keep(found, codes, new_codes.reshape(codes.shape)))
            scales.copy_(_keep(found, scales, new_scales.reshape(scales.shape)))
    else:
        exp_avg.copy_(_keep(found, exp_avg, m.to(exp_avg.dtype)))
        exp_avg_sq.copy_(_keep(found, exp_avg_sq, v.to(exp_avg_sq.dtype)))
    return (p if master else None), count


def _store_master_(
    p, weight, found, *, remainder=None, seed=None, step=None, index=None, first_index=None
) -> None:
    """:func:`adamw_update_`'s store of the new fp32 master ``p`` into the bf16 weight: split into weight
    and ``remainder``, or rounded stochastically."""
    if remainder is not None:
        new_weight, new_remainder = split(p)
        remainder.copy_(_keep(found, remainder, new_remainder))
    else:
        if index is None:  # a contiguous slice: its elements' counters follow each other
            index = torch.arange(weight.numel(), device=weight.device).reshape(weight.shape) + first_index
        new_weight = stochastic_round(p, seed, step, index)
    weight.copy_(_keep(found, weight, new_weight))


def _keep(found: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``old`` where ``found``, else ``new`` (``found`` None: ``new``), bit for bit (a NaN's payload kept).
    8- and 16-bit values are chosen as int32: inductor's C++ blends narrow lanes one at a time, a scalar
    loop in the kernel."""
    if found is None:
        return new
    if old.element_size() >= 4:
        return torch.where(found, old, new)
    bits = {1: torch.int8 if old.dtype == torch.int8 else torch.uint8, 2: torch.int16}[old.element_size()]
    chosen = torch.where(found, old.view(bits).to(torch.int32), new.view(bits).to(torch.int32))
    return chosen.to(bits).view(old.dtype)


def _blocks(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, BLOCK)


def _kind(weight, grad, moments, scalars, hyper, found, tables, *, grad_dtype, remainder=None, master=False):
    """The kind of a :func:`_moments_` call (the first-call accounting's key)."""
    return (
        weight.dtype, weight.dim(), tuple(t.dtype for t in moments), remainder is not None, master,
        hyper.shape[0], grad_dtype, found is None,
    )  # fmt: skip


class _CompiledUpdate:
    """:func:`adamw_update_` with both stages compiled (``rules/compiled.py``): its math, then the master's
    store (a loop of 16-bit integers, which inductor's C++ runs a lane at a time, apart from the math)."""

    def __init__(self):
        self.moments = CompiledRule(_moments_, _kind)
        self.master = CompiledRule(
            _store_master_, lambda p, weight, found, *, remainder=None, **_: (p.dim(), remainder is not None, found is None)
        )  # fmt: skip

    def wanted(self, size: int, device: torch.device) -> bool:
        """``CompiledRule.wanted`` of the update (both stages decide alike)."""
        return self.moments.wanted(size, device)

    def __call__(
        self, compiled: bool, weight, grad, moments, scalars, hyper, found, tables, *, grad_dtype, remainder=None,
        seed=None, step=None, index=None, first_index=None,
    ) -> torch.Tensor:  # fmt: skip
        """:func:`adamw_update_` (the two stages in order), compiled when ``compiled`` (:meth:`wanted`)."""
        new_master, count = self.moments(
            compiled, weight, grad, moments, scalars, hyper, found, tables, grad_dtype=grad_dtype,
            remainder=remainder, master=remainder is not None or seed is not None,
        )  # fmt: skip
        if new_master is not None:
            self.master(compiled, new_master, weight, found, remainder=remainder, seed=seed, step=step, index=index,
                        first_index=first_index)  # fmt: skip
        return count


adamw_update = _CompiledUpdate()


def _split_(master: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor) -> None:
    new_weight, new_remainder = split(master)
    weight.copy_(new_weight)
    remainder.copy_(new_remainder)


# The 16-bit remainder with exact moments: torch's own AdamW runs on the merged fp32 master
# (ops/torch_backend/adamw.py), the merge and the split around it are these, one pass each when compiled.
remainder_merge = CompiledRule(merge, lambda weight, remainder: (weight.dim(),))
remainder_split_ = CompiledRule(_split_, lambda master, weight, remainder: (master.dim(),))
