"""Expert identity however the optimizer and the model were built (docs/usage.md, "Ownership").

The rule: the tensors of an experts module running "sonar" (SonarExperts, a transformers experts module
switched to "sonar", torchtitan's SonarGroupedExperts) are expert tensors, and a SonarAdamW that holds
one among its parameters updates it in the backward, whatever list, generator or groups it was given and
whenever the module's Parameter objects were replaced. Where that cannot hold, an error says so before
any update; an optimizer that trains expert tensors without owning them is named in a warning.

How the optimizer learns which of its parameters are expert tensors:

- the modules mark their tensors (:func:`sonar_kernels.specs.mark_expert_tensors`) when they get them
  and at every eager forward (:func:`claim_expert_tensors`);
- SonarAdamW tags every tensor it holds (:func:`sonar_kernels.specs.set_holder`); at its forward, an
  experts module hands each unowned tensor to the SonarAdamW that holds it (:func:`claim_expert_tensors`),
  which adopts it before the backward runs, or refuses it with an error (an option its update does not
  implement, a gradient already accumulated as a dense one). That covers tensors replaced after their
  module marked them and before the optimizer was built: meta-device init and ``to_empty()``, conversions
  that overwrite parameters, ``load_state_dict(assign=True)`` of transformers modules;
- FSDP2 runs the forward on unsharded tensors, not the sharded parameters the optimizer holds: the
  optimizer marks the expert tensors of the FSDP2 modules when it is given DTensors
  (:func:`mark_fsdp_expert_tensors`), also when they replace its parameters after it was built
  (accelerate's ``prepare`` under FSDP2): each forward of an experts module first lets every live SonarAdamW
  follow its ``param_groups`` (:func:`register_adopter`);
- a conversion in swap mode (``torch.utils.swap_tensors``: DTensor and tensor-subclass parameters, or
  ``torch.__future__.set_swap_module_params_on_conversion(True)``) keeps the Parameter object and drops its
  attributes, but not its hooks: the owner is found through its post-accumulate-grad hook, and the update
  is rebuilt for the tensor's new dtype and device (:meth:`InBackwardAdamW.claim`).

Nothing here is a table keyed by tensors: the links are attributes and hooks of the tensors, and the
optimizer's own ``param_groups``.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref

import torch

from sonar_kernels import specs

__all__ = [
    "ExpertsForwardReplacedWarning",
    "ShardedExpertsWarning",
    "UnownedExpertsWarning",
    "check_forward",
    "claim_expert_tensors",
    "mark_fsdp_expert_tensors",
    "owner_of",
    "register_adopter",
    "scan_model",
    "sharded_experts_message",
    "user_stacklevel",
    "warn_unowned_experts",
]

# The live optimizers that take over expert tensors they hold (SonarAdamW): a forward of an experts module
# lets each follow its param_groups first (accelerate's prepare replaces their entries by FSDP2 shards).
_adopters: weakref.WeakSet = weakref.WeakSet()


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called by the function that calls this, so that the warning
    names the first frame outside torch, transformers, accelerate and this package: the user's line (the
    model's call, ``optimizer.step()``, ``trainer.train()``), however deep the modules that led there."""
    packages = [sys.modules.get(name) for name in ("torch", "transformers", "accelerate", "sonar_kernels")]
    prefixes = tuple(os.path.dirname(m.__file__) + os.sep for m in packages if getattr(m, "__file__", None))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(prefixes):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def register_adopter(optimizer) -> None:
    """Follow ``optimizer``'s ``param_groups`` at each forward of an experts module (its
    ``sync_param_groups()``), for as long as it lives."""
    _adopters.add(optimizer)


class ExpertsForwardReplacedWarning(UserWarning):
    """An experts module whose model selects "sonar" no longer dispatches through it: its ``forward`` was
    rebound (Liger-Kernel's ``swiglu=True`` does it), so the sonar kernels do not run for it."""


