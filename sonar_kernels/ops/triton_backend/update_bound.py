"""Launchers of the overflow bound of the updated expert tensors' gradients (``kernels/update_bound.py``):
the 0.0 / 1.0 flag that lets an update's check pass return at once (docs/design.md, "Backward and the fused
update"). Two launches per layer step, in the backward's core (:func:`layer_magnitudes`): a pass over the
operands' magnitudes, then the table of every expert tensor's flag at every pair of limits an update meets;
an update then reads its flag from the table (:func:`overflow_flag`: a view, no launch), or, with the gradient
of earlier micro-batches, computes it in one launch of its own. What used to be some twenty torch ops per
update. No host sync; the flag is the torch expression's (``ops/arithmetic.py``,
:func:`sonar_kernels.ops.arithmetic.overflow_possible`)."""

from __future__ import annotations

import torch
import triton

from sonar_kernels.kernels.update_bound import (
    COLUMNS,
    FLAG_STRIDE,
    NUM_ENTRY_LIMITS,
    NUM_OPERAND_LIMITS,
    TABLE,
    bound_flag_kernel,
    bound_magnitudes_kernel,
    bound_table_kernel,
)
from sonar_kernels.ops import common
from sonar_kernels.ops.common import inf_norm
from sonar_kernels.rules.adamw import grad_limit
from sonar_kernels.specs import EXPERT_TENSORS

