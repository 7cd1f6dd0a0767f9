"""The torch backend's driver of the updates in the "fp64" arithmetic: 8-bit moments (any master kind) and
stochastic rounding (exact moments). The rule of one element is ``sonar_kernels/rules/update.py``'s
``adamw_update``; this module decides the skip, counts the step, computes the gradient by chunks of experts
and feeds the rule a slice at a time (:data:`UPDATE_ELEMENTS`, :data:`COMPILED_UPDATE_ELEMENTS`); on the CPU,
8-bit moments and stochastic rounding without expert clipping take the rule's C translation instead, a
chunk in one call (``ops/torch_backend/cpu_update.py``).
"""

from __future__ import annotations

import torch

from sonar_kernels.ops.common import skip_decided
from sonar_kernels.ops.torch_backend.adamw import chunked_update_skipped
from sonar_kernels.ops.torch_backend.cpu_update import adamw_8bit_cpu_, adamw_stochastic_cpu_
from sonar_kernels.ops.torch_backend.expert_gradient import ExpertGradient
from sonar_kernels.rules.adamw import adamw_scalars, grad_limit
from sonar_kernels.rules.master_weights import element_index
from sonar_kernels.rules.moments_8bit import BLOCK, tables
from sonar_kernels.rules.update import adamw_update
from sonar_kernels.update_state import UpdateState

__all__ = [
    "COMPILED_UPDATE_ELEMENTS",
    "UPDATE_ELEMENTS",
    "adamw_8bit_",
    "chunked_fp64_update_",
    "stochastic_adamw_",
]

# Elements per call of the rule, so that its temporaries stay small whatever the chunk of experts: op by op
# (fp64 operands, int32 indices: about 66 bytes an element) about 1 MiB; compiled (the new fp32 moments
# and master: about 12 bytes an element) about 3 MiB, in calls large enough that a compiled
# call's fixed cost (Python and the compiled graph's guards: tens of microseconds) stays small.
UPDATE_ELEMENTS = 1 << 14
COMPILED_UPDATE_ELEMENTS = 1 << 18


def adamw_8bit_(
    weight: torch.Tensor,
    gradient,
    grad_in: torch.Tensor | None,
    state: list[torch.Tensor],
    hyper: torch.Tensor,
    *,
    grad_dtype: torch.dtype | None,
    chunk_bytes: int | None,
    found: torch.Tensor | None = None,
    index_base: int = 0,
) -> None:
    """The torch backend's update of one expert tensor with 8-bit moments, in place: ``state`` the update's
    tensors (exp_avg's codes, exp_avg_sq's codes, step, grad_norm_sq, skipped, clipped, exp_avg's scales,
    exp_avg_sq's scales; ``ops/library.py``'s order; then, for a bf16 weight with master weights
    (docs/design.md, "bf16 master weights"), its int16 remainder, merged into the fp32 master before the
    update and split from it after, or the 0-dim int64 seed of its stochastic rounding at the update's
    step and each element's offset), ``hyper`` the [5] fp64 hyperparameters ([7] with expert clipping:
    each part's gradient clipped against its dequantized exp_avg_sq first, ``rules/clipping.py``; the count
    in ``clipped``).

    ``gradient``: the gradient as a tensor, or an ``ExpertGradient`` (``ops/torch_backend/expert_gradient.py``) that
    computes it by chunks of experts of at most ``chunk_bytes`` (None: whole), each chunk updated before the
    next is computed (blocks lie along the last dimension, chunks along the first: a chunk holds whole
    blocks). The gradient is rounded to ``grad_dtype`` (None: the weight's), plus ``grad_in`` (earlier
    micro-batches) rounded once more, as autograd sums them. The update is skipped as a whole (weight,
    codes, scales and step unchanged; ``grad_norm_sq`` inf, ``skipped`` + 1) when an entry of that gradient
    is not finite or beyond ``rules.adamw.grad_limit(float32)``: decided before the first chunk is updated
    (a bound from the GEMM operands, else a check pass) when chunked (the CPU: read on the host, which costs
    nothing), on the device without a host read otherwise.

    A DTensor ``weight`` (FSDP2's shard) is refused: ``ops/grad_update.py`` updates it.

    Args:
        found: the skip decided by the caller (a 0-dim bool on the weight's device) in place of the
            gradient's own check, for a whole gradient only: a shard's update uses the whole tensor's.
        index_base: added to every element's stream counter with stochastic rounding (a shard's position in
            the whole tensor).
    """
    s = UpdateState.of(state)
    _update_(
        weight, gradient, grad_in, (s.exp_avg, s.exp_avg_scales, s.exp_avg_sq, s.exp_avg_sq_scales), state, hyper,
        remainder=s.remainder, seed=s.seed, grad_dtype=grad_dtype, chunk_bytes=chunk_bytes, found=found,
        index_base=index_base,
    )  # fmt: skip


