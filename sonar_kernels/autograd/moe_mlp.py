"""The expert MLP as a torch.autograd.Function, and the functional entry point :func:`moe_mlp`."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from sonar_kernels import ops, reference


class MoEMLPFunction(torch.autograd.Function):
    """Triton forward of the gated expert MLP.

    The backward recomputes the forward with :func:`sonar_kernels.reference.moe_mlp` (plain PyTorch ops)
    and differentiates it, so every input the forward accepts gets its gradient; the Triton backward
    with the fused AdamW epilogue replaces it.
    """

    @staticmethod
    def forward(ctx, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation):
        out, _, _ = ops.moe_mlp_fwd(
            hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation
        )
        ctx.save_for_backward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
        ctx.activation = activation
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj = ctx.saved_tensors
        differentiable = {0: hidden_states, 2: top_k_weights, 3: gate_up_proj, 4: down_proj}
        wanted = [i for i in differentiable if ctx.needs_input_grad[i]]
        inputs = {i: t.detach().requires_grad_(i in wanted) for i, t in differentiable.items()}
        with torch.enable_grad(), torch.autocast(hidden_states.device.type, enabled=False):
            out = reference.moe_mlp(
                inputs[0], top_k_index, inputs[2], inputs[3], inputs[4], activation=ctx.activation
            )
            # allow_unused: with every slot dropped (or T = 0) nothing reaches the inputs; their
            # gradient is zero, returned as None.
            grads = torch.autograd.grad(out, [inputs[i] for i in wanted], grad_out, allow_unused=True)
        result = [None] * 6
        for i, g in zip(wanted, grads, strict=True):
            result[i] = g
        return tuple(result)


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
        hidden_states, top_k_weights and both weights.
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