def check_forward(*modules: torch.nn.Module | None) -> None:
    """Warn once (:class:`ExpertsForwardReplacedWarning`, one warning for all of ``modules`` found now, and
    never again for a module it named) when transformers experts modules whose config selects "sonar" have
    a ``forward`` of their own bound on the instance, which replaces transformers' dispatch to the
    ExpertsInterface: their expert tensors then get their gradients in ``.grad`` from that forward, and
    SonarAdamW applies torch's AdamW to each as it arrives (no memory saved). Called when SonarAdamW takes
    the modules' tensors, and before the first update of each tensor (None entries are skipped)."""
    replaced = {}
    for module in modules:
        if module is None or getattr(module, _WARNED_FORWARD, False):
            continue
        bound = module.__dict__.get("forward")
        if bound is None or specs.expert_tensors_of(module) is None or _runs_own_forward(module, bound):
            continue
        module.__dict__[_WARNED_FORWARD] = True
        function = getattr(bound, "__func__", bound)
        name = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"
        replaced.setdefault(name, []).append(type(module).__name__)
    for replacement, names in replaced.items():
        liger = " (Liger-Kernel's swiglu=True does this)" if replacement.startswith("liger_kernel") else ""
        warnings.warn(
            f'{len(names)} experts module(s) ({names[0]}) select experts_implementation "sonar", but their forward '
            f'was replaced by {replacement}{liger}: they no longer dispatch to "sonar", so the sonar kernels do '
            "not run there and SonarAdamW applies torch's AdamW to their expert tensors as the gradients arrive in "
            '.grad (correct, no memory saved). To keep "sonar", leave the experts\' forward alone: with '
            "Liger-Kernel, apply it with swiglu=False (apply_liger_kernel_to_<model>(swiglu=False), or Trainer's "
            'liger_kernel_config={"swiglu": False}).',
            ExpertsForwardReplacedWarning,
            stacklevel=user_stacklevel(),
        )


# The attribute of an experts module that says check_forward warned about it.
_WARNED_FORWARD = "_sonar_warned_forward"


def _runs_own_forward(module: torch.nn.Module, bound) -> bool:
    """Whether ``bound``, a ``forward`` bound on ``module``, is transformers' expert-parallel forward
    (``EpDispatchExpertsParallel.install_forward``, DistributedConfig(ep_size=...)): it exchanges the tokens
    and then calls the module's own forward (its EPImplementation's ``experts_forward``), which dispatches
    to "sonar" as before."""
    function = getattr(bound, "__func__", bound)
    if not getattr(function, "__module__", "").startswith("transformers.distributed."):
        return False
    for cell in getattr(function, "__closure__", None) or ():
        try:
            own = getattr(cell.cell_contents, "experts_forward", None)
        except ValueError:  # an empty cell
            continue
        if (
            getattr(own, "__self__", None) is module
            and getattr(own, "__func__", None) is type(module).forward
        ):
            return True
    return False


class UnownedExpertsWarning(UserWarning):
    """An optimizer trains expert tensors of experts running "sonar" as dense parameters (no in-backward
    optimizer owns them). Filter this category where that is deliberate (a standard-training baseline)."""


class ShardedExpertsWarning(UserWarning):
    """An in-backward optimizer updates expert tensors that are DTensor shards (FSDP2's ``fully_shard``,
    transformers' ``DistributedConfig``, torchtitan's EP + FSDP) from their reduced gradient in ``.grad``:
    the paper's method, one gradient shard alive until its update, not the fused epilogue, where no expert
    gradient exists (docs/distributed.md). Once per optimizer."""


def sharded_experts_message(owner: str, p: torch.Tensor | None = None) -> str:
    """The text of :class:`ShardedExpertsWarning` for ``owner``, naming the layout of the DTensor ``p``
    when it is one a stack builds (docs/distributed.md, "From the stacks users run")."""
    fused = (
        "The fused update needs each rank to hold its experts' complete gradient outside FSDP2: expert "
        "parallelism (SonarExperts(ep_group=...), or sonar_kernels.integrations.transformers.shard_experts for "
        "a transformers model loaded without DistributedConfig) with the dense layers on FSDP2 "
        "(sonar_kernels.nn.fully_shard_dense, or accelerate's FSDP2 plugin with ignored_modules= the experts "
        "modules; docs/distributed.md). Filter ShardedExpertsWarning where this layout is the one you want."
    )
    mesh = getattr(p, "device_mesh", None)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "efsdp" in names and "ep" in names:
        return f"{owner}: {_efsdp_ep_reason(names, tuple(mesh.shape))} {fused}"
    return (
        f"{owner}: the expert tensors are DTensor shards (FSDP2's fully_shard, transformers' DistributedConfig, "
        "torchtitan's EP + FSDP), so each is updated in the backward from its reduced gradient, which exists as a "
        "tensor until its update: the paper's method's memory, not the fused wgrad epilogue's (no expert gradient "
        f"at all). {fused}"
    )