def stochastic_adamw_(
    weight: torch.Tensor,
    gradient,
    grad_in: torch.Tensor | None,
    state: list[torch.Tensor],
    hyper: torch.Tensor,
    *,
    grad_dtype: torch.dtype | None,
    chunk_bytes: int | None,
    found: torch.Tensor | None = None,
    index_base: int = 0,
) -> None:
    """The torch backend's update of a bf16 ``weight`` rounded stochastically, with exact moments (fp32 or
    bf16, read as fp32 and rounded to their dtype once at the store), in place: AdamW on the weight read as
    fp32 in the "fp64" arithmetic, the result rounded back with ``rules.master_weights.stochastic_round`` at
    the tensor's seed, the update's step (incremented) and each element's offset (``element_index``): given
    the same gradient, the same bits as the Triton epilogue and split path. ``state``: exp_avg,
    exp_avg_sq, step, grad_norm_sq, skipped, clipped, seed (``update_state.UpdateState``'s order); ``hyper``: the [5] fp64 hyperparameters ([7]: expert clipping first,
    ``rules/clipping.py``). ``gradient``, ``grad_in``, ``grad_dtype``, ``chunk_bytes``, the skip, a DTensor
    weight (refused), ``found`` and ``index_base`` as :func:`adamw_8bit_` takes them; any layout of the weight (each
    element's counter is its offset in the storage)."""
    s = UpdateState.of(state)
    _update_(
        weight, gradient, grad_in, (s.exp_avg, s.exp_avg_sq), state, hyper, seed=s.seed, grad_dtype=grad_dtype,
        chunk_bytes=chunk_bytes, found=found, index_base=index_base,
    )  # fmt: skip


def _is_dtensor(t) -> bool:
    return callable(getattr(t, "to_local", None))


