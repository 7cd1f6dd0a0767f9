"""The transformers experts modules as the sonar kernels run them: which modules and layouts they take
(:func:`check_experts_module`, :func:`layout_of`), the ``experts_implementation="sonar"`` forward
(:func:`sonar_experts_forward`), the backend per module (:func:`set_backend`) and expert parallelism
(:func:`shard_experts`). Registration with transformers, its Trainer and checkpoints is
``integrations/transformers.py``."""

from __future__ import annotations

import functools

import torch
from torch import nn

from sonar_kernels.autograd.moe_mlp import moe_mlp
from sonar_kernels.nn.expert_parallel import expert_parallel_moe_mlp, resolve_ep_group
from sonar_kernels.nn.fsdp_guard import check_not_fsdp_managed
from sonar_kernels.ops.torch_backend.glu import glu
from sonar_kernels.ops.validation import check_moe_mlp_args
from sonar_kernels.optim.ownership import claim_expert_tensors
from sonar_kernels.specs import (
    BACKENDS,
    clamped_swiglu,
    expert_tensors_of,
    expert_weight_names,
    is_experts_module,
    is_real_number,
    layout_name,
    mark_expert_parallel,
    mark_expert_tensors,
)

# transformers' hidden_act names -> the kernels' activations. The tanh GELU comes in four implementations
# of one formula, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): torch's (gelu_pytorch_tanh), in Python
# (gelu_python_tanh, gelu_new) and factored (gelu_fast); they differ by rounding only.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu2": "relu2",
}
# The layout flags of @use_experts_implementation that the kernels need at one value. is_transposed,
# is_concatenated, has_gate and has_bias may take either (moe_mlp's ``transposed``, ``interleaved``
# (negated), ``gated`` and its biases).
LAYOUT = {
    "has_post_expert_norm": False,
}
# The custom _apply_gate functions the kernels run: gpt-oss's clamped SwiGLU (its experts interleave gate
# and up) and the same formula on concatenated halves (OpenAI's privacy filter), both reading the module's
# ``alpha`` and ``limit``. Each is also checked against the kernels' formula on a probe when it is met.
CLAMPED_SWIGLU_GATES = (
    "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts._apply_gate",
    "transformers.models.openai_privacy_filter.modeling_openai_privacy_filter.OpenAIPrivacyFilterExperts._apply_gate",
)
# The attribute of an experts module that picks its moe_mlp backend (default "auto").
BACKEND_ATTRIBUTE = "sonar_backend"
# The attributes of an experts module sharded by shard_experts: its process group, its global expert count.
EP_GROUP_ATTRIBUTE = "sonar_ep_group"
EP_EXPERTS_ATTRIBUTE = "sonar_num_experts"