def _efsdp_ep_reason(names: tuple[str, ...], shape: tuple[int, ...]) -> str:
    """Why experts on the expert mesh (..., "efsdp", "ep") of transformers' DistributedConfig(ep_size=...,
    fsdp_size=...) or torchtitan's EP + FSDP are updated from ``.grad``, and whether that gradient was
    complete before FSDP2 reduced it (docs/distributed.md, "From the stacks users run")."""
    sizes = dict(zip(names, shape, strict=True))
    efsdp, ep = sizes["efsdp"], sizes["ep"]
    layout = " x ".join(f"{n} {s}" for n, s in sizes.items())
    reason = (
        f"the expert tensors are DTensors on the expert mesh of transformers' DistributedConfig(ep_size=..., "
        f"fsdp_size=...) or torchtitan's EP + FSDP ({layout}). Their tokens reach them by an all-to-all over "
        f"'ep' ({ep} ranks), and the stack then applies fully_shard to the experts over 'efsdp' itself, with "
        "no way to leave them out (transformers' apply_fully_sharded_data_parallelism wraps every "
        "ep_dispatch_experts module and takes no ignored_params; torchtitan's apply_fsdp_to_decoder gives the "
        "expert parameters the efsdp mesh), so the experts' forward runs on FSDP2's unsharded copy and their "
        "gradient reaches FSDP2, then .grad: each is updated in the backward from that reduced gradient, which "
        "exists as a tensor until its update (the paper's method's memory), not in the fused wgrad epilogue."
    )
    if efsdp == 1:
        return (
            f"{reason} With 'efsdp' of 1 rank, each rank's gradient of its experts is complete before FSDP2 "
            "(every token of the expert-parallel group routed to them reached this rank) and FSDP2 at most "
            "scales it: the update is exact, not fused."
        )
    return (
        f"{reason} With 'efsdp' of {efsdp} ranks, {efsdp} expert-parallel groups hold copies of the same experts "
        f"(each rank of 'efsdp' holding and updating a 1 / {efsdp} shard of them), and each copy's gradient covers "
        "only its own group's tokens: a partial sum that FSDP2's reduce-scatter over 'efsdp' completes, so the update is exact "
        "after that collective and could not run in the wgrad epilogue."
    )


# The attribute of an optimizer that says it was checked by warn_unowned_experts.
_CHECKED = "_sonar_checked_experts"


def scan_model(model: torch.nn.Module) -> list[torch.Tensor]:
    """The expert tensors of ``model``, which SonarAdamW is built from (in ``model.parameters()`` order):
    the experts modules' tensors marked (:func:`sonar_kernels.specs.mark_expert_tensors`), their forwards
    checked (:func:`check_forward`), and a warning (to SonarAdamW's caller) when experts run another
    implementation than "sonar" or the config selects "sonar" but no module dispatches to it."""
    # Modules that hold expert weights say which (SonarExperts.expert_tensors), copies included;
    # transformers experts modules running the "sonar" implementation are found by their config.
    other = set()
    for module in model.modules():
        if (tensors := specs.expert_tensors_of(module)) is not None:
            specs.mark_expert_tensors(*tensors)
        elif specs.is_experts_module(module):
            other.add(getattr(getattr(module, "config", None), "_experts_implementation", None))
    if other:
        warnings.warn(
            f"SonarAdamW: the model's experts run experts_implementation {sorted(map(str, other))}, not "
            '"sonar": their tensors are trained as dense parameters (clipped and updated in step()) '
            'unless the model is switched (model.set_experts_implementation("sonar")) before its next '
            "forward, which hands them to this optimizer.",
            stacklevel=3,
        )
    check_forward(*(m for m in model.modules() if specs.expert_tensors_of(m) is not None))
    experts = [p for p in model.parameters() if specs.is_expert_tensor(p)]
    if not experts and _selects_sonar(model):
        # The config asks for "sonar", but no experts module dispatches through transformers'
        # ExpertsInterface (e.g. JetMoe in transformers 5.24): nothing runs the kernels.
        batched = [name for name, p in model.named_parameters() if p.dim() == 3]
        warnings.warn(
            'SonarAdamW: the model\'s config selects experts_implementation "sonar", but none of its modules '
            "dispatches through transformers' ExpertsInterface, so no expert tensor is updated in the "
            f"backward and every parameter is trained as a dense one; batched (3-D) weights: {batched[:4]}"
            f"{' ...' if len(batched) > 4 else ''}. The sonar kernels do not run in this model.",
            stacklevel=3,
        )
    return experts


