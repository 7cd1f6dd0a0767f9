"""Hugging Face transformers integration: "sonar" in transformers' ExpertsInterface.

After :func:`register`, every experts module that dispatches through transformers' ExpertsInterface
(``@use_experts_implementation``: OlmoeExperts, GraniteMoeExperts and the other v5 MoE models) runs
:func:`sonar_kernels.moe_mlp` when its model is loaded with ``experts_implementation="sonar"`` or switched
with ``model.set_experts_implementation("sonar")``. Only the expert MLPs change: the router, its logits
and the auxiliary load-balancing loss stay transformers' own, and the parameters keep their names,
shapes and layout, so save_pretrained / from_pretrained round-trip unchanged. :class:`sonar_kernels.SonarAdamW`
finds the expert tensors of such a model (:func:`expert_tensors`) and updates them in the backward.

``import sonar_kernels`` is enough: :func:`register` runs as soon as transformers' models are imported,
before or after sonar_kernels (:func:`register_when_imported`), and calling it yourself stays harmless.
transformers.Trainer needs nothing more: ``optimizers=(SonarAdamW(model, ...), None)`` or
``optimizer_cls_and_kwargs=(SonarAdamW, {...})``; a gradient accumulation that differs from the
optimizer's is refused before anything is updated (:func:`check_trainer_optimizer`), and
``resume_from_checkpoint`` restores the experts (:func:`load_checkpoint_format`).
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.abc
import sys
import warnings
from importlib import metadata

import torch
from torch import nn

from sonar_kernels.autograd.moe_mlp import moe_mlp
from sonar_kernels.nn.expert_parallel import expert_parallel_moe_mlp, resolve_ep_group
from sonar_kernels.ops.glu import glu
from sonar_kernels.ops.validation import check_moe_mlp_args
from sonar_kernels.optim.in_backward import InBackwardAdamW
from sonar_kernels.optim.ownership import claim_expert_tensors
from sonar_kernels.specs import (
    BACKENDS,
    IMPLEMENTATION,
    clamped_swiglu,
    expert_tensors_of,
    expert_weight_names,
    is_experts_module,
    layout_name,
    mark_expert_parallel,
    mark_expert_tensors,
)

__all__ = [
    "IMPLEMENTATION",
    "apply_sonar_kernel_to_granitemoe",
    "apply_sonar_kernel_to_olmoe",
    "check_experts_module",
    "check_sonar_modules",
    "check_trainer_optimizer",
    "expert_tensors",
    "is_experts_module",
    "layout_of",
    "load_checkpoint_format",
    "register",
    "register_when_imported",
    "set_backend",
    "shard_experts",
    "sonar_experts_forward",
]
MIN_TRANSFORMERS = (5, 13)
# transformers' hidden_act names -> the activation of moe_mlp. The tanh approximations of GELU
# ("gelu_pytorch_tanh", "gelu_new", ...) are not the exact erf GELU the kernels compute: refused.
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


def _check_transformers():
    """The installed transformers module. Raises ImportError when it is missing or older than 5.13."""
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        raise ImportError(
            "the sonar experts implementation needs transformers >= 5.13 (tested with 5.24): "
            "pip install 'transformers>=5.13,<6', or pip install -e '.[transformers]' in the sonar-kernels checkout"
        ) from None
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    if tuple(parts) < MIN_TRANSFORMERS:
        raise ImportError(
            f"the sonar experts implementation needs transformers >= 5.13 (its ExpertsInterface), "
            f"found {version}: pip install -U 'transformers>=5.13,<6'"
        )
    import transformers

    return transformers


def register() -> None:
    """Register "sonar" in transformers' ExpertsInterface (idempotent). The backend is chosen per model
    or module (:func:`set_backend`), not here. Also wraps ``PreTrainedModel.set_experts_implementation``
    and ``PreTrainedModel.post_init`` once, so that "sonar" is refused (ValueError naming the module)
    when it is chosen for experts the kernels cannot run, not at the first forward (see
    :func:`check_sonar_modules`), and so that a model running "sonar" loads the checkpoints that its
    ``save_pretrained`` writes with ``load_state_dict`` (:func:`load_checkpoint_format`); and, once
    ``transformers.Trainer`` is imported, ``Trainer.create_optimizer`` (:func:`check_trainer_optimizer`).

    ``import sonar_kernels`` already runs it when transformers' models are imported
    (:func:`register_when_imported`); an explicit call states the dependency and raises on a missing or
    old transformers, which the automatic one leaves to transformers' own "not supported" message.

    Raises:
        ImportError: transformers missing or older than 5.13.
    """
    transformers = _check_transformers()
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, sonar_experts_forward)
    _install_switch_checks(transformers.PreTrainedModel)
    if (trainer := sys.modules.get(_TRAINER_MODULE)) is not None:
        _install_trainer_checks(trainer.Trainer)


# The transformers modules whose import completes the integration: the one that defines PreTrainedModel
# (it imports ExpertsInterface), and Trainer's.
_MODELS_MODULE = "transformers.modeling_utils"
_TRAINER_MODULE = "transformers.trainer"


def register_when_imported() -> None:
    """Run :func:`register` once transformers' models are imported, and install the Trainer checks once
    transformers.Trainer is: now for what is already imported, else right after its import. Called by
    ``import sonar_kernels``.

    Why this way: registering at ``import sonar_kernels`` would import transformers (about a second,
    and a failure where it is not installed) for users who never build a transformers model; registering
    lazily at the lookup is not possible without changing transformers (its ExpertsInterface refuses an
    unknown name with its own message). So nothing of transformers is imported here: a finder on
    ``sys.meta_path`` waits for ``transformers.modeling_utils`` (every model class imports it, and it
    imports ExpertsInterface) and ``transformers.trainer``, runs the registration right after the module
    has run, and removes itself once both are done (:class:`_AfterImport`). Any import order works:
    ``import transformers`` alone does not import them (transformers' modules load lazily).
    """
    pending = {}
    for name, install in ((_MODELS_MODULE, _register_quietly), (_TRAINER_MODULE, _install_trainer_quietly)):
        module = sys.modules.get(name)
        if module is not None:
            install(module)
        else:
            pending[name] = install
    if pending and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(pending))


def _register_quietly(module) -> None:
    """:func:`register` after ``transformers.modeling_utils`` was imported. A transformers without
    ExpertsInterface (older than 5.13) is left alone: ``experts_implementation="sonar"`` then gets
    transformers' refusal, and :func:`register` says why. Any other failure is a warning, never a failed
    import of transformers."""
    try:
        register()
    except ImportError:
        pass
    # Whatever else fails, transformers' own import must not fail because of this library.
    except Exception as e:
        warnings.warn(
            f'sonar_kernels could not register experts_implementation "sonar" in transformers ({e!r}); '
            "call sonar_kernels.integrations.transformers.register() to see the error",
            stacklevel=2,
        )


def _install_trainer_quietly(module) -> None:
    """Install the Trainer checks after ``transformers.trainer`` was imported (a transformers too old
    for the integration: nothing)."""
    try:
        _check_transformers()
        _install_trainer_checks(module.Trainer)
    except ImportError:
        pass


class _AfterImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that runs ``installs[name](module)`` right after the module ``name`` has
    run (its own loader, wrapped), then forgets it; it leaves ``sys.meta_path`` with the last one. Finding
    and loading stay the other finders' and loaders' (``__loader__`` answers as the original does)."""

    def __init__(self, installs: dict):
        self.installs = dict(installs)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.installs:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _InstallingLoader(spec.loader, functools.partial(self._done, fullname))
        return spec

    def _done(self, fullname: str, module) -> None:
        install = self.installs.pop(fullname, None)
        if not self.installs and self in sys.meta_path:
            sys.meta_path.remove(self)
        if install is not None:
            install(module)


class _InstallingLoader(importlib.abc.Loader):
    """The module's own loader, then ``after(module)`` once the module has run."""

    def __init__(self, loader, after):
        self._loader, self._after = loader, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name):  # get_source, get_filename, is_package, ...: the original loader's
        return getattr(self._loader, name)


