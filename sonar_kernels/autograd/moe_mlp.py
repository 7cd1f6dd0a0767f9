"""The expert MLP as a torch.autograd.Function, and the functional entry point :func:`moe_mlp`."""

from __future__ import annotations

import functools
import weakref

import torch
from torch.autograd.function import once_differentiable
from torch.utils.weak import WeakIdKeyDictionary

from sonar_kernels import ops, reference
from sonar_kernels.optim.in_backward import expert_optimizer
from sonar_kernels.specs import RoutingMetadata

# Expert tensor with an in-backward optimizer -> the contexts of the live graphs that will update it.
_LIVE_CONTEXTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _check_single_live_graph(weight: torch.Tensor, name: str, ctx) -> None:
    """Refuse to update ``weight`` while another live graph also reads it: that graph's backward would
    compute its gradient from the already updated weight."""
    contexts = _LIVE_CONTEXTS.get(weight)
    if contexts is None:
        return
    contexts.discard(ctx)
    if len(contexts):
        raise RuntimeError(
            f"{name}: {len(contexts)} other live autograd graph(s) use this expert tensor, which ExpertAdamW "
            "updates in this backward; their backward would then see the updated weights. Call the experts "
            "once per forward (or once per backward), or free the other graph first."
        )


class MoEMLPFunction(torch.autograd.Function):
    """The gated expert MLP with Triton forward and backward, and the in-backward AdamW update.

    Forward: routing metadata, up-projection + GLU, down-projection, combine (:func:`ops.moe_mlp_fwd`);
    it saves Hpre [S, 2I] and the routing metadata, not the expert outputs.
    Backward (:func:`ops.moe_mlp_bwd`): dX, d top_k_weights, and for each expert weight either its
    gradient or, when an :class:`sonar_kernels.ExpertAdamW` manages it, the AdamW update applied in the
    wgrad epilogue (its gradient is then None).
    """

    @staticmethod
    def forward(ctx, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation):
        out, hpre, meta = ops.moe_mlp_fwd(
            hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation
        )
        ctx.save_for_backward(hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, *meta)
        ctx.activation = activation
        # The optimizer is looked up now, on the tensors passed in (saved tensors may come back as
        # other objects, e.g. under activation checkpointing); the contexts are tracked weakly, so a
        # graph that is discarded without a backward stops counting.
        ctx.managed = {}
        for index, weight in ((3, gate_up_proj), (4, down_proj)):
            if ctx.needs_input_grad[index] and expert_optimizer(weight) is not None:
                ctx.managed[index] = weight
                _LIVE_CONTEXTS.setdefault(weight, weakref.WeakSet()).add(ctx)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        names = {3: "gate_up_proj", 4: "down_proj"}
        # Before the saved tensors are unpacked (which may recompute the forward under checkpointing).
        for index, weight in ctx.managed.items():
            _check_single_live_graph(weight, names[index], ctx)
        hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, *meta = ctx.saved_tensors
        updates, accumulators = {}, {}
        for index, weight in ctx.managed.items():
            optimizer = expert_optimizer(weight)
            if optimizer is None:
                continue
            if optimizer._accumulating(weight):
                # Micro-batches before the last of a gradient-accumulation window: the gradient goes to
                # .grad (returned to autograd) or to the optimizer's buffer of its grad_dtype.
                accumulator = optimizer._accumulator_for(weight)
                if accumulator is not None:
                    accumulators[index] = accumulator
            else:
                # Recorded (and version counters bumped) as soon as that weight's launch is done.
                update = optimizer._update_for(weight)
                updates[index] = update._replace(on_done=functools.partial(optimizer._finish_update, weight))
        needs = ctx.needs_input_grad
        grad_x, grad_w, grad_w1, grad_w2 = ops.moe_mlp_bwd(
            grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre,
            RoutingMetadata(*meta), ctx.activation, (needs[0], needs[2], needs[3], needs[4]),
            gate_up_proj_update=updates.get(3), down_proj_update=updates.get(4),
            gate_up_proj_accumulator=accumulators.get(3), down_proj_accumulator=accumulators.get(4),
        )  # fmt: skip
        return grad_x, None, grad_w, grad_w1, grad_w2, None


def moe_mlp(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    activation: str = "silu",
    backend: str = "auto",
) -> torch.Tensor:
    """Gated expert MLP over routed tokens: out[t] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)).

    e = top_k_index[t, j]. The weights use the Hugging Face transformers v5 layout, so the parameters of
    a transformers experts module (``OlmoeExperts``, ``GraniteMoeExperts``) can be passed as they are.
    Rounding points as in DESIGN.md: Hpre, the activation and each expert output are rounded to the
    dtype of ``hidden_states``; products accumulate in fp32; the combine over top_k sums in fp32.

    Args:
        hidden_states: [T, H] float32, bfloat16 or float16.
        top_k_index: [T, top_k] int32/int64 expert ids; ids outside [0, E) (expert-parallel sentinels
            such as -1 or E) are dropped: the slot contributes nothing and its weight is not read.
        top_k_weights: [T, top_k] routing weights, float32/bfloat16/float16.
        gate_up_proj: [E, 2I, H]; rows [0, I) are the gate projection, rows [I, 2I) the up projection.
            dtype of hidden_states, or float32 (master weights, rounded to the compute dtype in registers).
        down_proj: [E, H, I], dtype as gate_up_proj.
        activation: "silu" (SwiGLU) or "gelu" (GeGLU with the exact erf GELU).
        backend: "triton" (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1), "torch" (the
            pure-PyTorch reference), or "auto" (triton on CUDA, torch otherwise).

    Under ``torch.autocast`` the GEMMs run in the autocast dtype: hidden_states is cast to it (as for
    nn.Linear); fp32 weights stay fp32 in memory and are rounded in registers.

    Returns:
        [T, H], dtype of hidden_states (the autocast dtype under autocast). Differentiable (once) in
        hidden_states, top_k_weights and both weights; on the triton backend the backward runs Triton
        kernels only. A weight managed by :class:`sonar_kernels.ExpertAdamW` is updated inside that
        backward and gets no gradient (see ExpertAdamW for the rules: one backward per step, one live
        graph over the weights when it runs).
    Raises:
        TypeError: a non-tensor argument or an unsupported dtype (e.g. a floating-point top_k_index).
        ValueError: shapes that disagree (H, I, E, T, top_k), T * top_k >= 2**31, tensors on
            different devices, an unknown activation or backend, or backend "triton" on CPU tensors
            without the interpreter.
    """
    if (
        isinstance(hidden_states, torch.Tensor)
        and hidden_states.dtype in ops.SUPPORTED_DTYPES
        and hidden_states.device.type in ("cuda", "cpu")
        and torch.is_autocast_enabled(hidden_states.device.type)
    ):
        # Under torch.autocast the expert GEMMs run in the autocast dtype, as nn.Linear's would: the
        # activations are cast; weights of another dtype (fp32 master weights) are rounded in registers.
        device_type = hidden_states.device.type
        hidden_states = hidden_states.to(torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type, enabled=False):
            return moe_mlp(
                hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                activation=activation, backend=backend,
            )  # fmt: skip
    backend = ops.check_moe_mlp_args(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, backend
    )
    if backend == "torch":
        return reference.moe_mlp(
            hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation=activation
        )
    return MoEMLPFunction.apply(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation
    )