def _selects_sonar(model: torch.nn.Module) -> bool:
    """Whether a config of ``model`` (or of a submodule) selects experts_implementation "sonar"."""
    return any(
        getattr(getattr(m, "config", None), "_experts_implementation", None) == specs.IMPLEMENTATION
        for m in model.modules()
    )


def owner_of(t: torch.Tensor):
    """The live in-backward optimizer that owns ``t`` (its update), holds it (its tag), or whose
    post-accumulate-grad hook it carries (a swap dropped the tensor's attributes); None otherwise."""
    update = specs.update_of(t)
    owner = getattr(update, "optimizer", None)
    if owner is not None:
        return owner
    owner = specs.holder_of(t)
    if owner is not None:
        return owner
    for hook in (getattr(t, "_post_accumulate_grad_hooks", None) or {}).values():
        ref = getattr(hook, "sonar_optimizer", None)
        if ref is not None and ref() is not None:
            return ref()
    return None


def claim_expert_tensors(*tensors: torch.Tensor | None, module: torch.nn.Module | None = None) -> None:
    """Called by an experts module running "sonar" at each forward, with the expert tensors it holds
    (None entries are skipped) and itself: marks them, and hands each to its owner's :meth:`claim` (the
    optimizer adopts a tensor it held as dense, and rebuilds the update of one converted since). Eager mode
    only: under torch.compile the ownership of the eager steps (or of the optimizer's construction) holds.

    A tensor with no owner that replaced, in the same place of ``module``, a tensor an optimizer updated
    in the backward at an earlier forward (``load_state_dict(assign=True)``, ``to_empty()`` or a conversion
    that makes new Parameter objects, an assignment, after training started) is handed to that optimizer,
    which puts it in the old one's place with its state (:meth:`InBackwardAdamW.adopt_replacement`); when it
    cannot (the old tensor is no longer among its parameters, another shape), :class:`UnownedExpertsWarning`
    says so at that forward. The module keeps the update handles of its last forward (``_sonar_claimed``),
    never the tensors.

    Raises:
        ValueError, TypeError, RuntimeError: the optimizer that holds a tensor cannot update it in the
            backward (its message names why), or a tensor was replaced between a backward and ``step()``;
            raised before anything is updated.
    """
    if torch.compiler.is_compiling():
        return
    _install_step_check()
    for optimizer in list(_adopters):
        try:
            optimizer.sync_param_groups()
        except (RuntimeError, ValueError, TypeError):
            # An optimizer of another model that refuses its groups does not stop this one: its own
            # models' forwards and its step() raise it (it updates nothing meanwhile).
            if _concerns(optimizer, module, tensors):
                raise
    before = getattr(module, _CLAIMED, None) if module is not None else None
    for index, t in enumerate(tensors):
        if t is None:
            continue
        if not specs.is_expert_tensor(t):
            specs.mark_expert_tensors(t)
        owner = owner_of(t)
        if owner is None and before is not None and index < len(before) and before[index] is not None:
            _replaced(before[index], t)
            owner = owner_of(t)
        if owner is not None:
            owner.claim(t)
    if module is not None:
        claimed = [None if t is None else specs.update_of(t) for t in tensors]
        module.__dict__[_CLAIMED] = claimed
        for index, update in enumerate(claimed):
            if update is not None and getattr(update, "tensor", lambda: None)() is tensors[index]:
                # Where the tensor sits: step() checks that it is still there (InBackwardUpdates.check_before_step).
                update.held_at = (weakref.ref(module), index)