def check_trainer_optimizer(optimizer, args) -> None:
    """Refuse a SonarAdamW (any in-backward optimizer, also wrapped by accelerate) whose
    ``accumulation_steps`` differs from transformers.Trainer's ``args.gradient_accumulation_steps``.
    Trainer runs that many backward passes per ``optimizer.step()``; the optimizer updates each expert
    tensor at the last of its ``accumulation_steps`` backward passes, so any other value would update the
    experts before the window ends (and then refuse the next micro-batch) or never. Called on what
    ``Trainer.create_optimizer`` returns (installed by :func:`register`), which Trainer calls before its
    first forward, whether the optimizer came with ``optimizers=`` or ``optimizer_cls_and_kwargs=``:
    nothing is updated when it raises. The value is not taken over silently: both are the user's choices,
    and the optimizer may be shared with a loop of one's own.

    Trainer's last window of an epoch may hold fewer micro-batches (steps per epoch not a multiple of
    ``gradient_accumulation_steps``): the experts are then updated at ``optimizer.step()`` from the
    gradients kept in ``.grad``, which Trainer's gradient clipping then includes.

    Raises:
        ValueError: naming both values and the fix.
    """
    inner = optimizer
    while not isinstance(inner, InBackwardAdamW) and hasattr(inner, "optimizer"):
        inner = inner.optimizer  # accelerate's AcceleratedOptimizer, and similar wrappers
    steps = getattr(args, "gradient_accumulation_steps", 1)
    if isinstance(inner, InBackwardAdamW) and inner.accumulation_steps != steps:
        name = type(inner).__name__
        raise ValueError(
            f"{name}(accumulation_steps={inner.accumulation_steps}) updates the experts once per "
            f"{inner.accumulation_steps} backward pass(es), but this Trainer runs gradient_accumulation_steps="
            f"{steps} backward passes per optimizer step; nothing was updated. Build {name}(..., "
            f'accumulation_steps={steps}) (with optimizer_cls_and_kwargs, add "accumulation_steps": {steps} to '
            "its kwargs)"
        )


