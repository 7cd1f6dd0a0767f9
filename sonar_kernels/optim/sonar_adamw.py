"""SonarAdamW: one optimizer for the whole model, expert weights updated in the backward pass."""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sonar_kernels import specs
from sonar_kernels.optim import dense as dense_step
from sonar_kernels.optim import distributed, lagged_clipping, ownership, saved_state
from sonar_kernels.optim.in_backward import InBackwardAdamW, is_expert_tensor
from sonar_kernels.optim.param_groups import check_group_options, torch_adamw_flags


class SonarAdamW(InBackwardAdamW, torch.optim.AdamW):
    """torch.optim.AdamW for the whole model, with the expert weights updated inside the backward pass.

    It goes where torch.optim.AdamW was. The expert tensors among the parameters (those of
    :class:`sonar_kernels.SonarExperts` modules, and, when a model is given, those of transformers experts
    modules running experts_implementation "sonar") are updated in the backward, as :class:`ExpertAdamW`
    does it: in the wgrad epilogue on the Triton backend (no gradient tensor), through torch's AdamW with
    their group's foreach/fused flags as soon as their gradient is accumulated otherwise. ``step()``
    clips the other (dense) parameters by their global norm when ``max_grad_norm`` is set, and applies
    torch.optim.AdamW to them. Expert gradients never exist as a whole, so no global norm clips them (the
    paper clips the dense parameters only); ``expert_clipping`` clips them inside their update.

    Which torch AdamW runs, the parameter groups and the state, non-finite gradients and GradScaler:
    docs/usage.md, "SonarAdamW", "Which AdamW runs where" and "Non-finite gradients".

    Args:
        params: an nn.Module (its parameters, in order) or parameters / parameter groups.
        lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable, differentiable, fused:
            torch.optim.AdamW's arguments, in its order and with its defaults and checks (the same
            exception types and messages). A group of dense parameters only takes each of them as
            torch.optim.AdamW does; a group that holds expert tensors refuses amsgrad, maximize,
            capturable, differentiable (and decoupled_weight_decay=False), which the in-backward update
            does not implement, with a ValueError naming the option (a group dict may set them off for
            the expert tensors while the constructor sets them for the others). A tensor lr or tensor
            betas get torch's arithmetic for tensors where torch's AdamW updates an expert tensor (torch
            backend); the Triton kernels read their values. foreach and fused also pick the torch AdamW
            path of the expert tensors updated outside the Triton kernels; None and None (the defaults):
            torch's fused AdamW wherever torch has it (above).
        max_grad_norm: clip the dense parameters' gradients to this global L2 norm in ``step()`` (as
            ``torch.nn.utils.clip_grad_norm_``); None: no clipping. The norm before clipping is kept in
            ``last_dense_grad_norm``.
        clip_norm_includes_experts: measure the global norm over the dense gradients and the expert
            gradients of this step's backward (``expert_grad_norm()``), the norm standard training with
            clip_grad_norm_ over all parameters would see, and scale the dense gradients by it; the
            expert updates, already applied, are not scaled. Kept in ``last_grad_norm``.
        expert_clipping: the expert gradients clipped inside their update (docs/design.md, "Expert
            clipping"; docs/usage.md: which to choose). "none" (default): not at all, the paper's method and
            today's bits. "spike": SPAM's rule (Huang et al., ICLR 2025, arXiv 2501.06842): an element with
            g^2 > spike_threshold * exp_avg_sq (before this step's update; nothing where it is 0) becomes
            sign(g) * sqrt(spike_threshold * exp_avg_sq); counted by ``expert_clipped_elements()``. "lagged"
            (needs max_grad_norm): step t's expert gradients times torch's coefficient
            min(1, max_grad_norm / (norm + 1e-6)) of step t-1's global norm over all parameters
            (``last_grad_norm``; the dense ones clipped by this step's, as with clip_norm_includes_experts);
            1 at the first step; ``expert_clip_coef``, saved in ``state_dict()`` and restored by
            ``load_state_dict()``.
        spike_threshold: theta of "spike", a finite number > 0 (SPAM's default 5000).
        moments_dtype, grad_dtype, fused_epilogue, accumulation_steps, master_weights, rounding_seed: for
            the expert tensors, as in ExpertAdamW (``moments_dtype="8bit"``: 8-bit moments;
            ``master_weights``: bf16 experts with an fp32 master, "remainder", or rounded stochastically,
            "stochastic"; with accumulation_steps=k, call ``step()`` once per k backward passes).
        data_parallel_group: the ProcessGroup (or 1-D DeviceMesh) over which the expert tensors are
            replicated, as in ExpertAdamW: their gradients are averaged over it before their update.
            Given a module, SonarAdamW puts its expert tensors on DDP's ignore list, so build it before
            ``DistributedDataParallel(model)`` wraps the module (DDP reduces the dense parameters; their
            clipping and update are torch's, in ``step()``).
    Raises:
        ValueError, TypeError, RuntimeError, IndexError: what torch.optim.AdamW raises for its own bad
            arguments.
        ValueError: a hyperparameter of a group holding expert tensors outside its range (finite
            values; a tensor must be a one-element CPU tensor), max_grad_norm not a finite float > 0, a
            non-dense expert tensor; a group holding expert tensors with maximize, amsgrad, capturable,
            differentiable or decoupled_weight_decay=False; a DistributedDataParallel-wrapped model whose
            reducer holds expert tensors. With more than one rank, an expert tensor that is neither
            sharded (FSDP2), expert-parallel nor covered by ``data_parallel_group`` is held undecided (no
            state) and refused at its module's first forward (ValueError) or at ``step()`` (RuntimeError),
            unless ``param_groups`` got its FSDP2 shard by then (accelerate's ``prepare``:
            :meth:`sync_param_groups`); expert tensors replaced in ``param_groups`` by tensors that are not
            experts (DeepSpeed ZeRO's flat partitions) are refused there too (RuntimeError), naming
            DeepSpeed; so are dense parameters of the model that FSDP2 sharded after this optimizer was
            built (RuntimeError; optim/managed.py). TypeError: an expert tensor of an unsupported dtype.
    """

    # Experts modules hand over the expert tensors it holds as dense ones (InBackwardAdamW.claim).
    adopts_expert_tensors = True
    # Whether step() warned that no expert tensor is updated in the backward (once per optimizer).
    _warned_no_experts = False

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        max_grad_norm: float | None = None,
        moments_dtype: torch.dtype | str | None = None,
        grad_dtype: torch.dtype | None = None,
        fused_epilogue: bool | None = None,
        accumulation_steps: int = 1,
        clip_norm_includes_experts: bool = False,
        data_parallel_group=None,
        master_weights: str | None = None,
        rounding_seed: int = 0,
        expert_clipping: str = "none",
        spike_threshold: float = 5000.0,
    ):
        # lr, betas, eps and weight_decay are checked by torch.optim.AdamW's own __init__ (below, before any
        # group is added: its exception types and messages), and again for the expert tensors' groups. Its
        # two checks that come after the groups are made first, so that they precede a refusal of an expert
        # group as they precede everything for torch.optim.AdamW (torch.optim.Adam.__init__'s words).
        if fused and differentiable:
            raise RuntimeError("`fused` does not support `differentiable`")
        if fused and foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        if max_grad_norm is not None and (
            not specs.is_real_number(max_grad_norm) or not math.isfinite(max_grad_norm) or max_grad_norm <= 0
        ):
            raise ValueError(f"max_grad_norm must be None or a finite float > 0, got {max_grad_norm!r}")
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        if clip_norm_includes_experts and max_grad_norm is None:
            raise ValueError("clip_norm_includes_experts=True needs max_grad_norm")
        if expert_clipping == "lagged" and max_grad_norm is None:
            raise ValueError('expert_clipping="lagged" needs max_grad_norm (the norm it clips to)')
        self.clip_norm_includes_experts = bool(clip_norm_includes_experts)
        self.last_dense_grad_norm: torch.Tensor | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self.dense_skipped_steps: torch.Tensor | None = None
        ignored_by_ddp = None  # (a module, its expert tensors) for DDP's ignore list
        self._init_in_backward(
            moments_dtype, grad_dtype, fused_epilogue, accumulation_steps, data_parallel_group, master_weights,
            rounding_seed, expert_clipping, spike_threshold,
        )  # fmt: skip
        if isinstance(params, nn.Module):
            model = params
            experts = ownership.scan_model(model)
            if experts:
                # Before any state exists: a DDP reducer that holds the experts is refused here; a DDP that
                # wraps the module later leaves them alone (no zero .grad of its own on them): its ignore
                # list, set once this optimizer is built (a refused construction leaves the module as it was).
                distributed.exclude_from_ddp(model, experts, apply=False)
                ignored_by_ddp = (model, experts)
            params = model.parameters()
        # torch.optim.AdamW's options apply as torch applies them; add_param_group refuses those the
        # in-backward update does not implement for a group that holds expert tensors.
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
            foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
        )  # fmt: skip
        if ignored_by_ddp is not None:
            distributed.exclude_from_ddp(*ignored_by_ddp)
            self.managed.remember_source(ignored_by_ddp[0])  # FSDP2 sharding it later is refused
        dense = self.dense_parameters()
        device = dense[0].device if dense else torch.device("cpu")
        self.dense_skipped_steps = torch.zeros((), dtype=torch.int64, device=device)
        ownership.register_adopter(self)

    @torch.compiler.disable
    def _set_lagged_coef(self, norm: torch.Tensor) -> None:
        """expert_clipping="lagged": the next step's coefficient from this step's global norm, on the device
        (optim/lagged_clipping.py, :func:`next_coef`)."""
        coef = self.expert_clip_coef if self.lagged_coef_set else None
        self.expert_clip_coef = lagged_clipping.next_coef(self.max_grad_norm, norm, coef)
        self.lagged_coef_set = True
        self._record.groups.set_clip_coef(self.expert_clip_coef)

    def add_param_group(self, param_group: dict) -> None:
        """As torch.optim.AdamW.add_param_group; the group's expert tensors are also set up for the
        in-backward update (state created now)."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        # A generator is consumed once, here. A plain dict (torch.compile traces no dict subclass in
        # param_groups): the backward reads the group when it runs, step() checks it (InBackwardAdamW).
        param_group = {**param_group, "params": params}
        # Named parameters ((name, tensor) pairs, as torch.optim takes them) are tensors with their names.
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        if any(isinstance(p, DTensor) for p in tensors):
            ownership.mark_fsdp_expert_tensors()  # FSDP2's sharded parameters lost their modules' marks
        experts = [p for p in tensors if is_expert_tensor(p)]
        # The options the group will have: its own, else the constructor's (torch fills them in below).
        check_group_options(type(self).__name__, {**self.defaults, **param_group}, bool(experts))
        ready, pending = self.managed.split_pending(experts)
        self.managed.check(ready)
        self.managed.check(pending, complete=False)
        super().add_param_group(param_group)
        self.managed.add(ready, pending)
        ownership.check_forward(*(specs.expert_module_of(p) for p in experts))
        # An experts module that finds one of these tensors at its forward hands it over (ownership.py).
        for p in tensors:
            specs.set_holder(p, self)
        self.managed.mark_synced()

    def sync_param_groups(self) -> None:
        """Follow entries of ``param_groups`` replaced since this optimizer last saw them (a new ``params``
        list in a group, or a group added), as accelerate's ``prepare`` does under FSDP2: it puts the
        shards (DTensors) of the model the optimizer was built on in the originals' places. The expert
        tensors among the new entries are updated in the backward from then on, those that left are
        forgotten (:meth:`ManagedTensors.follow`, optim/managed.py). Called at each experts module's forward
        (ownership.py) and at ``step()``; nothing is done when the groups are the lists it saw last.

        Raises:
            RuntimeError: an expert tensor that left the groups was updated or accumulated already, or expert
                tensors were replaced by tensors that are not experts (DeepSpeed ZeRO's flat partitions).
            ValueError, TypeError: a new expert tensor the update cannot take (:meth:`ManagedTensors.check`).
        """
        self.managed.follow()

    def is_pending(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is an expert tensor this optimizer holds and has not decided yet
        (:meth:`ManagedTensors.split_pending`)."""
        return self.managed.is_pending(p)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch.amp.GradScaler's question (torch.optim.AdamW answers it True for fused=True): whether
        ``step()`` takes GradScaler's ``grad_scale`` and ``found_inf``. True when torch's fused AdamW updates
        every group's dense parameters that have a gradient, by the group's flags or by default
        (:func:`torch_adamw_flags`): the path ``step()`` takes."""
        fused = [
            torch_adamw_flags(group, dense)[1]
            for group in getattr(self, "param_groups", [])
            if (dense := self._dense_of(group))
        ]
        return bool(fused) and all(fused)

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value: bool) -> None:
        # torch.optim.AdamW.__init__ sets it from its fused argument; here it follows the groups (above).
        pass

    def _warn_replaced_dense(self) -> None:
        """After a step in which expert tensors replaced by new objects were adopted: warn (once per
        optimizer) when dense parameters that require grad got no gradient, the sign that they were replaced
        too and are no longer trained (the optimizer holds the old objects, as torch.optim.AdamW would)."""
        self.managed.replaced_since_step = False
        stale = [p for p in self.dense_parameters() if p.requires_grad and p.grad is None]
        if stale and not getattr(self, "_warned_replaced_dense", False):
            self._warned_replaced_dense = True
            warnings.warn(_replaced_dense_message(len(stale)), stacklevel=ownership.user_stacklevel())

    def _dense_of(self, group: dict, with_grad: bool = True) -> list[torch.Tensor]:
        """The dense parameters of ``group`` (with a gradient when ``with_grad``)."""
        return [
            p
            for p in group["params"]
            if p not in self.managed.tensors and (p.grad is not None or not with_grad)
        ]

    def dense_parameters(self) -> list[torch.Tensor]:
        """The parameters updated by ``step()`` (not in the backward), in param_groups order; expert tensors
        not decided yet (:meth:`is_pending`) are not among them."""
        return [
            p
            for group in self.param_groups
            for p in group["params"]
            if p not in self.managed.tensors and not self.is_pending(p)
        ]

    def state_dict(self) -> dict:
        """As InBackwardAdamW.state_dict, with the state torch.optim.AdamW creates at a parameter's first
        step (``step`` 0, zero moments) for each dense parameter that requires grad and has none yet, so
        that a checkpoint holds every parameter from the start and resuming from it equals not stopping.

        torch.distributed.checkpoint.state_dict.get_optimizer_state_dict fills an optimizer's empty state
        by a step with zero gradients and lr 0 (which advances ``step``); this optimizer's state is never
        empty (its expert tensors' exists from the start), and set_optimizer_state_dict wants a state for
        every parameter that requires grad. An expert tensor held undecided (several ranks, before its module's
        first forward) gets the state its in-backward update will start from; with expert_clipping="lagged"
        each expert tensor's state also holds the lagged coefficient (``expert_clip_coef``, which
        torch.optim.AdamW ignores), so that resuming equals not stopping (optim/saved_state.py)."""
        return saved_state.complete(self, super().state_dict())

    def load_state_dict(self, state_dict: dict) -> None:
        """As InBackwardAdamW.load_state_dict; a dense parameter whose group runs torch's fused AdamW by
        default (``fused=None``, :func:`torch_adamw_flags`) gets its ``step`` as torch.optim.AdamW(fused=True)
        loads it: float32 on the parameter's device (a checkpoint of a non-fused AdamW keeps it on the CPU).
        With expert_clipping="lagged" the saved coefficient is restored (a checkpoint without one leaves it
        as it is: optim/saved_state.py, :func:`restore`)."""
        saved_state.restore(self, state_dict, super().load_state_dict)
        for group in self.param_groups:
            dense = self._dense_of(group, with_grad=False)
            if torch_adamw_flags(group, dense)[1]:
                for p in dense:
                    state = self.state.get(p)
                    if state and isinstance(state.get("step"), torch.Tensor):
                        state["step"] = state["step"].to(dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def step(self, closure=None):
        """Clip the dense parameters' gradients (``max_grad_norm``) and apply torch.optim.AdamW to them.

        The expert tensors were updated in the backward; a gradient found on one (it had
        requires_grad=False when the optimizer was built) is applied here, once, unclipped.

        Where torch's fused AdamW runs (fused=True, or the default flags), the ``grad_scale`` and
        ``found_inf`` attributes that ``torch.amp.GradScaler.step`` sets are honoured as torch's fused AdamW
        honours them, and left in place (see the class docstring).

        Compiles with ``torch.compile(optimizer.step)`` (torch's compiled-optimizer recipe): the dense
        clipping and AdamW are traced, the expert tensors' bookkeeping (and a closure) runs eagerly.

        Args:
            closure: optional, re-evaluates the model and returns the loss.
        Returns:
            The closure's loss, or None.
        Raises:
            RuntimeError: before anything changes (the step does not end), when a hyperparameter of a group
                whose expert tensors were updated in this step's backward changed since that update (set
                back, it steps): the update used the old value, the dense step would use the new one.
            ValueError: a group holding expert tensors sets maximize, amsgrad, capturable, differentiable or
                decoupled_weight_decay=False.
        """
        if not torch.compiler.is_compiling():
            self.sync_param_groups()
            self.managed.refuse_pending()
        loss = self._run_closure_and_end_step(closure)
        if self.managed.replaced_since_step and not torch.compiler.is_compiling():
            self._warn_replaced_dense()
        if not self.managed.tensors and not self._warned_no_experts and not torch.compiler.is_compiling():
            self._warned_no_experts = True
            warnings.warn(
                f"{type(self).__name__} updates no expert tensor in the backward: none of its parameters belongs "
                'to an experts module running experts_implementation "sonar" (SonarExperts, a transformers '
                'model switched to "sonar", torchtitan\'s SonarGroupedExperts), so it trains every parameter as '
                "torch.optim.AdamW does, with no memory saved (docs/usage.md, Ownership)",
                stacklevel=ownership.user_stacklevel(),
            )
        dense = [p for p in self.dense_parameters() if p.grad is not None]
        # Each group's dense parameters with a gradient, and its flags for torch's AdamW: its own, or by default
        # torch's fused AdamW where torch has it (torch_adamw_flags; the group keeps showing its own).
        stepped = [self._dense_of(group) for group in self.param_groups]
        flags = [
            torch_adamw_flags(group, params) for group, params in zip(self.param_groups, stepped, strict=True)
        ]
        dense_step.step(self, dense, stepped, flags, self._set_lagged_coef)
        return loss


def _replaced_dense_message(count: int) -> str:
    return (
        f"SonarAdamW: expert tensors replaced by new Parameter objects (load_state_dict(assign=True), to_empty(), "
        f"an assignment) were adopted with their state, but {count} dense parameter(s) it holds got no gradient "
        "in the step that followed: if they were replaced too, this optimizer still holds the old objects and "
        "no longer trains them (torch.optim.AdamW's rule). Build the optimizer after such a load and load its "
        "state_dict(), or load with copies (assign=False) (docs/usage.md, Ownership)."
    )