def _concerns(optimizer, module: torch.nn.Module | None, tensors: tuple) -> bool:
    """Whether ``optimizer`` holds or updates one of ``tensors`` (in its groups, or as the tensors it
    updates in the backward), or was built from a model that holds ``module``."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    held.update(id(p) for p in optimizer.managed.tensors)
    if any(t is not None and id(t) in held for t in tensors):
        return True
    source = optimizer.managed.dense_source
    model = source[0]() if source is not None else None
    return model is not None and module is not None and any(m is module for m in model.modules())


# The attribute of an experts module that holds the update handles of the tensors of its last forward.
_CLAIMED = "_sonar_claimed"


def _replaced(update, t: torch.Tensor) -> None:
    """``t`` (no owner) is where the tensor of ``update`` was at the module's last forward: its optimizer
    adopts it, or a warning says that it cannot (when ``t`` would be trained: it requires grad, grad mode
    on). An optimizer garbage-collected since leaves nothing to say."""
    optimizer = getattr(update, "optimizer", None)
    old = update.tensor() if optimizer is not None and hasattr(update, "tensor") else None
    if old is None or old is t:
        return
    if optimizer.adopt_replacement(old, t):
        return
    if t.requires_grad and torch.is_grad_enabled():
        warnings.warn(
            f"an expert tensor of shape {tuple(t.shape)} replaced one that {type(optimizer).__name__} updated in "
            f"the backward (of shape {tuple(old.shape)}), and that optimizer no longer holds the old one or cannot "
            "take the new one in its place: the new tensor has no in-backward owner, so it is trained by whichever "
            "optimizer holds it, or not at all. Build the optimizer after replacing the model's parameters "
            "(and load its state_dict) (docs/usage.md, Ownership).",
            UnownedExpertsWarning,
            stacklevel=user_stacklevel(),
        )


def mark_fsdp_expert_tensors() -> None:
    """Mark the expert tensors of the experts modules under FSDP2 (``fully_shard``): outside the forward
    those modules hold the sharded parameters that an optimizer is given, and they lost the mark of the
    tensors they replaced. Reads FSDP2's registry of the modules it manages."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return
    for root, state in list(_module_state_mapping.items()):
        if not isinstance(root, FSDPModule):
            continue
        for module in root.modules():
            tensors = specs.expert_tensors_of(module)
            if tensors is not None:
                specs.mark_expert_tensors(*tensors)
        # During a forward the modules hold the unsharded tensors: FSDP2's record of each sharded
        # parameter names its module and attribute (the registry holds its states weakly).
        if isinstance(state, weakref.ReferenceType):
            state = state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                info = getattr(fsdp_param, "_module_info", None)
                sharded = getattr(fsdp_param, "sharded_param", None)
                if info is None or sharded is None:
                    continue
                tensors = specs.expert_tensors_of(info.module)
                held = getattr(info.module, "_parameters", {}).get(info.param_name)
                if tensors is not None and any(held is t for t in tensors):
                    specs.mark_expert_tensors(sharded)


def warn_unowned_experts(optimizer) -> None:
    """Warn once per optimizer when its first step trains expert tensors (marked, with a gradient) that no
    in-backward optimizer owns: torch.optim.AdamW, transformers.Trainer's default optimizer, any other
    optimizer over a model whose experts run "sonar". torch.optim's global step pre-hook, installed at
    the first forward of an experts module."""
    if torch.compiler.is_compiling() or getattr(optimizer, _CHECKED, False):
        return
    setattr(optimizer, _CHECKED, True)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(_is_dtensor(p) for p in params):
        mark_fsdp_expert_tensors()
    pending = getattr(optimizer, "is_pending", None)
    unowned = [
        p
        for p in params
        if p.grad is not None
        and specs.is_expert_tensor(p)
        and getattr(specs.update_of(p), "optimizer", None) is None
        and not (pending is not None and pending(p))  # refused by the optimizer's own step()
    ]
    if unowned:
        warnings.warn(
            f"{type(optimizer).__name__} trains {len(unowned)} expert tensor(s) of experts running "
            '"sonar" as dense parameters: no in-backward optimizer owns them, so their gradients are kept in '
            ".grad (no memory saved) and any gradient clipping includes them. Build "
            "sonar_kernels.SonarAdamW over the model (or its parameters) to update them in the backward "
            "(docs/usage.md, Ownership).",
            UnownedExpertsWarning,
            stacklevel=user_stacklevel(),
        )


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


_installed = []


def _install_step_check() -> None:
    """Register :func:`warn_unowned_experts` as torch.optim's global step pre-hook, once per process."""
    if _installed:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def check(optimizer, args, kwargs):
        warn_unowned_experts(optimizer)

    _installed.append(register_optimizer_step_pre_hook(check))