def _update_(
    weight, gradient, grad_in, moments, state, hyper, *, grad_dtype, chunk_bytes, found, index_base, remainder=None,
    seed=None,
) -> None:  # fmt: skip
    """:func:`adamw_8bit_` and :func:`stochastic_adamw_`, their state unpacked: ``moments`` the tuple the
    rule takes, ``state`` the whole list (step, grad_norm_sq, skipped and clipped at 2 to 5)."""
    s = UpdateState.of(state)
    step, grad_norm_sq, skipped, clipped = s.step, s.grad_norm_sq, s.skipped, s.clipped
    eight_bit = s.kind.moments == "8bit"
    dtype = grad_dtype or weight.dtype
    if _is_dtensor(weight):
        raise ValueError(
            "a sharded (DTensor) weight's update runs through sonar_kernels.ops.grad_update (the skip and the "
            "norm over the whole gradient, then the shard)"
        )
    start_offset = weight.storage_offset()
    table = tables(weight.device)
    clipped.zero_()
    extras = (weight, *moments, *([] if remainder is None else [remainder]))

    def parts(first: int, last: int, grad: torch.Tensor, elements: int):
        """(weight, grad, moments, remainder) of experts ``first`` to ``last - 1`` a slice of at most
        ``elements`` at a time: when every tensor is contiguous, slices of their flat views
        ([-1, BLOCK] with 8-bit moments, their scales [-1, 1]: the layout the compiled rule runs fastest
        on), else rows of one expert at a time (any layout)."""
        if all(t.is_contiguous() for t in extras) and grad.is_contiguous():
            width = BLOCK if eight_bit else None
            scales = (2, 4) if width else ()  # the 8-bit moments' scales among the extras

            def flat(t: torch.Tensor, i: int) -> torch.Tensor:
                if width is None:
                    return t.reshape(-1)
                return t.reshape(-1, 1) if i in scales else t.reshape(-1, width)

            held = [flat(t[first:last], i) for i, t in enumerate(extras)]
            flat_grad = flat(grad, 0)
            step_rows = elements // (width or 1)
            for start in range(0, flat_grad.shape[0], step_rows):
                w, *rest = (t[start : start + step_rows] for t in held)
                yield w, flat_grad[start : start + step_rows], rest[: len(moments)], rest[len(moments) :]
            return
        for e in range(first, last):
            if weight.dim() > 2:
                rows = max(1, elements // max(1, weight[0].numel() // weight.shape[1]))
                spans = [(e, slice(r, r + rows)) for r in range(0, weight.shape[1], rows)]
            else:
                spans = [(slice(e, e + 1),)]
            for span in spans:
                w, *rest = (t[span] for t in extras)
                g = grad[(e - first, *span[1:])] if weight.dim() > 2 else grad[e - first : e - first + 1]
                yield w, g, rest[: len(moments)], rest[len(moments) :]

    def apply(first: int, last: int, grad: torch.Tensor, scalars: torch.Tensor, skip=None) -> None:
        """Experts ``first`` to ``last - 1`` from their gradient; ``skip``: None (decided already), or the
        device flag of a whole gradient's skip (its gradient zeroed and its state kept where it is set)."""
        compiled = adamw_update.wanted(weight[first:last].numel(), weight.device)
        elements = COMPILED_UPDATE_ELEMENTS if compiled else UPDATE_ELEMENTS
        if compiled and skip is not None:  # the CPU: the skip read here (free), no blend in the kernel
            if bool(skip):
                return
            skip = None
        if compiled and eight_bit:  # 8-bit moments: the C update in one pass, where it applies
            chunk = weight[first:last]
            if adamw_8bit_cpu_(
                chunk, grad, tuple(t[first:last] for t in moments), scalars, hyper,
                remainder=None if remainder is None else remainder[first:last], seed=seed, step=step,
                first_index=chunk.storage_offset() - start_offset + index_base,
            ):  # fmt: skip
                return
        if compiled and not eight_bit and seed is not None:  # exact moments, stochastic rounding: likewise
            chunk = weight[first:last]
            if adamw_stochastic_cpu_(
                chunk, grad, tuple(t[first:last] for t in moments), scalars, hyper, seed=seed, step=step,
                first_index=chunk.storage_offset() - start_offset + index_base,
            ):  # fmt: skip
                return
        for w, g, held_moments, held_remainder in parts(first, last, grad, elements):
            index = first_index = None
            if seed is not None:  # the elements' counters: their offsets in the whole tensor
                offset = w.storage_offset() - start_offset + index_base
                if w.is_contiguous():
                    first_index = torch.tensor(offset, dtype=torch.int64)
                else:
                    index = element_index(w) + offset
            # detach: a slice enters the compiled rule as a tensor of its own, not a view of its base
            count = adamw_update(
                compiled, w.detach(), g.detach() if skip is None else torch.where(skip, 0.0, g.float()),
                tuple(t.detach() for t in held_moments), scalars,
                hyper, skip, table, grad_dtype=dtype, remainder=held_remainder[0].detach() if held_remainder else None,
                seed=seed, step=step, index=index, first_index=first_index,
            )  # fmt: skip
            clipped.add_(count)

    chunked_fp64_update_(
        weight, gradient, grad_in, step, grad_norm_sq, skipped, hyper,
        apply,
        grad_dtype=dtype, chunk_bytes=chunk_bytes, found=found,
    )  # fmt: skip


def chunked_fp64_update_(
    weight: torch.Tensor,
    gradient,
    grad_in: torch.Tensor | None,
    step: torch.Tensor,
    grad_norm_sq: torch.Tensor,
    skipped: torch.Tensor,
    hyper: torch.Tensor,
    apply,
    *,
    grad_dtype: torch.dtype,
    chunk_bytes: int | None,
    found: torch.Tensor | None = None,
) -> None:
    """The skip, the step and the chunks of an update in the "fp64" arithmetic. ``gradient`` (a tensor, or
    an ``ExpertGradient`` computed by chunks of experts of at most ``chunk_bytes``) rounded to
    ``grad_dtype``, plus ``grad_in`` rounded once more; the skip decided for the whole tensor (an entry not
    finite or beyond ``rules.adamw.grad_limit(float32)``: on the device for a whole gradient, or ``found``
    given; before the first chunk otherwise); ``step`` incremented unless skipped; then ``apply(first, last,
    grad, scalars, found)`` updates experts ``first`` to ``last - 1`` from their gradient with
    ``rules.adamw.adamw_scalars`` (``found``: None, or the device flag where nothing may change);
    ``grad_norm_sq`` and ``skipped`` as the exact update's."""
    limit = grad_limit(torch.float32)

    def total_of(grad: torch.Tensor, first: int, last: int) -> torch.Tensor:
        grad = grad.to(grad_dtype)
        return grad if grad_in is None else grad_in[first:last] + grad.to(grad_in.dtype)

    chunks = gradient.chunks(chunk_bytes) if isinstance(gradient, ExpertGradient) else [(0, weight.shape[0])]
    if found is not None and len(chunks) > 1:
        raise ValueError("found= is taken with a whole gradient only")
    with torch.no_grad():
        if len(chunks) == 1:  # whole: decided on the device
            whole_grad = gradient.full() if isinstance(gradient, ExpertGradient) else gradient
            grad = total_of(whole_grad, 0, weight.shape[0])
            norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
            if found is None:  # on the CPU from the norm where it decides (one pass fewer)
                found = skip_decided(grad, norm, limit)
            step.add_((~found).float())
            scalars = adamw_scalars(step, hyper)
            apply(0, weight.shape[0], grad, scalars, found)  # a skipped update's gradient zeroed by ``apply``
            norm_sq = norm.square()
            grad_norm_sq.copy_(torch.where(found, float("inf"), norm_sq))
            skipped.add_(found.long())
            return
        largest = max(last - first for first, last in chunks)
        buffer = torch.empty_like(weight[:largest])

        def chunk_gradient(first: int, last: int) -> torch.Tensor:
            return total_of(gradient.compute(first, last, buffer[: last - first]), first, last)

        if chunked_update_skipped(gradient, chunks, chunk_gradient, grad_in, limit, grad_dtype):
            grad_norm_sq.fill_(float("inf"))
            skipped.add_(1)
            return
        step.add_(1.0)
        scalars = adamw_scalars(step, hyper)
        norm_sq = torch.zeros((), dtype=torch.float32, device=weight.device)
        for first, last in chunks:
            grad = chunk_gradient(first, last)
            norm_sq += torch.linalg.vector_norm(grad, dtype=torch.float32).square()
            apply(first, last, grad, scalars)
        grad_norm_sq.copy_(norm_sq)
