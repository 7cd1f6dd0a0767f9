"""SonarAdamW: one optimizer for the whole model, expert weights updated in the backward pass."""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from sonar_kernels import ops, specs
from sonar_kernels.optim import distributed
from sonar_kernels.optim.in_backward import (
    InBackwardAdamW,
    check_group_options,
    is_expert_tensor,
    mark_expert_tensors,
)


class SonarAdamW(InBackwardAdamW, torch.optim.AdamW):
    """torch.optim.AdamW for the whole model, with the expert weights updated inside the backward pass.

    It goes where torch.optim.AdamW was. The expert tensors among the parameters (those of
    :class:`sonar_kernels.SonarExperts` modules, and, when a model is given, those of transformers experts
    modules running experts_implementation "sonar") are updated in the backward, as :class:`ExpertAdamW`
    does it: in the wgrad epilogue on the Triton backend (no gradient tensor), through torch's AdamW with
    this optimizer's foreach/fused flags as soon as their gradient is accumulated otherwise. ``step()``
    clips the other (dense) parameters by their global norm when ``max_grad_norm`` is set, and applies
    torch.optim.AdamW to them. Expert gradients are not clipped: they never exist as a whole (the
    Sonar-MoE paper clips the dense parameters only).

    The parameter groups and their order are the user's, as given (no hidden group), so the state
    indices of ``state_dict()`` are torch.optim.AdamW's, and a torch.optim.AdamW state_dict of the same
    model loads (and the reverse). LR schedulers drive both kinds of parameters: the backward reads the
    expert tensors' group when it runs. Expert tensors' state is created here (``step`` a 0-dim float32
    tensor on the parameter's device); the dense parameters' state is torch's, created at their first
    step. An expert tensor that gets no gradient in a step is not updated in that step (with
    ``zero_grad(set_to_none=False)`` torch.optim.AdamW would still decay it with a zero gradient). Each expert tensor is updated once between two ``step()`` calls, at the last of its
    ``accumulation_steps`` backward passes; see ExpertAdamW for the other rules (one live graph, no loss
    scaling).

    Non-finite gradients never reach the parameters or the optimizer state. An expert tensor's update
    is skipped when its gradient has an entry that is NaN, infinite or beyond ``ops.grad_limit``
    (decided on the device before the update; counted by ``expert_skipped_updates()``). The dense update
    of ``step()`` is skipped as a whole (all dense parameters, their moments and steps unchanged) when a
    dense gradient, after clipping, has such an entry or the clipping norm is not finite (with
    ``clip_norm_includes_experts`` that norm is inf as soon as one expert update was skipped: the dense
    gradients are then scaled to 0 or NaN by the clipping and the dense step is skipped, while the other
    expert tensors were updated in the backward); counted in
    ``dense_skipped_steps`` (a 0-dim int64 tensor). With fused=True torch's fused AdamW skips it on the
    device (its ``found_inf`` input, as torch.amp.GradScaler uses it); torch's foreach and single-tensor
    AdamW have no such input, so ``step()`` reads the decision on the host there (one sync per step on
    a GPU).

    Args:
        params_or_model: an nn.Module (its parameters, in order) or parameters / parameter groups.
        lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        max_grad_norm: clip the dense parameters' gradients to this global L2 norm in ``step()`` (as
            ``torch.nn.utils.clip_grad_norm_``); None: no clipping. The norm before clipping is kept in
            ``last_dense_grad_norm``.
        clip_norm_includes_experts: measure the global norm over the dense gradients and the expert
            gradients of this step's backward (``expert_grad_norm()``), the norm standard training with
            clip_grad_norm_ over all parameters would see, and scale the dense gradients by it; the
            expert updates, already applied, are not scaled. Kept in ``last_grad_norm``.
        foreach, fused: torch.optim.AdamW's flags, with its defaults; they also pick the torch AdamW path
            of expert tensors updated outside the Triton kernels.
        moments_dtype, grad_dtype, fused_epilogue, accumulation_steps: for the expert tensors, as in
            ExpertAdamW (with accumulation_steps=k, call ``step()`` once per k backward passes, as for
            standard accumulation).
        data_parallel_group: the ProcessGroup (or 1-D DeviceMesh) over which the expert tensors are
            replicated, as in ExpertAdamW: their gradients are averaged over it before their update.
            Given a module, SonarAdamW puts its expert tensors on DDP's ignore list, so build it before
            ``DistributedDataParallel(model)`` wraps the module (DDP reduces the dense parameters; their
            clipping and update are torch's, in ``step()``).
    Raises:
        ValueError: a hyperparameter outside its range (max_grad_norm must be a finite float > 0), a
            non-dense expert tensor; a group holding expert tensors with maximize, amsgrad, capturable,
            differentiable or decoupled_weight_decay=False; a DistributedDataParallel-wrapped model whose
            reducer holds expert tensors; with more than one rank, an expert tensor that is neither
            sharded (FSDP2), expert-parallel nor covered by ``data_parallel_group``.
        TypeError: an expert tensor of an unsupported dtype.
    """

    def __init__(
        self,
        params_or_model,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: float | None = None,
        foreach: bool | None = None,
        fused: bool | None = None,
        moments_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype | None = None,
        fused_epilogue: bool = True,
        accumulation_steps: int = 1,
        clip_norm_includes_experts: bool = False,
        data_parallel_group=None,
    ):
        ops.check_hyperparameters(lr, betas, eps, weight_decay)
        if max_grad_norm is not None and (
            isinstance(max_grad_norm, bool)
            or not isinstance(max_grad_norm, (int, float))
            or not math.isfinite(max_grad_norm)
            or max_grad_norm <= 0
        ):
            raise ValueError(f"max_grad_norm must be None or a finite float > 0, got {max_grad_norm!r}")
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        if clip_norm_includes_experts and max_grad_norm is None:
            raise ValueError("clip_norm_includes_experts=True needs max_grad_norm")
        self.clip_norm_includes_experts = bool(clip_norm_includes_experts)
        self.last_dense_grad_norm: torch.Tensor | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self.dense_skipped_steps: torch.Tensor | None = None
        self._init_in_backward(
            moments_dtype, grad_dtype, fused_epilogue, accumulation_steps, data_parallel_group
        )
        params = params_or_model
        if isinstance(params_or_model, nn.Module):
            # Modules that hold expert weights say which (SonarExperts.expert_tensors), copies included;
            # transformers experts modules running the "sonar" implementation are found by their config.
            other = set()
            for module in params_or_model.modules():
                if (tensors := specs.expert_tensors_of(module)) is not None:
                    mark_expert_tensors(*tensors)
                elif specs.is_experts_module(module):
                    other.add(getattr(getattr(module, "config", None), "_experts_implementation", None))
            if other:
                warnings.warn(
                    f"SonarAdamW: the model's experts run experts_implementation {sorted(map(str, other))}, not "
                    '"sonar": their tensors are dense parameters here (clipped and updated in step()). Switch '
                    'them first (model.set_experts_implementation("sonar")), then build the optimizer.',
                    stacklevel=2,
                )
            experts = [p for p in params_or_model.parameters() if is_expert_tensor(p)]
            if not experts and _selects_sonar(params_or_model):
                # The config asks for "sonar", but no experts module dispatches through transformers'
                # ExpertsInterface (e.g. JetMoe in transformers 5.24): nothing runs the kernels.
                batched = [name for name, p in params_or_model.named_parameters() if p.dim() == 3]
                warnings.warn(
                    'SonarAdamW: the model\'s config selects experts_implementation "sonar", but none of its modules '
                    "dispatches through transformers' ExpertsInterface, so no expert tensor is updated in the "
                    f"backward and every parameter is trained as a dense one; batched (3-D) weights: {batched[:4]}"
                    f"{' ...' if len(batched) > 4 else ''}. The sonar kernels do not run in this model.",
                    stacklevel=2,
                )
            if (
                isinstance(params_or_model, distributed.ddp_class())
                or self.data_parallel_group is not None
                or any(specs.expert_parallel_group(p) is not None for p in experts)
            ):
                # Before any state exists: a DDP reducer that holds the experts is refused here.
                distributed.exclude_from_ddp(params_or_model, experts)
            params = params_or_model.parameters()
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
            foreach=foreach, capturable=False, differentiable=False, fused=fused,
        )  # fmt: skip
        dense = self.dense_parameters()
        device = dense[0].device if dense else torch.device("cpu")
        self.dense_skipped_steps = torch.zeros((), dtype=torch.int64, device=device)

    def add_param_group(self, param_group: dict) -> None:
        """As torch.optim.AdamW.add_param_group; the group's expert tensors are also set up for the
        in-backward update (state created now)."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        # A generator is consumed once, here; the group tells this optimizer when a hyperparameter changes.
        param_group = self._watch_group({**param_group, "params": params})
        experts = [p for p in params if is_expert_tensor(p)]
        check_group_options(type(self).__name__, param_group, bool(experts))
        self._check_managed(experts)
        super().add_param_group(param_group)
        self._manage(experts)

    def _torch_adamw_flags(self, group: dict, p: torch.Tensor) -> tuple[bool | None, bool | None]:
        # The flags torch.optim.AdamW.step would use for this group: the same arithmetic as standard training.
        return group["foreach"], group["fused"]

    def dense_parameters(self) -> list[torch.Tensor]:
        """The parameters updated by ``step()`` (not in the backward), in param_groups order."""
        return [p for group in self.param_groups for p in group["params"] if p not in self._managed]

    @torch.no_grad()
    def step(self, closure=None):
        """Clip the dense parameters' gradients (``max_grad_norm``) and apply torch.optim.AdamW to them.

        The expert tensors were updated in the backward; a gradient found on one (it had
        requires_grad=False when the optimizer was built) is applied here, once, unclipped.

        Args:
            closure: optional, re-evaluates the model and returns the loss.
        Returns:
            The closure's loss, or None.
        """
        loss = self._run_closure_and_end_step(closure)
        dense = [p for p in self.dense_parameters() if p.grad is not None]
        norm = None
        if self.max_grad_norm is not None:
            if self.clip_norm_includes_experts:
                dense_norm = torch.nn.utils.get_total_norm([p.grad for p in dense])
                expert_norm = self.expert_grad_norm().to(dense_norm.device)
                norm = torch.sqrt(dense_norm.square() + expert_norm.square())
                torch.nn.utils.clip_grads_with_norm_(dense, self.max_grad_norm, norm)
                self.last_dense_grad_norm, self.last_grad_norm = dense_norm, norm
            else:
                norm = torch.nn.utils.clip_grad_norm_(dense, self.max_grad_norm)
                self.last_dense_grad_norm = norm
        if not dense:
            return loss
        found = _found_inf(dense, norm).to(self.dense_skipped_steps.device)
        # torch.optim.AdamW's own step, unwrapped: Optimizer hooks wrap it once another AdamW exists, and
        # they already ran around this step().
        adamw_step = torch.optim.AdamW.step
        adamw_step = getattr(adamw_step, "__wrapped__", adamw_step)
        if all(
            group["fused"] for group in self.param_groups if any(p.grad is not None for p in group["params"])
        ):
            # torch's fused AdamW skips every parameter (step included) when found_inf is 1.
            self.found_inf = found.float()
            try:
                adamw_step(self)
            finally:
                del self.found_inf
        elif not bool(found):  # torch's other AdamW paths take no found_inf: a host sync
            adamw_step(self)
        self.dense_skipped_steps += found.long()
        return loss


def _selects_sonar(model: nn.Module) -> bool:
    """Whether a config of ``model`` (or of a submodule) selects experts_implementation "sonar"."""
    return any(
        getattr(getattr(m, "config", None), "_experts_implementation", None) == specs.IMPLEMENTATION
        for m in model.modules()
    )


def _found_inf(params: list[torch.Tensor], norm: torch.Tensor | None) -> torch.Tensor:
    """A 0-dim bool tensor on the first parameter's device: True when a gradient of ``params`` has an entry
    that is NaN, infinite, or beyond ``ops.grad_limit`` of the parameter's dtype (torch.optim.AdamW keeps
    the moments in it), or when ``norm`` is given and not finite."""
    device = params[0].grad.device
    found = torch.zeros((), dtype=torch.bool, device=device)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.grad.device, p.dtype), []).append(p.grad)
    for (_, dtype), grads in groups.items():
        # A DTensor gradient (FSDP2's shard) is reduced over its mesh.
        largest = torch.stack([ops.whole(n).float() for n in torch._foreach_norm(grads, float("inf"))]).amax()
        found |= (~(largest <= ops.grad_limit(dtype))).to(device)
    if norm is not None:
        found |= ~torch.isfinite(ops.whole(norm)).to(device)
    return found
