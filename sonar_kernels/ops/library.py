"""The ``sonar_kernels::`` custom ops (torch.library): the forward; the backward as its jobs, what a layer
computes once (``moe_mlp_bwd``: dHpre, A, the routing-weight gradient, dX) and one op per expert tensor
for its gradient and what happens to it (``expert_wgrad``: returned; ``expert_wgrad_``: the in-backward
AdamW update, or added to a buffer); and the standalone AdamW update of one expert tensor. Each has a
fake (meta) implementation beside it, so torch.compile traces them as single ops with static shapes;
the forward's autograd formula is registered by ``sonar_kernels.autograd``.

Both backends run behind the same ops, each a module with the same functions (:data:`BACKEND_MODULES`:
``ops/triton_backend``, the Triton launchers; ``ops/torch_backend``, torch's GEMMs).
An update's mutable tensors travel as one list in the order of ``update_state.UpdateState.tensors`` (an
empty list means "no update"); its hyperparameter tensor, which the update only reads and which every tensor of a
parameter group shares, travels apart, so that an update does not bump its version counter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sonar_kernels import specs
from sonar_kernels.ops import torch_backend, triton_backend
from sonar_kernels.ops.torch_backend.update import torch_update
from sonar_kernels.ops.validation import check_master_state
from sonar_kernels.specs import RoutingMetadata

# The backends by name (specs.BACKENDS), each a module with the same functions: moe_mlp_fwd,
# moe_mlp_bwd_core, check_expert_wgrad, run_expert_wgrad, core_rows and magnitudes_numel.
BACKEND_MODULES = {"triton": triton_backend, "torch": torch_backend}

# What the backward does with a weight's gradient: return it, apply the update (the state is given),
# or add it to an accumulation buffer.
MODES = ("grad", "update", "accumulate")


# The gradient dtypes of the forward's ``grad_dtypes``, by code (-1: None, the weight's dtype).
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grad_dtype_code(dtype: torch.dtype | None) -> int:
    """The code of ``dtype`` in the forward's ``grad_dtypes`` (:data:`GRAD_DTYPES`; -1 for None)."""
    return -1 if dtype is None else GRAD_DTYPES.index(dtype)


def grad_dtype_of(code: int) -> torch.dtype | None:
    return None if code < 0 else GRAD_DTYPES[code]


