"""torchtitan integration: the routed experts of torchtitan's MoE models on the sonar kernels, and SonarAdamW
as torchtitan's optimizer.

Import this module only where torchtitan is installed (tested with torchtitan 0.3.0); without it the import
raises ImportError. Two pieces, each usable alone:

- :class:`SonarGroupedExperts`, a subclass of torchtitan's ``GroupedExperts`` whose forward runs
  :func:`sonar_kernels.grouped_mlp`. Same parameters (``w1_EFD`` the gate [E, F, D], ``w3_EFD`` the up
  projection [E, F, D], ``w2_EDF`` the down projection [E, D, F]), names, layout, initialisation and
  sharding config, so checkpoints (and torchtitan's Hugging Face state-dict adapters) are unchanged: no
  state-dict hook is needed. It replaces the stock module through torchtitan's override mechanism
  (``--override.imports sonar_kernels.integrations.torchtitan.sonar_grouped_experts``, the factory
  :func:`sonar_grouped_experts`), or on a built model with :func:`swap_grouped_experts`.
- :class:`SonarOptimizersContainer`, torchtitan's ``OptimizersContainer`` that also knows the optimizer name
  ``"SonarAdamW"`` (:class:`sonar_kernels.SonarAdamW`). :func:`sonar_adamw` is its config (torchtitan's
  ``default_adamw`` with SonarAdamW), and the override :func:`sonar_optimizers` turns a trainer's AdamW
  config into it (``--override.imports sonar_kernels.integrations.torchtitan.sonar_optimizers``).

With both, the expert weights are updated inside the backward (no expert gradient is kept) and the other
parameters by torch.optim.AdamW in ``optimizers.step()``. The trainer's gradient clipping
(``training.max_norm``, torchtitan's ``clip_grad_norm_`` over every parameter's ``.grad``) then sees the
dense gradients only, because the experts hold no ``.grad`` when it runs: it clips the dense parameters by
their own norm (the Sonar-MoE paper's dense-only clipping, SonarAdamW's default rule) and the ``grad_norm``
it logs is the dense parameters' norm. The expert gradients are never clipped. For a norm over every
parameter, pass ``max_grad_norm`` and ``clip_norm_includes_experts=True`` to SonarAdamW and set
``training.max_norm`` to ``inf`` (use one of the two thresholds, not both).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor
    from torchtitan.components.optimizer import OptimizersContainer, default_adamw
    from torchtitan.config import derive, override
    from torchtitan.models.common.moe import GroupedExperts
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "sonar_kernels.integrations.torchtitan needs torchtitan (tested with torchtitan 0.3.0: "
        f"pip install torchtitan==0.3.0); importing it failed: {error}"
    ) from error

from sonar_kernels.autograd.moe_mlp import grouped_mlp
from sonar_kernels.optim import SonarAdamW
from sonar_kernels.optim.ownership import claim_expert_tensors
from sonar_kernels.specs import BACKENDS, expert_tensors_of, mark_expert_tensors

__all__ = [
    "COMPUTE_DTYPES",
    "EXPERT_WEIGHTS",
    "SonarGroupedExperts",
    "SonarOptimizersContainer",
    "sonar_adamw",
    "sonar_grouped_experts",
    "sonar_optimizers",
    "swap_grouped_experts",
]

# GroupedExperts' parameters, in their registration order: the gate, down and up projections.
EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")
# "bfloat16": as the stock GroupedExperts, which casts its input and weights to bf16 and the output back to
# the input's dtype; "input": the GEMMs run in the input's dtype (float32, bfloat16 or float16).
COMPUTE_DTYPES = ("bfloat16", "input")
# SonarAdamW's options given by name from a JSON override entry (dtypes as strings).
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_OPTIMIZER = "SonarAdamW"


def _check_options(backend, compute_dtype) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")


class SonarGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` (SwiGLU experts over tokens grouped by expert) on the sonar kernels.

    Parameters, as the stock module (same names, shapes and layout, so state_dicts move between the two
    unchanged): ``w1_EFD`` the gate projection [E, F, D], ``w3_EFD`` the up projection [E, F, D], ``w2_EDF``
    the down projection [E, D, F] (E experts, D = ``dim``, F = ``hidden_dim``). They are marked as expert
    tensors (:func:`sonar_kernels.specs.mark_expert_tensors`, again whenever one is set) and named by
    :meth:`expert_tensors`, so :class:`sonar_kernels.SonarAdamW` updates them inside the backward.

    Config (``SonarGroupedExperts.Config``): ``GroupedExperts.Config``'s fields (``dim``, ``hidden_dim``,
    ``num_experts``, ``param_init``, ``sharding_config``) and

    - ``backend``: "auto" (Triton on CUDA, the torch backend otherwise), "triton" or "torch"
      (see :func:`sonar_kernels.grouped_mlp`);
    - ``compute_dtype``: "bfloat16" (default; the stock forward's numerics: the input is cast to bf16,
      float32 weights are rounded to bf16 inside the GEMMs instead of being copied, the output is cast back
      to the input's dtype) or "input" (the GEMMs run in the input's dtype, e.g. float32 end to end).

    Raises:
        ValueError: an unknown ``backend`` or ``compute_dtype`` (when the config is made, and again when
            the module is built).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        backend: str = "auto"
        compute_dtype: str = "bfloat16"

        def __post_init__(self):
            _check_options(self.backend, self.compute_dtype)

    def __init__(self, config: Config):
        _check_options(config.backend, config.compute_dtype)
        super().__init__(config)
        self.backend = config.backend
        self.compute_dtype = config.compute_dtype

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """The experts' SwiGLU MLP, row block by row block: ``w2_e(silu(w1_e x) * w3_e x)``.

        Args:
            x_RD: [R, D] local tensor (float32, bfloat16 or float16), rows grouped by expert in expert
                order (torchtitan's token dispatcher's output).
            num_tokens_per_expert_E: [E] integer counts (E the local experts), summing to at most R; rows
                from the sum on are padding (output 0).
        Returns:
            [R, D] in x_RD's dtype.
        Raises:
            TypeError: x_RD or the counts are DTensors (torchtitan runs this module on local tensors,
                inside RoutedExperts' ``local_map``).
            ValueError: some weights are DTensors and others not, or a weight DTensor has a placement other
                than Shard or Replicate (a Partial weight); and every error of
                :func:`sonar_kernels.grouped_mlp` (shapes, dtypes, counts).

        DTensor weights (expert parallelism, tensor parallelism on the experts, FSDP2) are used through
        their local shards, as the stock forward does; their gradient goes back to the DTensor parameter,
        whose owner (SonarAdamW) updates it once the gradient is complete (see docs/distributed.md, "Distributed
        training"; SonarAdamW refuses a layout whose local gradient would be partial, e.g. experts
        replicated over data-parallel ranks).
        """
        for name, t in (("x_RD", x_RD), ("num_tokens_per_expert_E", num_tokens_per_expert_E)):
            if isinstance(t, DTensor):
                raise TypeError(
                    f"{name} is a DTensor; SonarGroupedExperts, as torchtitan's GroupedExperts, takes local tensors "
                    "(torchtitan's RoutedExperts runs it inside local_map)"
                )
        claim_expert_tensors(*self.expert_tensors(), module=self)
        gate, down, up = _local_weights(self)
        compute = torch.bfloat16 if self.compute_dtype == "bfloat16" else x_RD.dtype
        # Weights of one dtype, the compute dtype or float32 (rounded inside the GEMMs), are used as they are;
        # otherwise they are cast, as the stock forward casts every weight (the cast's gradient reaches the
        # parameter, whose owner updates it from there).
        dtypes = {gate.dtype, down.dtype, up.dtype}
        if len(dtypes) > 1 or dtypes.isdisjoint((compute, torch.float32)):
            gate, down, up = (w.to(compute) for w in (gate, down, up))
        out = grouped_mlp(
            x_RD.to(compute), num_tokens_per_expert_E, gate, down, up_proj=up, activation="silu",
            backend=self.backend,
        )  # fmt: skip
        return out.to(x_RD.dtype)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """As nn.Module.register_parameter; the expert weights are marked as expert tensors whenever they are
        set (construction, assignment, ``load_state_dict(assign=True)``)."""
        super().register_parameter(name, param)
        if name in EXPERT_WEIGHTS and param is not None:
            mark_expert_tensors(param)

    def __setstate__(self, state) -> None:
        # copy.deepcopy and unpickling rebuild the module without __init__: mark the new tensors.
        super().__setstate__(state)
        mark_expert_tensors(*self.expert_tensors())

    def expert_tensors(self) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
        """(w1_EFD, w2_EDF, w3_EFD): the tensors :class:`sonar_kernels.SonarAdamW` updates in the backward."""
        return tuple(getattr(self, name) for name in EXPERT_WEIGHTS)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, backend={self.backend!r}, compute_dtype={self.compute_dtype!r}"
        )


def _local_weights(module: GroupedExperts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate, down, up): the module's weights, their local shards when they are DTensors."""
    weights = [getattr(module, name) for name in EXPERT_WEIGHTS]
    distributed = [isinstance(w, DTensor) for w in weights]
    if not any(distributed):
        return tuple(weights)
    if not all(distributed):
        names = [name for name, d in zip(EXPERT_WEIGHTS, distributed, strict=True) if d]
        raise ValueError(
            f"{names} are DTensors and the other expert weights are not; shard w1_EFD, w2_EDF and w3_EFD alike"
        )
    for name, w in zip(EXPERT_WEIGHTS, weights, strict=True):
        for placement in w.placements:
            if not (placement.is_shard() or placement.is_replicate()):
                raise ValueError(
                    f"{name} has the DTensor placement {placement}: only Shard and Replicate weights are supported "
                    "(the local tensor of a partial weight is not a weight)"
                )
    return tuple(w.to_local() for w in weights)


@override(
    target=GroupedExperts.Config,
    exact=True,
    description="sonar-kernels: routed experts on the sonar grouped-MLP kernels (AdamW in the backward)",
)
def sonar_grouped_experts(
    cfg: GroupedExperts.Config, *, backend: str = "auto", compute_dtype: str = "bfloat16"
) -> SonarGroupedExperts.Config:
    """torchtitan override: every stock ``GroupedExperts.Config`` of the config tree becomes a
    :class:`SonarGroupedExperts` config with the same fields (``param_init``, ``sharding_config`` included).

    Activate it with ``--override.imports sonar_kernels.integrations.torchtitan.sonar_grouped_experts`` (or
    ``override=OverrideConfig(imports=[...])``), with options as JSON:
    ``'sonar_kernels.integrations.torchtitan.sonar_grouped_experts={"backend": "triton"}'``. Only configs of
    exactly ``GroupedExperts.Config`` are claimed: its subclasses (gpt-oss's experts, the fused w13 override)
    have other weights or activations and stay as they are.

    Raises:
        ValueError: an unknown backend or compute_dtype.
    """
    return derive(cfg, SonarGroupedExperts.Config, backend=backend, compute_dtype=compute_dtype)


def swap_grouped_experts(model: nn.Module, *, backend: str = "auto", compute_dtype: str = "bfloat16") -> int:
    """Make every stock ``GroupedExperts`` module of a built ``model`` a :class:`SonarGroupedExperts`, in place:
    the same module objects (their class changes), the same Parameter objects under the same names, so the
    model's state_dict keys and values, hooks and references stay as they were; the weights are marked as
    expert tensors. Call it before ``fully_shard``/parallelization and before building the optimizer.

    Modules of a subclass of GroupedExperts (gpt-oss's, the fused w13 override's, torchtitan's float8/MXFP8
    converters') compute something else and are left as they are, not counted; SonarGroupedExperts modules
    get the given backend and compute_dtype and are not counted.

    Args:
        model: any nn.Module.
        backend, compute_dtype: as :class:`SonarGroupedExperts`'s config.
    Returns:
        The number of modules swapped.
    Raises:
        ValueError: an unknown backend or compute_dtype, or a GroupedExperts already parallelized
            (torchtitan's ``parallelize``, which wraps its forward) or wrapped by FSDP2's ``fully_shard``;
            nothing is changed then.
        TypeError: ``model`` is not an nn.Module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_options(backend, compute_dtype)
    from torch.distributed.fsdp import FSDPModule

    stock, sonar = [], []
    for name, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        # torchtitan's parallelize() wraps the module's forward in an instance attribute, which a new class
        # would not change: the stock forward would keep running.
        if (
            isinstance(module, FSDPModule)
            or "forward" in vars(module)
            or getattr(module, "_parallelized", False)
        ):
            raise ValueError(
                f"{name or 'model'} ({type(module).__name__}) was already parallelized or wrapped by fully_shard; "
                "call swap_grouped_experts before parallelizing the model (or use the override "
                "sonar_grouped_experts, applied to the config before the model is built)"
            )
        if isinstance(module, SonarGroupedExperts):
            sonar.append(module)
        elif type(module) is GroupedExperts:
            stock.append(module)
    for module in stock:
        module.__class__ = SonarGroupedExperts
    for module in stock + sonar:
        module.backend, module.compute_dtype = backend, compute_dtype
        mark_expert_tensors(*module.expert_tensors())
    return len(stock)


class SonarOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with the optimizer name ``"SonarAdamW"``
    (:class:`sonar_kernels.SonarAdamW`) besides torchtitan's own ("AdamW", "Adam", "DistMuon").

    Built as torchtitan builds its optimizers (``config.build(model_parts=model_parts)``, the trainer's
    call). Before the optimizers are made, the expert tensors of every module that names them
    (``expert_tensors()``: :class:`SonarGroupedExperts`, :class:`sonar_kernels.SonarExperts`) are marked, so
    a param group of ``"SonarAdamW"`` updates them in the backward, also after ``fully_shard`` or
    ``to_empty`` replaced the Parameter objects. Each group's kwargs (``ParamGroupConfig.optimizer_kwargs``
    and torchtitan's fused/foreach flags) become SonarAdamW's parameter groups; SonarAdamW's own options
    (``accumulation_steps``, ``fused_epilogue``, ``moments_dtype``, ``grad_dtype``, ``max_grad_norm``,
    ``clip_norm_includes_experts``) come from ``optimizer_factory_kwargs_by_name["SonarAdamW"]``.

    What the trainer sees: after the backward the expert tensors hold no ``.grad`` (they were updated), so
    the trainer's ``clip_grad_norm_`` clips and reports the dense parameters only (see the module
    docstring). ``accumulation_steps`` must equal the number of backward passes the trainer runs per
    optimizer step, its gradient accumulation steps (with pipeline parallelism each microbatch's backward
    counts too); one backward more raises RuntimeError. With more than one rank, the expert tensors must be
    DTensors sharded on every mesh dimension (FSDP2, torchtitan's data_parallel_shard_degree, with or
    without expert parallelism) or declared expert-parallel (:func:`sonar_kernels.specs.mark_expert_parallel`);
    SonarAdamW refuses any other layout with a ValueError when the optimizer is built (experts replicated
    over HSDP's or DDP's replicate dimension; plain local tensors, as torchtitan's default "spmd_types"
    backend leaves them without FSDP), rather than update them from a partial gradient.

    Checkpoints: ``state_dict()`` / ``load_state_dict()`` are torchtitan's flat, FQN-keyed form with
    torch.optim.AdamW's keys, so a checkpoint moves between this container and the stock AdamW one. SonarAdamW
    creates the expert tensors' state when it is built; the dense parameters' state is created here, before
    saving or loading, by the zero-gradient, zero-lr step torchtitan uses (torchtitan's own helper skips an
    optimizer that already holds any state).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name == _OPTIMIZER:
            return SonarAdamW
        return OptimizersContainer._resolve_optimizer_factory(name)

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        options = config.optimizer_factory_kwargs_by_name.get(_OPTIMIZER, {})
        for key in ("moments_dtype", "grad_dtype"):
            if isinstance(options.get(key), str):
                if options[key] not in _DTYPES:
                    raise ValueError(f"{key} must be one of {sorted(_DTYPES)}, got {options[key]!r}")
                options = {**options, key: _DTYPES[options[key]]}
        config = dataclasses.replace(
            config,
            optimizer_factory_kwargs_by_name={**config.optimizer_factory_kwargs_by_name, _OPTIMIZER: options},
        )
        experts = []
        for model in model_parts:
            for module in model.modules():
                tensors = expert_tensors_of(module)
                if tensors is not None:
                    mark_expert_tensors(*tensors)
                    experts.extend(tensors)
        super().__init__(config, model_parts=model_parts)
        managed = set()
        for optimizer in self.optimizers:
            if isinstance(optimizer, SonarAdamW):
                dense = {id(p) for p in optimizer.dense_parameters()}
                managed |= {id(p) for g in optimizer.param_groups for p in g["params"] if id(p) not in dense}
        if experts and not any(id(p) in managed for p in experts):
            warnings.warn(
                f"SonarOptimizersContainer: no param group of {_OPTIMIZER!r} holds the model's {len(experts)} expert "
                "tensors, so they are trained as dense parameters (gradients in .grad, clipped and updated in step())",
                stacklevel=2,
            )

    def state_dict(self):
        for optimizer in self.optimizers:
            _create_dense_state(optimizer)
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        for optimizer in self.optimizers:
            _create_dense_state(optimizer)
        super().load_state_dict(state_dict)


def _create_dense_state(optimizer) -> None:
    """Create the state of a SonarAdamW's dense parameters when none of them has any (before the first step)
    by a step with zero gradients and lr 0, which leaves the parameters unchanged; nothing when a gradient is
    set (a step in progress)."""
    if not isinstance(optimizer, SonarAdamW):
        return
    dense = [p for p in optimizer.dense_parameters() if p.requires_grad]
    if not dense or any(p in optimizer.state or p.grad is not None for p in dense):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in dense:
            p.grad = torch.zeros_like(p)
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p in dense:
            p.grad = None


def sonar_adamw(
    lr: float = 8e-4,
    *,
    accumulation_steps: int = 1,
    fused_epilogue: bool | None = None,
    moments_dtype: torch.dtype | None = None,
    grad_dtype: torch.dtype | None = None,
    **kwargs,
) -> SonarOptimizersContainer.Config:
    """torchtitan's ``default_adamw(lr, **kwargs)`` (one catch-all param group: betas (0.9, 0.95), eps
    1e-8, weight_decay 0.1 unless given) with :class:`sonar_kernels.SonarAdamW` in place of AdamW; for a
    trainer config's ``optimizer=``. ``accumulation_steps``, ``fused_epilogue``, ``moments_dtype`` and
    ``grad_dtype`` are SonarAdamW's options (``accumulation_steps`` must equal the trainer's gradient
    accumulation steps). Build it as torchtitan does: ``sonar_adamw(...).build(model_parts=[model])``."""
    return _to_sonar(
        default_adamw(lr=lr, **kwargs),
        accumulation_steps=accumulation_steps,
        fused_epilogue=fused_epilogue,
        moments_dtype=moments_dtype,
        grad_dtype=grad_dtype,
    )


def _to_sonar(cfg: OptimizersContainer.Config, **options) -> SonarOptimizersContainer.Config:
    groups = [
        dataclasses.replace(group, optimizer_name=_OPTIMIZER) if group.optimizer_name == "AdamW" else group
        for group in cfg.param_groups
    ]
    factory_kwargs = dict(cfg.optimizer_factory_kwargs_by_name)
    factory_kwargs[_OPTIMIZER] = {**factory_kwargs.pop("AdamW", {}), **options}
    return derive(
        cfg,
        SonarOptimizersContainer.Config,
        param_groups=groups,
        optimizer_factory_kwargs_by_name=factory_kwargs,
    )


@override(
    target=OptimizersContainer.Config,
    exact=True,
    description="sonar-kernels: SonarAdamW in place of AdamW (expert weights updated in the backward)",
)
def sonar_optimizers(cfg: OptimizersContainer.Config, **options) -> SonarOptimizersContainer.Config:
    """torchtitan override: the trainer's ``OptimizersContainer.Config`` becomes a
    :class:`SonarOptimizersContainer` config whose "AdamW" param groups are "SonarAdamW" ones (same patterns
    and kwargs; other optimizers' groups unchanged). ``options`` are SonarAdamW's keyword options
    (``accumulation_steps``, ``fused_epilogue``, ``moments_dtype``/``grad_dtype`` as "float32", "bfloat16" or
    "float16"), e.g. ``'sonar_kernels.integrations.torchtitan.sonar_optimizers={"accumulation_steps": 2}'``.
    Activate it with ``--override.imports sonar_kernels.integrations.torchtitan.sonar_optimizers``."""
    return _to_sonar(cfg, **options)