def _install_trainer_checks(cls) -> None:
    """Wrap ``cls.create_optimizer`` (transformers.Trainer's) once: :func:`check_trainer_optimizer` on the
    optimizer it returns. The wrapped method stays transformers' own; subclasses that override it and call
    ``super()`` are checked too."""
    if getattr(cls.create_optimizer, "_sonar_checks", False):
        return
    original = cls.create_optimizer

    @functools.wraps(original)
    def create_optimizer(self, *args, **kwargs):
        optimizer = original(self, *args, **kwargs)
        check_trainer_optimizer(optimizer, self.args)
        return optimizer

    create_optimizer._sonar_checks = True
    cls.create_optimizer = create_optimizer


def check_sonar_modules(model: nn.Module, selected_only: bool = True) -> None:
    """Refuse a model whose experts modules the kernels cannot run: every experts module whose config
    selects "sonar" (``selected_only=False``: every experts module) must pass
    :func:`check_experts_module`.

    Raises:
        ValueError: naming the module (its path in ``model``) and what the kernels refuse.
    """
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        selected = getattr(getattr(module, "config", None), "_experts_implementation", None) == IMPLEMENTATION
        if selected_only and not selected:
            continue
        try:
            check_experts_module(module)
        except ValueError as e:
            raise ValueError(
                f'experts_implementation "sonar" cannot run {name or "the model"}: {e}'
            ) from None