@torch.library.custom_op("sonar_kernels::moe_mlp_fwd", mutates_args=())
def moe_mlp_fwd(
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    up_proj: Tensor | None,
    gate_up_proj_bias: Tensor | None,
    down_proj_bias: Tensor | None,
    activation: str,
    backend: str,
    layout: str,
    states: list[Tensor],
    state_sizes: list[int],
    hypers: list[Tensor | None],
    grad_dtypes: list[int],
    fused_epilogue: bool | None,
    foreach: bool | None,
    torch_fused: bool | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gated expert MLP's forward: (out [T, H], Hpre [S, 2I], then the five tensors of
    :class:`RoutingMetadata`). ``layout``: the weights' (:data:`sonar_kernels.specs.LAYOUTS`);
    ``up_proj``: the up tensor of a separate layout, or None; the biases: [E, 2I] and [E, H], or None.

    The rest are inputs only so that the registered backward receives them, per expert tensor in the
    order of :data:`sonar_kernels.specs.EXPERT_TENSORS`: its in-backward update's state (``state_sizes``
    tensors of ``states`` each, in ``UpdateState.tensors``' order; none: no update), its hyperparameter tensor
    (or None) and its gradient dtype (:func:`grad_dtype_code`); and the update options of the layer (the
    fused epilogue or its split path, torch AdamW's foreach and fused flags)."""
    return moe_mlp_fwd_body(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, up_proj, gate_up_proj_bias,
        down_proj_bias, activation, backend, layout,
    )  # fmt: skip


def moe_mlp_fwd_body(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, up_proj, gate_up_proj_bias, down_proj_bias,
    activation, backend, layout, *update_inputs,
):  # fmt: skip
    """:func:`moe_mlp_fwd` as a plain function of the op's inputs (the autograd layer's eager path calls it
    without the op's dispatch)."""
    return run_moe_mlp_fwd(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, backend, layout,
        gate_up_proj_bias, down_proj_bias, up_proj,
    )  # fmt: skip


def run_moe_mlp_fwd(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, backend, layout="concatenated",
    gate_up_proj_bias=None, down_proj_bias=None, up_proj=None,
):  # fmt: skip
    """The body of :func:`moe_mlp_fwd`: the launchers of ``backend``."""
    out, hpre, meta = BACKEND_MODULES[backend].moe_mlp_fwd(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, layout, gate_up_proj_bias,
        down_proj_bias, up_proj,
    )  # fmt: skip
    return (out, hpre, *meta)


@moe_mlp_fwd.register_fake
def _moe_mlp_fwd_fake(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, up_proj, gate_up_proj_bias, down_proj_bias,
    activation, backend, layout, *update_inputs,
):  # fmt: skip
    T, H = hidden_states.shape
    S = T * top_k_index.shape[1]
    E, I = gate_up_proj.shape[0], specs.down_view(down_proj, layout).shape[2]
    two_I = (2 if specs.is_gated(layout) else 1) * I  # Hpre's width
    index = {"dtype": torch.int32, "device": hidden_states.device}
    return (
        hidden_states.new_empty(T, H),
        hidden_states.new_empty(S, two_I),
        torch.empty(E + 1, **index),
        torch.empty(E + 1, **index),
        torch.empty(S, **index),
        torch.empty(S, **index),
        torch.empty(S, **index),
    )


# moe_mlp_bwd's needs, in order.
CORE_NEEDS = ("hidden_states", "top_k_weights", "grad_hpre", "a", "magnitudes")


@torch.library.custom_op("sonar_kernels::moe_mlp_bwd", mutates_args=())
def moe_mlp_bwd(
    grad_out: Tensor,
    hidden_states: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    up_proj: Tensor | None,
    down_proj_bias: Tensor | None,
    hpre: Tensor,
    meta: list[Tensor],
    needs: list[bool],
    activation: str,
    backend: str,
    layout: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """What the layer's backward computes once, before the expert tensors' gradients
    (:func:`expert_wgrad`, :func:`expert_wgrad_`): (grad hidden_states [T, H], grad top_k_weights
    [T, top_k], dHpre [S, 2I], A [S, I], the magnitudes [n] float32 that bound an updated tensor's
    gradient on the Triton backend, ``ops/triton_backend/update_bound.py``), each an empty tensor where ``needs`` (in
    :data:`CORE_NEEDS` order) says no (the magnitudes are always empty on the torch backend). ``meta``: the five tensors of
    :class:`RoutingMetadata`. Reads W2 (dHpre, A and the routing-weight gradient, with G = dO[token] @
    W2[e]) and W1 (dX); writes no input."""
    grads = run_moe_mlp_bwd(
        grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, up_proj, down_proj_bias, hpre, meta, needs,
        activation, backend, layout,
    )  # fmt: skip
    # A distinct empty tensor per missing output: a custom op's outputs may not alias each other.
    return tuple(hidden_states.new_empty(0) if g is None else g for g in grads)


def run_moe_mlp_bwd(
    grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, up_proj, down_proj_bias, hpre, meta, needs,
    activation, backend, layout, hpre_writable=False,
):  # fmt: skip
    """The body of :func:`moe_mlp_bwd`: a :class:`~sonar_kernels.specs.BackwardCore`, None for each output not needed; ``hpre_writable`` (eager mode,
    the torch backend): dHpre may be written over ``hpre``, which the caller will not read again (the
    graph is freed after this backward; ``torch_backend.mlp.moe_mlp_bwd_core``)."""
    return BACKEND_MODULES[backend].moe_mlp_bwd_core(
        grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, hpre, RoutingMetadata(*meta), activation,
        tuple(needs), layout=layout, down_proj_bias=down_proj_bias, up_proj=up_proj, hpre_writable=hpre_writable,
    )  # fmt: skip


@moe_mlp_bwd.register_fake
def _moe_mlp_bwd_fake(
    grad_out, hidden_states, top_k_weights, gate_up_proj, down_proj, up_proj, down_proj_bias, hpre, meta, needs,
    activation, backend, layout,
):  # fmt: skip
    need_x, need_w, need_dhpre, need_a, need_magnitudes = needs
    room = BACKEND_MODULES[backend]
    rows = room.core_rows(hpre.shape[0])
    magnitudes = room.magnitudes_numel(hidden_states.shape[0])  # None: the backend has none
    I = specs.down_view(down_proj, layout).shape[2]
    shapes = (
        (need_x, hidden_states.shape, hidden_states.dtype),
        (need_w, top_k_weights.shape, top_k_weights.dtype),
        (need_dhpre, (rows, hpre.shape[1]), hpre.dtype),
        (need_a, (rows, I), hpre.dtype),
        (need_magnitudes and magnitudes is not None, (magnitudes,), torch.float32),
    )
    return tuple(
        hidden_states.new_empty(shape, dtype=dtype) if need else hidden_states.new_empty(0)
        for need, shape, dtype in shapes
    )


@torch.library.custom_op("sonar_kernels::expert_wgrad", mutates_args=())
def expert_wgrad(
    name: str,
    weight: Tensor,
    p: Tensor,
    q: Tensor | None,
    top_k_weights: Tensor,
    meta: list[Tensor],
    backend: str,
    layout: str,
) -> Tensor:
    """The gradient of the expert tensor ``name`` (``weight``; one of
    :data:`sonar_kernels.specs.EXPERT_TENSORS`), the weight's shape and dtype, from the operands of
    :func:`moe_mlp_bwd` (``p``: dO, or dHpre or its gate or up half; ``q``: A, X, or None for a bias; see
    ``torch_backend.wgrad.expert_gradient``). Mutates nothing, so another saved use of the weight (a penalty
    computed before the MLP) still runs after this backward."""
    return run_expert_grad(name, weight, p, q, top_k_weights, meta, backend, layout)


def run_expert_grad(name, weight, p, q, top_k_weights, meta, backend, layout) -> Tensor:
    """The body of :func:`expert_wgrad`: :func:`run_expert_wgrad` in mode "grad"."""
    return run_expert_wgrad(
        name,
        weight,
        p,
        q,
        top_k_weights,
        meta,
        mode="grad",
        state=[],
        hyper=None,
        backend=backend,
        layout=layout,
    )


@expert_wgrad.register_fake
def _expert_wgrad_fake(name, weight, p, q, top_k_weights, meta, backend, layout):
    return torch.empty_like(weight)


@torch.library.custom_op("sonar_kernels::expert_wgrad_", mutates_args=("weight", "state", "buffer"))
def expert_wgrad_(
    name: str,
    weight: Tensor,
    p: Tensor,
    q: Tensor | None,
    top_k_weights: Tensor,
    meta: list[Tensor],
    magnitudes: Tensor | None,
    wgrad_mode: str,
    state: list[Tensor],
    hyper: Tensor | None,
    buffer: Tensor | None,
    buffer_add: bool,
    grad_dtype: torch.dtype | None,
    fused_epilogue: bool | None,
    foreach: bool | None,
    torch_fused: bool | None,
    backend: str,
    layout: str,
) -> None:
    """The gradient of the expert tensor ``name`` (operands as for :func:`expert_wgrad`) applied in place:
    ``wgrad_mode`` (not ``mode``, a keyword of torch's auto-functionalization) "update": AdamW on ``weight`` and its ``state`` (``UpdateState.tensors``' order; ``hyper`` its [5]
    float64 hyperparameters, [7] with expert clipping), with ``buffer`` (the gradient of earlier micro-batches, or None) added to
    this backward's gradient first: on the Triton backend in the wgrad epilogue (or its split path with
    ``fused_epilogue=False``; ``magnitudes`` from :func:`moe_mlp_bwd` bound the gradient), on the torch
    backend by torch's AdamW (``foreach``, ``torch_fused``: its flags; the body of :func:`expert_adamw_`),
    the gradient computed and applied by chunks of experts. "accumulate" (Triton backend only): the
    gradient added to ``buffer`` (``buffer_add``) or written into it. ``grad_dtype``: the gradient is
    rounded to it before the update (None: the weight's dtype)."""
    run_expert_wgrad(
        name, weight, p, q, top_k_weights, meta, magnitudes=magnitudes, mode=wgrad_mode, state=state, hyper=hyper,
        buffer=buffer, buffer_add=buffer_add, grad_dtype=grad_dtype, fused_epilogue=fused_epilogue, foreach=foreach,
        torch_fused=torch_fused, backend=backend, layout=layout,
    )  # fmt: skip


@expert_wgrad_.register_fake
def _expert_wgrad_fake_(name, weight, p, q, top_k_weights, meta, *plan):
    return None


def check_expert_wgrad(
    name,
    weight,
    mode,
    state,
    hyper,
    buffer,
    buffer_add,
    grad_dtype,
    fused_epilogue,
    backend,
    layout="concatenated",
):
    """Raise TypeError or ValueError when the plan of :func:`expert_wgrad_` cannot apply to ``weight``
    (an update's state, ``ops.validation.check_master_state``; then the backend's checks, the Triton
    backend's in ``ops.triton_backend.wgrad.check_wgrad``); the autograd layer checks every expert tensor's
    plan before the first one runs."""
    if mode == "update":
        check_master_state(name, weight, state)
    BACKEND_MODULES[backend].check_expert_wgrad(
        name, weight, mode, state, hyper, buffer, buffer_add, grad_dtype, fused_epilogue, layout
    )


def run_expert_wgrad(
    name, weight, p, q, top_k_weights, meta, *, mode, state, hyper, backend, layout, magnitudes=None, buffer=None,
    buffer_add=False, grad_dtype=None, fused_epilogue=None, foreach=None, torch_fused=None, value=None,
):  # fmt: skip
    """The body of :func:`expert_wgrad_` (and, with ``mode`` "grad", of :func:`expert_wgrad`: returns the
    gradient; else None), its plan by keyword, callable in eager mode with ``value``: None or the
    hyperparameters as the owner's parameter group holds them (``specs.ExpertUpdate.hyperparameters``),
    which the torch backend's AdamW then takes in place of the values of ``hyper`` (torch's arithmetic for
    tensor lr and betas). Returns once the update is applied or the buffer written (the caller records it
    then, before any later launch). Mutated tensors' version counters are the caller's to bump here (the op
    bumps them)."""
    return BACKEND_MODULES[backend].run_expert_wgrad(
        name, weight, p, q, top_k_weights, RoutingMetadata(*meta), mode=mode, state=state, hyper=hyper,
        layout=layout, magnitudes=magnitudes, buffer=buffer, buffer_add=buffer_add, grad_dtype=grad_dtype,
        fused_epilogue=fused_epilogue, foreach=foreach, torch_fused=torch_fused, value=value,
    )  # fmt: skip


@torch.library.custom_op("sonar_kernels::expert_adamw_", mutates_args=("weight", "state"))
def expert_adamw_(
    weight: Tensor,
    grad: Tensor,
    grad_in: Tensor | None,
    state: list[Tensor],
    hyper: Tensor,
    foreach: bool | None,
    fused: bool | None,
) -> None:
    """torch's AdamW on one expert tensor, in place (weight, exp_avg, exp_avg_sq, step, the gradient's
    squared norm and the skip counter; ``state`` in ``UpdateState.tensors``' order), from ``grad``
    plus ``grad_in`` (earlier micro-batches, or None) summed in grad_in's dtype, as autograd sums them in
    ``.grad``. Skipped as a whole for a non-finite or too large gradient (see
    :func:`sonar_kernels.ops.torch_backend.adamw.torch_adamw_`). The hyperparameters are read from ``hyper``
    ([5] float64, :data:`sonar_kernels.specs.HYPERPARAMETERS`) on the host (a sync on a GPU; the Triton
    backend reads them in its kernels)."""
    torch_update(weight, state, hyper, grad_in, foreach, fused, grad)


@expert_adamw_.register_fake
def _expert_adamw_fake(weight, grad, grad_in, state, hyper, foreach, fused):
    return None


def gradient_request(node, weight: Tensor) -> tuple[object, str]:
    """What the running backward does with the gradient of the leaf ``weight``, read from the engine at
    ``node`` (the backward node running now): (its AccumulateGrad node among ``node``'s next functions,
    or None when there is none, e.g. the weight is not a leaf; and one of "accumulate" (the gradient
    reaches .grad), "capture" (``torch.autograd.grad`` returns it to the caller and nothing is
    accumulated), "none" (the backward does not compute it: ``autograd.grad`` or ``backward(inputs=)``
    without it)). "accumulate" when there is no AccumulateGrad node: the gradient flows on."""
    for fn, _ in node.next_functions:
        variable = getattr(fn, "variable", None)
        if variable is not None and _same_tensor(variable, weight):
            try:
                return fn, ("accumulate" if torch._C._will_engine_execute_node(fn) else "none")
            except RuntimeError:
                # The engine refuses the question for a leaf whose gradient torch.autograd.grad captures.
                return fn, "capture"
    return None, "accumulate"


@torch.library.custom_op("sonar_kernels::check_update_requested", mutates_args=("step",))
def check_update_requested(weight: Tensor, step: Tensor, name: str) -> None:
    """Raise RuntimeError when the running backward does not accumulate the gradient of ``weight``, or of
    any other expert tensor with an in-backward update among the inputs of the compiled graph it runs in
    (``torch.autograd.grad`` or ``backward(inputs=...)`` without it, or ``torch.autograd.grad`` that
    returns it), which an in-backward update inside a compiled backward would otherwise consume. Checking
    every such input at the first check of the backward refuses a backward that asks for some layers'
    weights and not others before any layer's update.
    Then records the update with the owner of ``weight`` (``specs.ExpertUpdate.compiled_update``), which
    raises first when the tensor was already updated since the last ``step()``.
    Runs in Python inside the compiled backward, before the update (it is declared to mutate the
    update's ``step`` so that the graph keeps it there, ahead of the backward op that updates it; it
    writes no tensor). Eager backwards check this without the op (``sonar_kernels.autograd``)."""
    node = torch._C._current_autograd_node()
    if node is not None:  # None outside the engine's run of a node (compiled autograd): nothing to read
        _check_requested(node, weight, name)
    # Recorded with the owner (its norm and step bookkeeping): a second update before step(), or a
    # gradient that reaches .grad after this update (another use of the tensor outside the compiled
    # graph), then raises.
    update = specs.update_of(weight)
    if update is not None:
        update.compiled_update()


def _check_requested(node, weight: Tensor, name: str) -> None:
    checked = [(weight, name)] + [
        (fn.variable, "an expert tensor of this compiled graph")
        for fn, _ in node.next_functions
        if _updated_in_backward(getattr(fn, "variable", None))
    ]
    for tensor, what in checked:
        _, request = gradient_request(node, tensor)
        if request != "accumulate":
            verb = (
                "returns to its caller the gradient of"
                if request == "capture"
                else "does not compute the gradient of"
            )
            raise RuntimeError(
                f"{what}: this backward {verb} the expert tensor of shape {tuple(tensor.shape)}, and the compiled "
                "backward would update it in place; nothing was updated. Under torch.compile, run backward() "
                "over the expert weights, or run this backward without torch.compile"
            )


def _updated_in_backward(t) -> bool:
    update = None if t is None else specs.update_of(t)
    return update is not None and not update.reduce_first


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    return a is b or (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


@check_update_requested.register_fake
def _check_update_requested_fake(weight, step, name):
    return None
