"""torch's AdamW on one tensor, outside the wgrad epilogue.

``torch_adamw_`` applies torch's own AdamW (``torch.optim.adamw.adamw``, with torch.optim.AdamW's foreach
and fused flags) to one tensor, skipping the update as a whole for a non-finite or too large gradient as
the Triton kernels do: the update of the torch backend, and of a gradient that reached ``.grad``, with
exact moments; ``remainder_adamw_`` the same on the fp32 master of a bf16 weight and its 16-bit remainder
(``rules/master_weights.py``). The other state kinds follow the "fp64" arithmetic:
``ops/torch_backend/fp64_update.py``.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw as torch_adamw

from sonar_kernels.ops.arithmetic import has_torch_fused_adamw, overflow_possible
from sonar_kernels.ops.common import inf_norm, skip_decided, whole
from sonar_kernels.rules.adamw import grad_limit
from sonar_kernels.rules.clipping import clip_gradient, clip_gradient_
from sonar_kernels.rules.update import remainder_merge, remainder_split_


def torch_adamw_(
    weight: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyperparameters: tuple[float | torch.Tensor, ...],
    grad_norm_sq: torch.Tensor,
    skipped: torch.Tensor,
    *,
    foreach: bool | None,
    fused: bool | None,
    clip: torch.Tensor | None = None,
    clipped: torch.Tensor | None = None,
    clip_dtype: torch.dtype | None = None,
) -> None:
    """torch's AdamW on one tensor, in place: ``weight``, ``exp_avg``, ``exp_avg_sq`` and ``step``.

    Skipped as the Triton update is (weight, moments and step unchanged, ``skipped`` + 1, norm inf) when
    ``grad`` has an entry that is NaN, infinite or beyond :func:`grad_limit` of the moments' dtype: with
    ``fused=True`` through torch's ``found_inf`` (no host sync); torch's other AdamW paths take no such
    input, so the decision is read on the host there (a sync on a GPU). ``grad_norm_sq`` receives the
    gradient's squared L2 norm.

    Args:
        hyperparameters: (lr, beta1, beta2, eps, weight_decay), each a Python float or a one-element
            tensor, as a torch.optim.AdamW parameter group holds them: passed to torch's AdamW unchanged,
            so that a tensor lr or tensor betas get torch's arithmetic for tensor values (bias corrections
            and step size computed in the tensor's dtype) as in torch.optim.AdamW.step.
        foreach, fused: torch.optim.AdamW's flags.
        clip: None, or the update's [7] float64 hyperparameter tensor with the expert-clipping entries: the
            gradient is clipped first (``rules/clipping.py``; the skip and ``grad_norm_sq`` are the unclipped
            gradient's), and ``clipped`` receives the number of entries the spike rule replaced;
            ``clip_dtype``: the dtype the clipped values are rounded to (None: ``grad``'s; the gradient
            dtype when ``grad`` holds its values widened, as for an fp32 master).
    """
    with torch.no_grad():
        norm = whole(torch.linalg.vector_norm(grad, dtype=torch.float32))
        found = skip_decided(grad, norm, grad_limit(exp_avg_sq.dtype))  # the CPU: from the norm
        norm_sq = norm.square()
        count = None
        if clip is not None:
            grad, count = clip_gradient(grad, exp_avg_sq, clip, clip_dtype)
        step_before = step.clone()
        try:
            if fused or not bool(found):
                _adamw(weight, grad, exp_avg, exp_avg_sq, step, hyperparameters, foreach, fused, found)
        except BaseException:
            # A refused update (e.g. a dtype the chosen torch kernel rejects) changes nothing.
            step.copy_(step_before)
            raise
        grad_norm_sq.copy_(torch.where(found, float("inf"), norm_sq))
        skipped.add_(found.long())
        if clipped is not None:
            if count is None:
                clipped.zero_()
            else:
                clipped.copy_(torch.where(found, 0, count))


def _adamw(weight, grad, exp_avg, exp_avg_sq, step, hyperparameters, foreach, fused, found) -> None:
    """One call of torch's AdamW on one tensor (``found``: the 0-dim bool given to the fused kernel as
    ``found_inf``; the other paths are called only when it is False)."""
    lr, beta1, beta2, eps, weight_decay = hyperparameters
    # Weight, gradient and moments of one dtype: torch's AdamW on them as they are (standard training's
    # bits). Mixed dtypes (moments_dtype, grad_dtype): the rule of the Triton epilogue (docs/design.md,
    # "Arithmetic"): all four as fp32, the arithmetic in fp32, each stored once in its own dtype.
    tensors = (weight, grad, exp_avg, exp_avg_sq)
    mixed = len({t.dtype for t in tensors}) > 1
    p, g, m, v = (t.float() for t in tensors) if mixed else tensors
    if fused and not all(t.is_contiguous() for t in (p, g, m, v)):
        # torch's fused CPU AdamW walks each tensor's storage as if it were contiguous (torch 2.13 does
        # not check): a strided operand (a bias gradient sliced from its GEMM's output) goes in as a
        # contiguous copy, and a strided weight or moment is written back from one.
        p, g, m, v = (t.contiguous() for t in (p, g, m, v))
    torch_adamw(
        [p], [g], [m], [v], [], [step],
        foreach=foreach, fused=fused, capturable=False, amsgrad=False, beta1=beta1, beta2=beta2,
        lr=lr, weight_decay=weight_decay, eps=eps, maximize=False,
        found_inf=found.float() if fused else None,
    )  # fmt: skip
    for stored, computed in ((weight, p), (exp_avg, m), (exp_avg_sq, v)):
        if computed is not stored:
            stored.copy_(computed)


def chunked_update_skipped(gradient, chunks, chunk_gradient, grad_in, limit: float, grad_dtype) -> bool:
    """Whether the update of a gradient computed by ``chunks`` of experts is skipped as a whole, decided
    before the first chunk is updated: the bound of its entries from the GEMM operands
    (:func:`overflow_possible`; also what the weight, gradient and operand dtypes hold) clears it in the
    usual case; only when it cannot, a check pass computes every chunk (``chunk_gradient(first, last)``,
    the gradient as the update would use it) and looks for an entry not finite or beyond ``limit``. Read on
    the host: chunks run on the CPU only, where that costs nothing."""
    stored = (grad_dtype, gradient.weight.dtype, *(p.dtype for p, _, _ in gradient.parts()))
    entry_limit = min([limit] + [torch.finfo(d).max for d in stored])
    if not bool(overflow_possible(gradient.bound(), grad_in, entry_limit, float("inf"))):
        return False
    return any(not bool(inf_norm(chunk_gradient(*chunk)) <= limit) for chunk in chunks)


def torch_adamw_chunked_(
    weight: torch.Tensor,
    gradient,
    grad_in: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyperparameters: tuple[float | torch.Tensor, ...],
    grad_norm_sq: torch.Tensor,
    skipped: torch.Tensor,
    *,
    grad_dtype: torch.dtype | None,
    foreach: bool | None,
    fused: bool | None,
    chunk_bytes: int | None,
    remainder: torch.Tensor | None = None,
    clip: torch.Tensor | None = None,
    clipped: torch.Tensor | None = None,
) -> None:
    """torch's AdamW on one expert tensor from its gradient computed a chunk of experts at a time: the
    torch backend's in-backward update (docs/design.md, "Which AdamW runs where").

    With ``fused`` (torch's fused AdamW) and a gradient that can be chunked
    (:meth:`sonar_kernels.ops.torch_backend.expert_gradient.ExpertGradient.chunks`), the gradient of each chunk of at
    most ``chunk_bytes`` is computed into one reused buffer and that slice of the weight and its moments
    is updated before the next chunk: the expert gradient alive at once is one chunk. Every chunk sees the
    same ``step`` (incremented once for the tensor) and each element the same arithmetic as one call over
    the whole tensor, so the result is bit for bit :func:`torch_adamw_` on the whole gradient. Otherwise
    (foreach or the for-loop asked for, a GPU, a bias) the whole gradient at once through
    :func:`torch_adamw_`.

    The skip rule holds for the tensor as a whole: decided before the first chunk is updated. A bound of
    the gradient's entries from its GEMM operands (:func:`overflow_possible`, no pass over the gradient)
    clears it in the usual case; only when the bound cannot, a check pass computes every chunk's gradient
    first. The decision is read on the host (chunks run on the CPU only, where that costs nothing).

    Args:
        gradient: an ``ExpertGradient`` of ``weight`` (ops/torch_backend/expert_gradient.py).
        grad_in: the gradient of earlier micro-batches (the weight's shape, ``grad_dtype``), or None; the
            update uses round(grad_in + round(gradient)) as autograd sums them in ``.grad``.
        grad_dtype: the gradient is rounded to it before the update (None: the weight's dtype).
        hyperparameters, foreach, fused: as :func:`torch_adamw_`.
        chunk_bytes: the budget of one chunk's gradient (None: the whole tensor).
        remainder: the int16 remainder of a bf16 ``weight`` (docs/design.md, "bf16 master weights"): the
            update runs on the fp32 master (each chunk's merged, the gradient as fp32) and
            splits it again: :func:`remainder_adamw_`, chunk by chunk.
        clip, clipped: expert clipping, as :func:`torch_adamw_` takes them (each chunk clipped against its
            slice of ``exp_avg_sq``; an element's rule reads that element alone).
    """
    clipping = {"clip": clip, "clipped": clipped}
    fp32_master = remainder is not None
    master_dtype = torch.float32 if fp32_master else weight.dtype
    chunks = (
        gradient.chunks(chunk_bytes)
        if fused and has_torch_fused_adamw(weight.device, master_dtype)
        else [(0, weight.shape[0])]
    )

    def total_of(grad: torch.Tensor, first: int, last: int) -> torch.Tensor:
        if grad_dtype is not None:
            grad = grad.to(grad_dtype)
        return grad if grad_in is None else grad_in[first:last] + grad.to(grad_in.dtype)

    if len(chunks) == 1:
        grad = total_of(gradient.full(), 0, weight.shape[0])
        if remainder is not None:
            remainder_adamw_(
                weight, remainder, grad, exp_avg, exp_avg_sq, step, hyperparameters, grad_norm_sq, skipped,
                foreach=foreach, fused=fused, **clipping,
            )  # fmt: skip
            return
        torch_adamw_(
            weight, grad, exp_avg, exp_avg_sq, step, hyperparameters, grad_norm_sq, skipped,
            foreach=foreach, fused=fused, **clipping,
        )  # fmt: skip
        return
    with torch.no_grad():
        limit = grad_limit(exp_avg_sq.dtype)
        largest = max(last - first for first, last in chunks)
        buffer = torch.empty_like(weight[:largest])

        def chunk_gradient(first: int, last: int) -> torch.Tensor:
            return total_of(gradient.compute(first, last, buffer[: last - first]), first, last)

        if chunked_update_skipped(
            gradient, chunks, chunk_gradient, grad_in, limit, grad_dtype or weight.dtype
        ):
            grad_norm_sq.fill_(float("inf"))
            skipped.add_(1)
            if clipped is not None:
                clipped.zero_()
            return
        no = torch.zeros((), dtype=torch.bool, device=weight.device)
        count = torch.zeros((), dtype=torch.int64, device=weight.device)
        chunk_step = step.clone()
        # torch's fused AdamW kernel called as torch.optim.adamw's fused path calls it, once the step is
        # incremented (the same kernel, the same arguments, without its per-call grouping of the tensors):
        # Python-float hyperparameters, one dtype, contiguous tensors. Otherwise through torch's AdamW.
        # With a remainder, the update's weight is the merged fp32 master and its gradient is made fp32.
        grad_as = torch.float32 if fp32_master else buffer.dtype
        direct = (
            hasattr(torch, "_fused_adamw_")
            and all(isinstance(h, float) for h in hyperparameters)
            and len({master_dtype, grad_as, exp_avg.dtype, exp_avg_sq.dtype}) == 1
            and (fp32_master or (grad_dtype or weight.dtype) == weight.dtype)
            and all(t.is_contiguous() for t in (weight, buffer, exp_avg, exp_avg_sq))
        )
        if direct:
            chunk_step.add_(1)
        lr, beta1, beta2, eps, weight_decay = hyperparameters
        norm_sq = torch.zeros((), dtype=torch.float32, device=weight.device)
        for first, last in chunks:
            grad = chunk_gradient(first, last)
            if grad.dtype == torch.float32 and grad.is_contiguous():  # BLAS's dot: about twice as fast here
                flat = grad.view(-1)
                norm_sq += torch.dot(flat, flat)
            else:
                norm_sq += torch.linalg.vector_norm(grad, dtype=torch.float32).square()
            if clip is not None:  # in place on the chunk's own gradient, a slice at a time
                count += clip_gradient_(grad, exp_avg_sq[first:last], clip)
            target = weight[first:last]
            if remainder is not None:
                compiled = remainder_merge.wanted(target.numel(), target.device)
                target, grad = (
                    remainder_merge(compiled, target.detach(), remainder[first:last].detach()),
                    grad.float(),
                )
            if direct:
                torch._fused_adamw_(
                    [target], [grad], [exp_avg[first:last]], [exp_avg_sq[first:last]], [], [chunk_step],
                    amsgrad=False, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                    maximize=False, grad_scale=None, found_inf=None,
                )  # fmt: skip
            else:
                chunk_step.copy_(step)  # each chunk's call increments its own copy of the step
                _adamw(
                    target, grad, exp_avg[first:last], exp_avg_sq[first:last], chunk_step,
                    hyperparameters, foreach, fused, no,
                )  # fmt: skip
            if remainder is not None:
                remainder_split_(
                    compiled, target, weight[first:last].detach(), remainder[first:last].detach()
                )
        step.copy_(chunk_step)
        grad_norm_sq.copy_(norm_sq)
        if clipped is not None:
            clipped.copy_(count)


def remainder_adamw_(
    weight: torch.Tensor,
    remainder: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyperparameters: tuple,
    grad_norm_sq: torch.Tensor,
    skipped: torch.Tensor,
    *,
    foreach: bool | None,
    fused: bool | None,
    clip: torch.Tensor | None = None,
    clipped: torch.Tensor | None = None,
) -> None:
    """torch's AdamW on the fp32 master of a bf16 ``weight`` and its int16 ``remainder``, in place: the
    master merged (``rules.master_weights.merge``), updated by :func:`torch_adamw_` with ``grad``
    as fp32 (the moments fp32, or bf16: then torch's AdamW on fp32 copies, each moment rounded once at
    the store), and split again (``rules.master_weights.split``). So the master follows torch.optim.AdamW on fp32 master
    weights bit for bit (fp32 moments), and the weight is the master rounded to nearest (a tie away from
    zero). A skipped update (a non-finite gradient) leaves weight, remainder, moments and step as they
    were. Temporaries: the master and the gradient in fp32 (the caller chunks large tensors). A DTensor
    weight (FSDP2's shard; remainder, gradient and moments DTensors of its placements): each rank merges and
    splits its own shard, torch's AdamW runs on the sharded master (the skip decided over the whole
    gradient). ``clip``, ``clipped``: expert clipping (:func:`torch_adamw_`), the
    clipped values rounded to ``grad``'s dtype."""
    with torch.no_grad():
        local_weight, local_remainder = _local(weight), _local(remainder)
        compiled = remainder_merge.wanted(local_weight.numel(), local_weight.device)
        master = remainder_merge(compiled, local_weight, local_remainder)
        if _is_dtensor(weight):  # FSDP2's shard: the master sharded as the weight
            from torch.distributed.tensor import DTensor

            master = DTensor.from_local(
                master, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
                stride=weight.stride(),
            )  # fmt: skip
        torch_adamw_(
            master, grad.float(), exp_avg, exp_avg_sq, step, hyperparameters, grad_norm_sq, skipped,
            foreach=foreach, fused=fused, clip=clip, clipped=clipped, clip_dtype=grad.dtype,
        )  # fmt: skip
        remainder_split_(compiled, _local(master), local_weight, local_remainder)


def _is_dtensor(t) -> bool:
    return callable(getattr(t, "to_local", None))


def _local(t):
    """This rank's part of a DTensor (FSDP2's shard); any other tensor as it is."""
    return t.to_local() if _is_dtensor(t) else t
