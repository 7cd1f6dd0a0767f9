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

from torch import nn

from sonar_kernels.integrations.transformers_experts import (
    check_experts_module,
    expert_tensors,
    layout_of,
    set_backend,
    shard_experts,
    sonar_experts_forward,
)
from sonar_kernels.optim.in_backward import InBackwardAdamW
from sonar_kernels.specs import (
    BACKENDS,
    IMPLEMENTATION,
    is_experts_module,
    mark_expert_tensors,
    set_expert_module,
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
            for t in tensors:
                set_expert_module(t, module)  # whose forward must still dispatch to "sonar" (ownership.py)


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