def set_backend(model: nn.Module, backend: str) -> nn.Module:
    """Choose the :func:`sonar_kernels.moe_mlp` backend of the experts modules in ``model`` (or of
    ``model`` itself, an experts module): "auto" (Triton on CUDA, the torch backend otherwise, also the
    default without this call), "triton" or "torch". An attribute of each module (``sonar_backend``);
    their expert tensors are marked for :class:`sonar_kernels.SonarAdamW`. Returns ``model``.

    Raises:
        ValueError: an unknown backend, or a model without experts modules.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    modules = [m for m in model.modules() if is_experts_module(m)]
    if not modules:
        raise ValueError(f"{type(model).__name__} holds no transformers experts module")
    for module in modules:
        setattr(module, BACKEND_ATTRIBUTE, backend)
        if (tensors := expert_tensors_of(module)) is not None:
            mark_expert_tensors(*tensors)
    return model


def check_experts_module(module: nn.Module) -> str:
    """The activation of ``module`` ("silu", "gelu", "gelu_tanh", "relu2" or a clamped SwiGLU) when the sonar
    kernels can run it: read from its ``act_fn`` (what transformers' eager forward calls), else from
    ``config.hidden_act``; gpt-oss's ``_apply_gate`` (:data:`CLAMPED_SWIGLU_GATES`) is
    :func:`sonar_kernels.clamped_swiglu` with the module's ``alpha`` and ``limit``.

    The weights may be transposed (``is_transposed``), their gate and up rows interleaved
    (``is_concatenated=False``), the gate absent (``has_gate=False``: ``up_proj`` [E, I, H] instead of
    ``gate_up_proj``, e.g. Nemotron-H with the squared ReLU) and both projections biased (``has_bias``:
    ``gate_up_proj_bias``, ``down_proj_bias``); see :func:`layout_of`.

    Raises:
        ValueError: a layout flag the kernels do not implement (a post-expert norm), a custom
            ``_apply_gate`` other than gpt-oss's (or one of those that does not compute its formula), or
            an activation other than SiLU, the exact erf GELU and its tanh approximation; each named in
            the message.
    """
    name = type(module).__name__
    for flag, needed in LAYOUT.items():
        value = getattr(module, flag, needed)
        if bool(value) != needed:
            raise ValueError(
                f"{name}: {flag}={value} is not supported by the sonar experts implementation (it needs "
                f"{flag}={needed}: no norm after the experts)"
            )
    from transformers.integrations.moe import _default_apply_gate

    apply_gate = getattr(type(module), "_apply_gate", _default_apply_gate)
    if apply_gate is _default_apply_gate:
        activation = _activation_of(module)
    else:
        activation = _clamped_swiglu_of(module, apply_gate)
    for attr in expert_weight_names(module):
        if not isinstance(getattr(module, attr, None), torch.Tensor):
            raise ValueError(f"{name} has no {attr} tensor; the sonar experts implementation needs it")
    return activation


def _clamped_swiglu_of(module: nn.Module, apply_gate) -> str:
    """The clamped SwiGLU activation of a module whose ``_apply_gate`` is one of
    :data:`CLAMPED_SWIGLU_GATES`, checked on a probe (float64, values beyond the clamp included) against
    the kernels' formula in the module's gate/up order. Raises ValueError otherwise."""
    qualified = f"{getattr(apply_gate, '__module__', '')}.{getattr(apply_gate, '__qualname__', apply_gate)}"
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    refusal = (
        f"{type(module).__name__} defines its own _apply_gate ({qualified}), which the sonar experts "
        "implementation does not run (it computes act(gate) * up with SiLU or a GELU, and gpt-oss's clamped "
        "SwiGLU)"
    )
    if qualified not in CLAMPED_SWIGLU_GATES or not all(is_real_number(v) for v in (alpha, limit)):
        raise ValueError(refusal)
    activation = clamped_swiglu(alpha, limit)
    if not _computes_clamped_swiglu(apply_gate, float(alpha), float(limit), layout_of(module)["interleaved"]):
        raise ValueError(f"{refusal}: on a probe it does not compute {activation}")
    return activation


@functools.cache
def _computes_clamped_swiglu(apply_gate, alpha: float, limit: float, interleaved: bool) -> bool:
    """Whether ``apply_gate`` (reading ``self.alpha``, ``self.limit``) computes the kernels' clamped SwiGLU
    (the torch backend's ``glu``) on a float64 probe whose gate and up values cross both clamps."""
    probe = torch.linspace(-3 * limit, 3 * limit, 64, dtype=torch.float64).view(4, 16)
    gate, up = (probe[:, 0::2], probe[:, 1::2]) if interleaved else (probe[:, :8], probe[:, 8:])
    holder = type("Holder", (), {"alpha": alpha, "limit": limit})()
    with torch.no_grad():
        got = apply_gate(holder, probe.clone())
        expected = glu(gate, up, clamped_swiglu(alpha, limit))
    return got.shape == expected.shape and bool(torch.allclose(got, expected, rtol=1e-12, atol=1e-12))


def layout_of(module: nn.Module) -> dict[str, bool]:
    """The layout keywords of :func:`sonar_kernels.moe_mlp` for a transformers experts module, from its
    ``@use_experts_implementation`` flags: ``transposed`` (``is_transposed``: gate_up_proj [E, H, 2I],
    down_proj [E, I, H]), ``interleaved`` (``is_concatenated=False``: gate and up rows alternate) and
    ``gated`` (``has_gate``)."""
    gated = bool(getattr(module, "has_gate", True))
    return {
        "transposed": bool(getattr(module, "is_transposed", False)),
        "interleaved": gated and not bool(getattr(module, "is_concatenated", True)),
        "gated": gated,
    }


def _activation_of(module: nn.Module) -> str:
    """The kernels' activation for the module's ``act_fn`` (what its eager forward calls), or, without
    one, for ``config.hidden_act``. Raises ValueError for anything but SiLU, the exact erf GELU and the
    tanh-approximated GELU."""
    name = type(module).__name__
    act_fn = getattr(module, "act_fn", None)
    if act_fn is None:
        act = getattr(getattr(module, "config", None), "hidden_act", None)
        if act not in ACTIVATIONS:
            raise ValueError(
                f"{name}: hidden_act={act!r} is not supported by the sonar experts implementation "
                f"(supported: {', '.join(sorted(ACTIVATIONS))})"
            )
        return ACTIVATIONS[act]
    from transformers import activations
    from transformers.activations import GELUActivation, ReLUSquaredActivation, SiLUActivation

    # The tanh GELU's classes (GELUTanh was PytorchGELUTanh in older transformers).
    tanh_gelus = tuple(
        getattr(activations, cls)
        for cls in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation")
        if hasattr(activations, cls)
    )

    if act_fn is torch.nn.functional.silu or isinstance(act_fn, (SiLUActivation, nn.SiLU)):
        return "silu"
    if isinstance(act_fn, ReLUSquaredActivation):
        return "relu2"
    if act_fn is torch.nn.functional.gelu or (
        isinstance(act_fn, GELUActivation) and getattr(act_fn, "act", None) is torch.nn.functional.gelu
    ):
        return "gelu"
    if isinstance(act_fn, nn.GELU) and act_fn.approximate == "none":
        return "gelu"
    if isinstance(act_fn, tanh_gelus) or (isinstance(act_fn, nn.GELU) and act_fn.approximate == "tanh"):
        return "gelu_tanh"
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    raise ValueError(
        f"{name}: act_fn={type(act_fn).__name__} (hidden_act={act!r}) is not supported by the sonar experts "
        "implementation (supported: SiLU, the exact erf GELU and its tanh approximation, the squared ReLU)"
    )


def sonar_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The "sonar" experts forward: ``self`` an experts module of transformers (see
    :func:`check_experts_module`), [T, H], [T, top_k] expert ids (ids outside [0, E), transformers'
    expert-parallel sentinels, are dropped), [T, top_k] routing weights -> [T, H] in the dtype of
    ``hidden_states``."""
    activation = check_experts_module(self)
    claim_expert_tensors(*(getattr(self, name) for name in expert_weight_names(self)), module=self)
    w1 = getattr(self, expert_weight_names(self)[0])  # gate_up_proj, or up_proj without a gate
    group = getattr(self, EP_GROUP_ATTRIBUTE, None)
    if group is not None:  # shard_experts: this rank's experts, tokens dispatched by all-to-all
        # FSDP2 over them would reduce-scatter the gradients of different experts: refused, as SonarExperts does.
        check_not_fsdp_managed(self, group)
        backend = check_moe_mlp_args(
            hidden_states, top_k_index, top_k_weights, w1, self.down_proj, activation,
            getattr(self, BACKEND_ATTRIBUTE, "auto"), layout_name(**layout_of(self)),
        )  # fmt: skip
        return expert_parallel_moe_mlp(
            hidden_states, top_k_index, top_k_weights, w1, self.down_proj, group=group,
            num_experts=getattr(self, EP_EXPERTS_ATTRIBUTE), activation=activation, backend=backend,
            **layout_of(self), **_biases_of(self),
        )  # fmt: skip
    return moe_mlp(
        hidden_states,
        top_k_index,
        top_k_weights,
        w1,
        self.down_proj,
        activation=activation,
        backend=getattr(self, BACKEND_ATTRIBUTE, "auto"),
        **layout_of(self),
        **_biases_of(self),
    )


def _biases_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """The bias keywords of :func:`sonar_kernels.moe_mlp` for an experts module with ``has_bias``."""
    names = expert_weight_names(module)
    if len(names) == 2:
        return {}
    return {"gate_up_proj_bias": getattr(module, names[2]), "down_proj_bias": getattr(module, names[3])}


def shard_experts(model: nn.Module, ep_group) -> nn.Module:
    """Expert parallelism for a transformers model whose experts run "sonar": on rank r of the P ranks of
    ``ep_group`` (a ProcessGroup or a 1-D DeviceMesh), every experts module keeps experts
    [r * E / P, (r + 1) * E / P) (its ``gate_up_proj`` and ``down_proj`` replaced, in place, by those
    slices) and its forward sends each routed token to its expert's rank and back, as
    ``SonarExperts(ep_group=...)`` does (``sonar_kernels/nn/expert_parallel.py``: the all-to-all, the
    gradient convention). The local expert tensors are declared expert-parallel, so SonarAdamW updates them
    in the backward with no gradient collective. Call it on every rank with the same model (the same
    initial weights), before building the optimizer; keep the experts out of DDP (SonarAdamW does it for
    the module it is given) and out of FSDP2 (``ignored_params``: accelerate's ``ignored_modules``; an
    experts module that FSDP2 manages is refused at its forward, as for SonarExperts). Returns ``model``.

    Raises:
        ValueError: a model without experts modules running "sonar", an expert count not divisible by P,
            or torch.distributed not initialized.
    """
    group = resolve_ep_group(ep_group)
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    modules = [m for m in model.modules() if expert_tensors(m) is not None]
    if not modules:
        raise ValueError(
            'shard_experts: the model has no experts module running experts_implementation "sonar"'
        )
    for module in modules:
        experts = module.down_proj.shape[0]
        if experts % size:
            raise ValueError(f"shard_experts: {experts} experts cannot be split evenly over {size} ranks")
    for module in modules:
        experts = module.down_proj.shape[0]
        local = experts // size
        for name in expert_weight_names(module):
            full = getattr(module, name)
            part = nn.Parameter(
                full.detach()[rank * local : (rank + 1) * local].clone(), requires_grad=full.requires_grad
            )
            setattr(module, name, part)
            mark_expert_tensors(part)
            mark_expert_parallel(group, part)
        setattr(module, EP_GROUP_ATTRIBUTE, group)
        setattr(module, EP_EXPERTS_ATTRIBUTE, experts)
    return model


def expert_tensors(module: nn.Module) -> tuple[torch.Tensor, ...] | None:
    """The expert tensors (:func:`sonar_kernels.specs.expert_weight_names`: gate_up_proj or up_proj,
    down_proj, and with has_bias their biases) of a transformers experts module that runs the sonar
    implementation, else None. Does not import transformers."""
    if not is_experts_module(module):
        return None
    return expert_tensors_of(module)