def _install_switch_checks(cls) -> None:
    """Make transformers refuse "sonar" where the kernels cannot run it when it is chosen, not at the first
    forward: ``set_experts_implementation("sonar")`` checks every experts module before it switches (the
    model unchanged when it raises), and a model built with it (``from_pretrained(...,
    experts_implementation="sonar")``, a config that selects it) is checked at the end of its ``__init__``
    (``post_init``). Installed once, by :func:`register`; the wrapped methods stay transformers' own."""
    if getattr(cls.set_experts_implementation, "_sonar_checks", False):
        return
    original_set, original_post_init = cls.set_experts_implementation, cls.post_init

    @functools.wraps(original_set)
    def set_experts_implementation(self, experts_implementation):
        if experts_implementation == IMPLEMENTATION:
            check_sonar_modules(self, selected_only=False)
        result = original_set(self, experts_implementation)
        _mark_sonar_experts(self)
        _install_checkpoint_loading(self)
        return result

    @functools.wraps(original_post_init)
    def post_init(self, *args, **kwargs):
        result = original_post_init(self, *args, **kwargs)
        check_sonar_modules(self)
        _mark_sonar_experts(self)
        _install_checkpoint_loading(self)
        return result

    set_experts_implementation._sonar_checks = True
    cls.set_experts_implementation = set_experts_implementation
    cls.post_init = post_init


def _mark_sonar_experts(model: nn.Module) -> None:
    """Mark the expert tensors of the experts modules of ``model`` that run "sonar", so that an optimizer
    built over ``model.parameters()`` knows them (docs/usage.md, Ownership)."""
    for module in model.modules():
        if (tensors := expert_tensors(module)) is not None:
            mark_expert_tensors(*tensors)


def _install_checkpoint_loading(model: nn.Module) -> None:
    """Give a model whose experts run "sonar" :func:`load_checkpoint_format` as a ``load_state_dict``
    pre-hook (once; the handle is the model's ``_sonar_checkpoint_hook``, the hook goes with the model)."""
    if getattr(model, "_sonar_checkpoint_hook", None) is not None:
        return
    if any(expert_tensors(m) is not None for m in model.modules()):
        model._sonar_checkpoint_hook = model.register_load_state_dict_pre_hook(load_checkpoint_format)


