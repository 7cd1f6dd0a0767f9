"""The causal-LM loss over token chunks (sonar-train's ``--loss-chunk-tokens``: docs/sonar-train.md; its
memory at full size: docs/distributed.md, "With the chunked loss"): transformers'
``model(input_ids, labels=input_ids).loss`` without its [T, V] tensors.

transformers' ForCausalLM forward (OLMoE, Granite MoE, Qwen3-MoE, transformers 5) computes the logits of all
T tokens, ``lm_head(hidden)`` [T, V] in the model's dtype (Granite then divides them by
``config.logits_scaling``), and its loss (``loss_utils.ForCausalLMLoss``) casts them to fp32 and runs
``cross_entropy`` over the shifted labels: three [T, V] fp32 tensors alive in the loss's backward (7 GiB at
Qwen3's vocabulary of 151,936 and 4096 tokens). Here the model's forward runs with the lm_head given no
tokens (a forward pre-hook slices its input to zero positions and keeps the last hidden states; no labels,
so transformers computes no loss, but its load-balancing loss ``aux_loss`` as always), and
:class:`ChunkedCausalLMLoss` computes the same cross entropy ``chunk`` tokens at a time: the forward keeps
no logits, the backward recomputes one chunk's logits at a time and accumulates the lm_head's gradient
into one tensor, so autograd accumulates it once (DDP's and the in-backward optimizers' hooks fire once).
An lm_head that FSDP2 shards on its own is gathered for it by a forward of the lm_head module
(tests/test_train_loss.py: DDP and FSDP2 on 2 gloo ranks against single-process training)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # transformers' ForCausalLMLoss: the last position's shifted label, and padding

# The ForCausalLM classes whose forward is "last hidden states -> lm_head -> (divide by a config field) ->
# ForCausalLMLoss, then + router_aux_loss_coef * aux_loss" (transformers 5's modeling files), by
# config.model_type: the config field the logits are divided by, or None.
LOGIT_DIVISORS = {"olmoe": None, "qwen3_moe": None, "granitemoe": "logits_scaling"}


def _chunk_loss_sum(hidden, weight, labels, divisor):
    """Summed cross entropy of one chunk, as transformers computes each token's: logits in the model's
    dtype (divided by ``divisor``), cast to fp32, ``cross_entropy`` with labels IGNORE_INDEX left out. Each
    rebinding releases the previous [chunk, V] tensor (no node saves it)."""
    logits = F.linear(hidden, weight)
    if divisor is not None:
        logits = logits / divisor
    logits = logits.float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


class ChunkedCausalLMLoss(torch.autograd.Function):
    """mean over the labelled tokens of cross_entropy(fp32(hidden @ weight^T / divisor), labels), computed
    ``chunk`` rows at a time in the forward and again in the backward (one chunk's [chunk, V] tensors
    alive at a time)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, divisor):
        count = (labels != IGNORE_INDEX).sum()  # a device tensor: no host read
        total = hidden.new_zeros((), dtype=torch.float32)
        with torch.no_grad():
            for start in range(0, hidden.shape[0], chunk):
                end = start + chunk
                total += _chunk_loss_sum(hidden[start:end], weight, labels[start:end], divisor)
        ctx.save_for_backward(hidden, weight, labels, count)
        ctx.chunk, ctx.divisor = chunk, divisor
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, count = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_sum = grad_loss / count  # the mean's gradient, reaching every chunk's sum
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = start + ctx.chunk
            inputs = [
                hidden[start:end].detach().requires_grad_(want_hidden),
                weight.detach().requires_grad_(want_weight),
            ]
            with torch.enable_grad():
                loss = _chunk_loss_sum(inputs[0], inputs[1], labels[start:end], ctx.divisor)
                grads = torch.autograd.grad(loss, [t for t in inputs if t.requires_grad], grad_sum)
            del loss
            grads = list(grads)
            if want_hidden:
                grad_hidden[start:end] = grads.pop(0)
            if want_weight:
                chunk_weight = grads.pop(0)
                grad_weight = chunk_weight if grad_weight is None else grad_weight.add_(chunk_weight)
                del chunk_weight  # not alive through the next chunk
            del grads
        return grad_hidden, grad_weight, None, None, None


def chunked_causal_lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, chunk: int, **kwargs):
    """``model(input_ids=input_ids, labels=labels, **kwargs).loss`` of a transformers ForCausalLM model with
    the cross entropy over ``chunk`` tokens at a time (:class:`ChunkedCausalLMLoss`); the load-balancing
    loss added as transformers adds it (``loss + router_aux_loss_coef * aux_loss``) when the model computes
    one. ``model`` may be a wrapper (DDP, FSDP2's module) whose ``module`` or itself is the ForCausalLM.

    Args:
        model: a transformers OLMoE, Granite MoE or Qwen3-MoE ForCausalLM (:data:`LOGIT_DIVISORS`), or DDP
            around one.
        input_ids: [B, S] int64 token ids.
        labels: [B, S] int64, IGNORE_INDEX (-100) where no loss is taken; shifted here as transformers
            shifts them (position s predicts labels[s + 1]).
        chunk: tokens (rows of the flattened [B * S] batch) per chunk, >= 1.
    Returns:
        0-dim fp32 tensor, on the model's device.
    Raises:
        TypeError: ``chunk`` not an int.
        ValueError: ``chunk`` < 1; a model whose family is not in :data:`LOGIT_DIVISORS`, or whose lm_head
            has a bias.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise TypeError(f"chunk must be an int (tokens per chunk), got {type(chunk).__name__}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 (tokens per chunk), got {chunk}")
    inner = getattr(model, "module", model)
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if model_type not in LOGIT_DIVISORS:
        raise ValueError(
            f"model: the chunked loss knows the ForCausalLM forwards of {sorted(LOGIT_DIVISORS)}, not {model_type!r}"
        )
    if getattr(inner.lm_head, "bias", None) is not None:
        raise ValueError("model: the chunked loss takes an lm_head without a bias")
    field = LOGIT_DIVISORS[model_type]
    divisor = None if field is None else getattr(inner.config, field)
    kept = []

    def no_logits(module, args):  # the last hidden states kept, the lm_head given none of them
        kept.append(args[0])
        return (args[0][..., :0, :],)

    handle = inner.lm_head.register_forward_pre_hook(no_logits)
    try:
        output = model(input_ids=input_ids, **kwargs)
    finally:
        handle.remove()
    hidden = kept[0]
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]

    rows, row_labels = hidden.reshape(-1, hidden.shape[-1]), shifted.reshape(-1)
    from torch.distributed.fsdp import FSDPModule

    if isinstance(inner.lm_head, FSDPModule):
        # An lm_head sharded by a fully_shard of its own holds its weight gathered only in its forward (and
        # again in its backward): the loss runs as a forward of that module, so FSDP2 gathers the weight
        # for it and reduce-scatters its gradient, as for transformers' own call.
        def loss_forward(rows, row_labels):
            return ChunkedCausalLMLoss.apply(rows, inner.lm_head.weight, row_labels, chunk, divisor)

        inner.lm_head.forward = loss_forward
        try:
            loss = inner.lm_head(rows, row_labels)
        finally:
            del inner.lm_head.forward
    else:
        loss = ChunkedCausalLMLoss.apply(rows, inner.lm_head.weight, row_labels, chunk, divisor)
    if getattr(output, "aux_loss", None) is not None:
        loss = loss + inner.router_aux_loss_coef * output.aux_loss.to(loss.device)
    return loss