# Token rows per block of the magnitudes pass, and its programs at most (some four per SM of an H100, whose
# sm_90a build takes 128 registers at 4 warps): at OLMoE's T 4096, 256 programs each read 16 rows of X and
# of dO (128 KiB in bf16).
BLOCK_T = 16
MAX_PROGRAMS = 512
# The column of Q's largest magnitude for each expert tensor (kernels/update_bound.py): A for the down
# projection, X for the gate/up projection, none (a column of ones) for a bias.
_Q_COLUMN = {"down_proj": 0, "gate_up_proj": 4, "up_proj": 4, "gate_up_proj_bias": -1, "down_proj_bias": -1}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The limits of the table: an update's entry limit is min(grad_limit of its exp_avg_sq's dtype (fp32 for
# 8-bit moments), the largest of its gradient dtype) (ops/triton_backend/wgrad_update.py), its operand limit the largest of
# the GEMM operands' dtype; every dtype the launchers accept gives one of these (2**63, 65504, 2**7).
ENTRY_LIMITS = tuple(
    sorted({min(grad_limit(m), torch.finfo(g).max) for m in _DTYPES for g in _DTYPES}, reverse=True)
)
OPERAND_LIMITS = tuple(torch.finfo(d).max for d in _DTYPES)
assert len(ENTRY_LIMITS) == NUM_ENTRY_LIMITS and len(OPERAND_LIMITS) == NUM_OPERAND_LIMITS


def magnitude_rows(T: int) -> int:
    """The rows of :func:`layer_magnitudes` for ``T`` tokens (the programs of its pass; at least 1)."""
    # sym_max / sym_min: a symbolic T (the fake implementation under torch.compile) stays symbolic.
    return torch.sym_max(1, torch.sym_min((T + BLOCK_T - 1) // BLOCK_T, MAX_PROGRAMS))


def magnitudes_numel(T: int) -> int:
    """The elements of :func:`layer_magnitudes`' buffer for ``T`` tokens."""
    return TABLE + magnitude_rows(T) * COLUMNS


def layer_magnitudes(
    hidden_states: torch.Tensor,
    grad_out: torch.Tensor,
    top_k_weights: torch.Tensor,
    absmax: torch.Tensor | None,
    expert_offsets: torch.Tensor,
) -> torch.Tensor:
    """The magnitudes that bound every expert tensor's gradient of a layer step and the flags they give,
    in two launches.

    Args:
        hidden_states: X [T, H]; grad_out: dO [T, H] (any strides, 0 included); top_k_weights: [T, top_k].
        absmax: [n, 2] fp32, the dHpre kernel's per-program largest |A| and |dHpre| (NaN counted as inf),
            or None when it did not run (no kept rows).
        expert_offsets: [E + 1] int32.
    Returns:
        [:func:`magnitudes_numel` (T)] fp32: the table of flags (``kernels/update_bound.py``: per entry limit
        of :data:`ENTRY_LIMITS`, operand limit of :data:`OPERAND_LIMITS` and expert tensor), then per
        program of the pass the largest |A|, |dHpre|, |top_k_weights|, |dO|, |X| and rows of an expert over
        its share (a NaN counted as inf; the largest of each column is that of the whole tensor).
    """
    T, H = hidden_states.shape
    top_k = top_k_weights.shape[1]
    programs = magnitude_rows(T)
    out = common.empty((TABLE + programs * COLUMNS,), torch.float32, hidden_states.device)
    absmax_arg, num_absmax = (out, 0) if absmax is None else (absmax, absmax.shape[0])
    bound_magnitudes_kernel[(programs,)](
        hidden_states, grad_out, top_k_weights, absmax_arg, expert_offsets, out,
        T, H, top_k, num_absmax, expert_offsets.numel() - 1,
        hidden_states.stride(0), hidden_states.stride(1), grad_out.stride(0), grad_out.stride(1),
        top_k_weights.stride(0), top_k_weights.stride(1),
        BLOCK_T=BLOCK_T, BLOCK_H=256, BLOCK_J=max(2, triton.next_power_of_2(top_k)), BLOCK_A=64, BLOCK_E=64,
        num_warps=4,
    )  # fmt: skip
    bound_table_kernel[(1,)](
        out, programs, *ENTRY_LIMITS, *OPERAND_LIMITS, BLOCK_ROWS=128, num_warps=4, enable_fp_fusion=False
    )
    return out


def overflow_flag(
    magnitudes: torch.Tensor,
    name: str,
    grad_in: torch.Tensor | None,
    entry_limit: float,
    operand_limit: float,
) -> torch.Tensor:
    """The 0-dim fp32 flag of the expert tensor ``name``'s update: 0.0 when no entry of its wgrad, rounded
    (and summed with ``grad_in``), can exceed ``entry_limit`` in magnitude and no GEMM operand can exceed
    ``operand_limit`` when rounded to the GEMM dtype, else 1.0 (so also for a NaN or inf anywhere): the
    decision of :func:`sonar_kernels.ops.arithmetic.overflow_possible` on the same magnitudes. A view of the
    table (no launch), or with ``grad_in`` (gradient accumulation) or limits outside the table one launch
    (and torch's max |grad_in|).

    Args:
        magnitudes: :func:`layer_magnitudes`' buffer for this layer step.
        name: one of :data:`sonar_kernels.specs.EXPERT_TENSORS`: P is w * dO (the down projection and its
            bias) or dHpre; Q is A, X or a column of ones.
        entry_limit, operand_limit: Python floats that fp32 holds exactly (a power of two, a dtype's max).
    """
    if grad_in is None and entry_limit in ENTRY_LIMITS and operand_limit in OPERAND_LIMITS:
        row = ENTRY_LIMITS.index(entry_limit) * NUM_OPERAND_LIMITS + OPERAND_LIMITS.index(operand_limit)
        at = (row * len(EXPERT_TENSORS) + EXPERT_TENSORS.index(name)) * FLAG_STRIDE
        return magnitudes.as_strided((), (), magnitudes.storage_offset() + at)
    flag = common.empty((), torch.float32, magnitudes.device)
    grad_in_max = flag if grad_in is None else inf_norm(grad_in)
    bound_flag_kernel[(1,)](
        magnitudes, grad_in_max, flag, (magnitudes.numel() - TABLE) // COLUMNS, float(entry_limit),
        float(operand_limit), P_FROM_TOKENS=name in ("down_proj", "down_proj_bias"), Q_COLUMN=_Q_COLUMN[name],
        HAS_GRAD_IN=grad_in is not None, BLOCK_ROWS=128, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return flag
