"""The expert MLP's functional entry points, :func:`moe_mlp` and :func:`grouped_mlp`: argument checks,
autocast, then the forward op with its autograd formula (``autograd/formula.py``)."""

from __future__ import annotations

import torch

from sonar_kernels.autograd import formula
from sonar_kernels.ops.validation import check_biases, check_layout, check_moe_mlp_args
from sonar_kernels.specs import SUPPORTED_DTYPES


def moe_mlp(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    activation: str = "silu",
    backend: str = "auto",
    transposed: bool = False,
    interleaved: bool = False,
    gate_up_proj_bias: torch.Tensor | None = None,
    down_proj_bias: torch.Tensor | None = None,
    gated: bool = True,
    up_proj: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated expert MLP over routed tokens: out[t] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)).

    e = top_k_index[t, j]. The weights use the Hugging Face transformers v5 layouts, so the parameters of
    a transformers experts module (``OlmoeExperts``, ``GraniteMoeExperts``, Aria's transposed ones) can
    be passed as they are; every layout is read and updated in place (no copy on the Triton backend).
    Rounding points as in docs/design.md: Hpre, the activation and each expert output are rounded to the
    dtype of ``hidden_states``; products accumulate in fp32; the combine over top_k sums in fp32.

    Args:
        hidden_states: [T, H] float32, bfloat16 or float16.
        top_k_index: [T, top_k] int32/int64 expert ids; ids outside [0, E) (expert-parallel sentinels
            such as -1 or E) are dropped: the slot contributes nothing and its weight is not read.
        top_k_weights: [T, top_k] routing weights, float32/bfloat16/float16.
        gate_up_proj: [E, 2I, H]; rows [0, I) are the gate projection, rows [I, 2I) the up projection
            (``interleaved``: rows 2i the gate, rows 2i + 1 the up projection). [E, H, 2I] when
            ``transposed`` (the 2I axis last, split the same way). dtype of hidden_states, or float32
            (master weights, rounded to the compute dtype in registers).
        down_proj: [E, H, I] ([E, I, H] when ``transposed``), dtype as gate_up_proj.
        activation: "silu" (SwiGLU), "gelu" (GeGLU with the exact erf GELU), "gelu_tanh" (GeGLU with
            the tanh approximation of the GELU, torch's ``F.gelu(approximate="tanh")``), "relu2" (the
            squared ReLU, relu(gate)^2 * up; without a gate relu(x W1^T)^2) or gpt-oss's clamped SwiGLU
            (``sonar_kernels.clamped_swiglu(alpha, limit)``, or "clamped_swiglu" for alpha 1.702 and
            limit 7.0).
        backend: "triton" (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1), "torch" (the same
            math on torch's grouped GEMM, ``sonar_kernels/ops/torch_backend/mlp.py``), or "auto" (triton on
            CUDA, torch otherwise).
        transposed: both weights stored transposed (transformers' ``is_transposed``: gpt-oss, Aria).
        interleaved: gate and up rows alternate (transformers' ``is_concatenated=False``, torchtitan's
            fused w13, gpt-oss).
        gated: False for an MLP without a gate (transformers' ``has_gate=False``: Nemotron-H):
            ``gate_up_proj`` is the up projection alone, [E, I, H] ([E, H, I] transposed), and
            A = act(x W1^T) (e.g. "relu2", the squared ReLU); not with ``interleaved`` or the clamped
            SwiGLU.
        up_proj: None, or the up projection as a tensor of its own (torchtitan's ``w3``,
            Megatron-Core's separate gate and up weights): ``gate_up_proj`` is then the gate projection
            alone, [E, I, H] ([E, H, I] when ``transposed``), and ``up_proj`` has its dtype, shape,
            strides and device. Both are read and updated in place, each with its own in-backward
            update. Not with ``interleaved``, ``gated=False`` or ``gate_up_proj_bias``.
        gate_up_proj_bias: [E, 2I] or None, added to the gate and up projections (its gate and up
            entries split as the weight's rows are: interleaved with ``interleaved``); dtype of
            gate_up_proj. gpt-oss has one.
        down_proj_bias: [E, H] or None, added to each expert's output before the routing weight
            multiplies it (transformers' gpt-oss experts); dtype of down_proj. The biases are expert
            tensors as the weights are: with an owning optimizer they are updated inside the backward
            (``sonar_kernels/ops/bias.py``), else they get their gradients.

    Under ``torch.autocast`` the GEMMs run in the autocast dtype: hidden_states is cast to it (as for
    nn.Linear); fp32 weights stay fp32 in memory and are rounded in registers.

    Returns:
        [T, H], dtype of hidden_states (the autocast dtype under autocast). Differentiable (once) in
        hidden_states, top_k_weights and both weights (a backward with ``create_graph=True`` raises
        RuntimeError); on the triton backend the backward runs Triton kernels only. A weight that carries an in-backward update (given by the optimizer that owns it,
        :class:`sonar_kernels.ExpertAdamW` or :class:`sonar_kernels.SonarAdamW`) is updated inside that
        backward and gets no gradient (see ExpertAdamW for the rules: one backward per step, one live
        graph over the weights when it runs). One ``sonar_kernels::moe_mlp_fwd`` op: torch.compile
        traces it without a graph break, ``fullgraph=True`` included (in plain eager mode the same body
        and formula run as an autograd.Function, without the op's dispatch: docs/design.md, "Forward").
    Raises:
        TypeError: a non-tensor argument or an unsupported dtype (e.g. a floating-point top_k_index), a
            layout flag that is not a bool, a bias or up_proj not of its weight's dtype.
        ValueError: shapes that disagree (H, I, E, T, top_k, in the layout given; a bias's shape),
            T * top_k >= 2**31, tensors on different devices, an unknown activation or backend, a
            clamped SwiGLU without a gate or interleaved rows without one, an up_proj whose shape or
            strides are not gate_up_proj's or that comes with interleaved, gated=False or
            gate_up_proj_bias, or backend "triton" on CPU tensors without the interpreter.
    """
    if (
        isinstance(hidden_states, torch.Tensor)
        and hidden_states.dtype in SUPPORTED_DTYPES
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
                activation=activation, backend=backend, transposed=transposed, interleaved=interleaved,
                gate_up_proj_bias=gate_up_proj_bias, down_proj_bias=down_proj_bias, gated=gated, up_proj=up_proj,
            )  # fmt: skip
    if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
        raise RuntimeError(
            "moe_mlp does not support torch.func transforms (grad, vjp, jacrev, vmap, functional_call under "
            "them): its forward and backward are custom ops without functorch rules; use torch.autograd"
        )
    layout = check_layout(transposed, interleaved, gated, separate=up_proj is not None)
    backend = check_moe_mlp_args(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        down_proj,
        activation,
        backend,
        layout,
        up_proj,
    )
    check_biases(gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias, layout)
    return formula.apply(
        hidden_states, top_k_index, top_k_weights, activation=activation, backend=backend, layout=layout,
        gate_up_proj=gate_up_proj, down_proj=down_proj, up_proj=up_proj, gate_up_proj_bias=gate_up_proj_bias,
        down_proj_bias=down_proj_bias,
    )  # fmt: skip


def grouped_mlp(
    x_sorted: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    activation: str = "silu",
    backend: str = "auto",
    transposed: bool = False,
    interleaved: bool = False,
    gated: bool = True,
    up_proj: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated expert MLP over tokens already grouped by expert (torchtitan's and Megatron-Core's experts
    interface): rows ``[c_0 + ... + c_{e-1}, c_0 + ... + c_e)`` of ``x_sorted`` go through expert ``e``,
    ``c = num_tokens_per_expert``; no routing weights, no combine (the caller scales and combines).

    The same kernels, rounding points and in-backward update as :func:`moe_mlp`: this is ``moe_mlp``
    with top_k 1, each row's expert id from the counts (computed on the device, no host sync) and routing
    weights 1, which leave every product exact.

    Args:
        x_sorted: [N, H] float32, bfloat16 or float16, rows grouped by expert in expert order.
        num_tokens_per_expert: [E] integer counts (any integer dtype, on the device of x_sorted or the
            CPU), summing to at most N: rows from the sum on (padding) belong to no expert.
        gate_up_proj, down_proj, activation, backend, transposed, interleaved, gated, up_proj: as for
            :func:`moe_mlp` ([E, 2I, H] and [E, H, I] by default; torchtitan's ``w1``, ``w2``, ``w3`` as
            ``gate_up_proj=w1, down_proj=w2, up_proj=w3``).

    Returns:
        [N, H], dtype of x_sorted: row r is expert e(r)'s output for row r of x_sorted; padding rows are
        0 (and their gradient in x_sorted is 0). Differentiable (once) in x_sorted and the weights; an expert weight with an
        in-backward update is updated in the backward, as in :func:`moe_mlp`.
    Raises:
        TypeError: a non-tensor argument, or num_tokens_per_expert not of an integer dtype.
        ValueError: num_tokens_per_expert not of shape [E] (E = gate_up_proj.shape[0]); CPU counts that
            are negative or sum to more than N; and every error of :func:`moe_mlp`.
    """
    for name, t in (("x_sorted", x_sorted), ("num_tokens_per_expert", num_tokens_per_expert),
                    ("gate_up_proj", gate_up_proj)):  # fmt: skip
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    counts = num_tokens_per_expert
    if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
        raise TypeError(f"num_tokens_per_expert must have an integer dtype, got {counts.dtype}")
    E = gate_up_proj.shape[0] if gate_up_proj.dim() == 3 else None
    if counts.dim() != 1 or (E is not None and counts.shape[0] != E):
        raise ValueError(
            f"num_tokens_per_expert must have shape [E] = [{E}] (E = gate_up_proj.shape[0]), "
            f"got {tuple(counts.shape)}"
        )
    if x_sorted.dim() != 2:
        raise ValueError(f"x_sorted must have shape [N, H], got {tuple(x_sorted.shape)}")
    N = x_sorted.shape[0]
    # Checked where it costs no device sync (CPU counts).
    if (
        counts.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and (bool((counts < 0).any()) or int(counts.sum()) > N)
    ):
        raise ValueError(
            f"num_tokens_per_expert must be >= 0 and sum to at most x_sorted.shape[0] = {N}, got "
            f"{counts.tolist()}"
        )
    # Row r belongs to the expert e with ends[e-1] <= r < ends[e]; rows from ends[E-1] on get id E, a
    # sentinel that the kernels drop.
    ends = torch.cumsum(counts.to(device=x_sorted.device, dtype=torch.int64), 0)
    rows = torch.arange(N, device=x_sorted.device)
    expert_of_row = torch.searchsorted(ends, rows, right=True).view(N, 1)
    ones = torch.ones(N, 1, dtype=x_sorted.dtype, device=x_sorted.device)
    return moe_mlp(
        x_sorted, expert_of_row, ones, gate_up_proj, down_proj, activation=activation, backend=backend,
        transposed=transposed, interleaved=interleaved, gated=gated, up_proj=up_proj,
    )  # fmt: skip