def load_checkpoint_format(model: nn.Module, state_dict: dict, prefix: str = "", *args) -> None:
    """Convert, in place, the keys of ``state_dict`` that are in the format ``save_pretrained`` writes
    (transformers' conversion mapping reversed: one tensor per expert, e.g.
    ``mlp.experts.0.gate_proj.weight``) into those of ``model`` (``mlp.experts.gate_up_proj`` [E, 2I, H]),
    as ``from_pretrained`` converts them; keys already in the model's format are left alone. A
    ``load_state_dict`` pre-hook of every model whose experts run "sonar" (:func:`register`), so that its
    ``load_state_dict`` takes the model's own checkpoints.

    Why: transformers >= 5 saves MoE checkpoints in the hub's per-expert format (``save_pretrained`` runs
    ``revert_weight_conversion``), but ``Trainer._load_from_checkpoint`` (``resume_from_checkpoint``, and
    ``load_best_model_at_end``) loads ``model.safetensors`` with a plain ``model.load_state_dict(state_dict,
    strict=False)``, without the conversion: the fused expert tensors are "missing", the per-expert ones
    "unexpected", and the experts keep the values they had before the resume (transformers 5.24, any
    experts implementation; huggingface/transformers#48805). The tensors are copied into the model's
    parameters by ``load_state_dict`` as usual, so an optimizer built over them keeps them.

    Args:
        model: a transformers model (a PreTrainedModel), or the module that holds the hook.
        state_dict: what ``load_state_dict`` was given (keys under ``prefix`` are converted).
        prefix: the model's prefix in ``state_dict`` (``load_state_dict``'s pre-hook argument).
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            PrefixChange,
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:  # a transformers without conversion mappings saves in the model's own format
        return
    own = set(model.state_dict(keep_vars=True))
    foreign = sorted(
        (k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] not in own),
        key=lambda k: dot_natural_key(k[len(prefix) :]),
    )
    if not foreign:
        return
    transforms = getattr(model, "_weight_conversions", None)
    if transforms is None:  # not built by from_pretrained: the default mapping, as save_pretrained uses it
        transforms = get_model_conversion_mapping(model, add_legacy=False)
        transforms = [t for t in transforms if not isinstance(t, PrefixChange)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    converted, consumed = {}, []
    pending: dict[str, WeightConverter] = {}
    for key in foreign:
        target, pattern = rename_source_key(key[len(prefix) :], renamings, converters)
        if target not in own:
            continue  # not the model's: left for load_state_dict to report
        consumed.append(key)
        if pattern is None:
            converted[target] = state_dict[key]
        else:
            pending.setdefault(target, copy.deepcopy(by_pattern[pattern])).add_tensor(
                target, key, pattern, state_dict[key]
            )
    for target, converter in pending.items():
        for name, value in converter.convert(target, model=model, config=model.config).items():
            converted[name] = value[0] if isinstance(value, list) else value
    for key in consumed:
        del state_dict[key]
    state_dict.update({prefix + name: value for name, value in converted.items()})


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
    if qualified not in CLAMPED_SWIGLU_GATES or not all(isinstance(v, (int, float)) for v in (alpha, limit)):
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
    claim_expert_tensors(*(getattr(self, name) for name in expert_weight_names(self)))
    w1 = getattr(self, expert_weight_names(self)[0])  # gate_up_proj, or up_proj without a gate
    group = getattr(self, EP_GROUP_ATTRIBUTE, None)
    if group is not None:  # shard_experts: this rank's experts, tokens dispatched by all-to-all
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
    the module it is given). Returns ``model``.

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


def _apply(model_type: str, model: nn.Module | None, backend: str) -> nn.Module | None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    register()
    if model is not None:
        if getattr(getattr(model, "config", None), "model_type", None) != model_type:
            raise ValueError(
                f"expected a {model_type} model, got model_type="
                f"{getattr(getattr(model, 'config', None), 'model_type', None)!r}"
            )
        model.set_experts_implementation(IMPLEMENTATION)
        return set_backend(model, backend)
    if backend != "auto":
        raise ValueError(
            f"backend={backend!r} needs a model: apply_sonar_kernel_to_{model_type}(model, backend=...), or "
            "set_backend(model, ...) once the model exists"
        )
    # No model: models of this type created from now on default to "sonar" (an explicit
    # experts_implementation still wins).
    module, base_name = {
        "olmoe": ("transformers.models.olmoe.modeling_olmoe", "OlmoePreTrainedModel"),
        "granitemoe": ("transformers.models.granitemoe.modeling_granitemoe", "GraniteMoePreTrainedModel"),
    }[model_type]
    base = getattr(importlib.import_module(module), base_name)
    original = base.get_correct_experts_implementation
    if not getattr(original, "_sonar_default", False):

        @functools.wraps(original)
        def get_correct_experts_implementation(self, requested_experts):
            return original(self, IMPLEMENTATION if requested_experts is None else requested_experts)

        get_correct_experts_implementation._sonar_default = True
        base.get_correct_experts_implementation = get_correct_experts_implementation
    return None


def apply_sonar_kernel_to_olmoe(model: nn.Module | None = None, *, backend: str = "auto") -> nn.Module | None:
    """Run OLMoE's experts with the sonar kernels (Liger-Kernel's naming).

    With ``model`` (an OLMoE transformers model): switch it to experts_implementation "sonar" with
    ``backend`` (:func:`set_backend`) and return it. Without: OLMoE models created afterwards default to
    "sonar" with the "auto" backend (an explicit ``experts_implementation`` still wins). Registers
    "sonar" first.

    Raises:
        ImportError: transformers missing or older than 5.13.
        ValueError: ``model`` is not an OLMoE model; an unknown backend, or a backend other than "auto"
            without a model.
    """
    return _apply("olmoe", model, backend)


def apply_sonar_kernel_to_granitemoe(
    model: nn.Module | None = None, *, backend: str = "auto"
) -> nn.Module | None:
    """As :func:`apply_sonar_kernel_to_olmoe`, for Granite MoE (model_type "granitemoe")."""
    return _apply("granitemoe", model, backend)
