"""One wgrad launch of ``kernels/expert_wgrad.py`` over a range of experts: the operands of one expert tensor's
gradient bound once (:class:`WgradLaunch`), launched with an epilogue ("store", "check", "adamw"), a tile
configuration and the state it reads and writes. ``ops/triton_backend/wgrad.py`` (the gradient) and ``ops/triton_backend/wgrad_update.py``
(the AdamW update, fused or split, and its tuning) launch through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

from sonar_kernels.kernels.expert_wgrad import expert_mlp_bwd_dw_kernel
from sonar_kernels.ops.common import TL_DTYPES, input_precision
from sonar_kernels.ops.triton_backend.configs import Config


def weight_of_row(top_k_weights: torch.Tensor, meta) -> torch.Tensor:
    """[S] fp32: the routing weight of each row, top_k_weights[slot_of_row[r] // top_k, slot_of_row[r] % top_k]
    as fp32 (exact: the weights' own values), so that the dW2 kernel reads one contiguous weight per row in
    its main loop instead of a gather that depends on another load. Rows past the kept ones (unspecified
    slots) get some weight of the tensor; the kernel never reads them."""
    S = top_k_weights.numel()
    slots = meta.slot_of_row.clamp(0, max(S - 1, 0)).long()
    return top_k_weights.reshape(-1)[slots].float()


class WgradLaunch(NamedTuple):
    """The operands of one expert tensor's wgrad, dW[e] = sum over rows r of expert e of P[r]^T Q[r]
    (``ops/triton_backend/wgrad.py``, :func:`sonar_kernels.ops.triton_backend.wgrad.expert_wgrad` says what P and Q are).

    Attributes:
        p, q: the GEMM operands; ``p_from_tokens`` / ``q_from_tokens``: their rows are gathered by token
            (``p`` then also scaled by the routing weight).
        weight_of_row: [S] fp32, each row's routing weight (:func:`weight_of_row`), read when
            ``p_from_tokens``; ``meta``: the layer's routing metadata.
        M, N: the kernel's [E, M, N] view of the tensor; ``dtype``: the GEMM operands' dtype.
        view: maps a tensor of the weight's shape and strides (or a chunk of its experts) to what the
            kernel indexes: [E, M, N], or W1's [E, 2, M / 2, N] halves.
        interpret: the kernels run under the Triton interpreter.
    """

    p: torch.Tensor
    p_from_tokens: bool
    q: torch.Tensor
    q_from_tokens: bool
    weight_of_row: torch.Tensor
    meta: object
    M: int
    N: int
    dtype: torch.dtype
    view: Callable[[torch.Tensor], torch.Tensor]
    interpret: bool

    def grid(self, cfg: Config, experts: int) -> tuple[int]:
        """The launch grid of ``experts`` experts at tile configuration ``cfg``: one program per tile."""
        return (experts * self.tiles(cfg),)

    def tiles(self, cfg: Config) -> int:
        """Programs (output tiles) per expert at ``cfg``."""
        return triton.cdiv(self.M, cfg.BLOCK_M) * triton.cdiv(self.N, cfg.BLOCK_N)

    def __call__(
        self, epilogue, cfg, offsets, grad, grad_in, flag, partial, target, exp_avg, exp_avg_sq, step, hyper, limit,
        grad_dtype, arithmetic, has_norm, scales=None, remainder=None, rng=None, clip_counts=None, **options,
    ):  # fmt: skip
        """Launch the wgrad of the experts that ``offsets`` ([n + 1] int32: a slice of the metadata's
        expert_offsets, the rows of experts e0 .. e0 + n - 1) covers, at tile configuration ``cfg``, with
        ``epilogue`` "store" (into ``grad``), "check" or "adamw" (``target``, ``exp_avg``, ``exp_avg_sq``:
        their first n experts). Every tensor of the weight's shape is given for those n experts only (a
        chunk's slice, or the whole tensor); ``partial``: one fp32 per program. Arguments a variant does
        not read are replaced by placeholders."""
        p, q, view = self.p, self.q, self.view
        if remainder is not None or rng is not None:
            # The weight as its int16 bits (merged with the remainder, or rounded stochastically, in the
            # epilogue).
            target = target.view(torch.int16)
            remainder = None if remainder is None else view(remainder)
        if scales is None:  # exact moments: the 8-bit arguments are not read
            scale_args, scale_strides = (hyper, hyper, hyper), (0, 0, 0)
        else:  # (exp_avg's scales, exp_avg_sq's scales, tables)
            scale_args = (*scales[:2], scales[2])
            sv = view(scales[0])
            scale_strides = (
                (sv.stride(0), sv.stride(1), sv.stride(2))
                if sv.dim() == 4
                else (sv.stride(0), 0, sv.stride(1))
            )
        grad, target, exp_avg, exp_avg_sq = view(grad), view(target), view(exp_avg), view(exp_avg_sq)
        grad_in = None if grad_in is None else view(grad_in)
        if grad.dim() == 4:  # W1's halves: row m of the gradient is (half m // I, row m % I)
            strides = (grad.stride(0), grad.stride(1), grad.stride(2), grad.stride(3), grad.shape[2])
        else:
            strides = (grad.stride(0), 0, grad.stride(1), grad.stride(2), self.M)
        experts = offsets.numel() - 1
        if epilogue != "adamw":
            # The store and the check pass read no AdamW arithmetic and have no prefetched epilogue: one build
            # of each at a tile, whatever update launches it (the canonical "fp64", as make kernel-report
            # builds them).
            cfg, arithmetic = cfg._replace(EPILOGUE_PREFETCH=False), "fp64"
        expert_mlp_bwd_dw_kernel[self.grid(cfg, experts)](
            p, q, self.weight_of_row, self.meta.token_of_row, offsets,
            grad, grad if grad_in is None else grad_in, target, exp_avg, exp_avg_sq, step, flag, partial, hyper,
            *scale_args, hyper if remainder is None else remainder, hyper if rng is None else rng,
            hyper if clip_counts is None else clip_counts,
            experts, self.M, self.N,
            p.stride(0), p.stride(1), q.stride(0), q.stride(1),
            *strides, *scale_strides,
            limit,
            P_FROM_TOKENS=self.p_from_tokens, Q_FROM_TOKENS=self.q_from_tokens, **cfg.blocks(),
            **cfg.epilogue(), EPILOGUE=epilogue, HAS_GRAD_IN=grad_in is not None,
            HAS_NORM=has_norm, ARITHMETIC=arithmetic, MOMENTS_8BIT=scales is not None,
            REMAINDER=remainder is not None, STOCHASTIC=rng is not None, CLIP=clip_counts is not None,
            GRAD_DTYPE=TL_DTYPES[grad_dtype],
            DOT_DTYPE=TL_DTYPES[self.dtype], INPUT_PRECISION=input_precision(self.dtype), INTERPRET=self.interpret,
            **cfg.launch(), **options,
        )  # fmt: skip
