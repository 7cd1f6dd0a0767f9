"""The in-backward AdamW of ExpertAdamW and SonarAdamW: which tensors an optimizer updates in the backward,
and the update handle it attaches to each (docs/design.md, "When the updates run"; docs/usage.md,
"Ownership").

A tensor "managed" here is updated inside the backward pass. The optimizer attaches an
:class:`sonar_kernels.specs.ExpertUpdate` to it (``OwnedUpdate``: the state tensors, and the
bookkeeping the autograd layer calls in eager mode), so that the expert MLP's backward applies the
update itself: in the Triton wgrad epilogue, or through torch's AdamW right after its gradient is
computed (the torch backend); in eager mode once the tensor's whole gradient is known (the pre-hook of
its AccumulateGrad node, with the parts of other uses of the tensor added). A gradient that reaches
``.grad`` instead (a weight passed to the MLP as a cast or another copy, a penalty on the weights,
FSDP2's reduced shard) is applied by the optimizer's post-accumulate-grad hook on the tensor, then
released.

Each managed tensor carries at most one update and one hook of this library: the newest optimizer owns
it (an older one lets it go), and both are removed when their optimizer is garbage-collected.

The parts, by concern (each module's public names are its seam; none reads another's underscore names):

- here: construction, the step protocol, and torch.optim.Optimizer's ``zero_grad``, ``state_dict``,
  ``load_state_dict``;
- optim/managed.py: ownership (:class:`ManagedTensors`, the optimizer's ``managed``: the tensors it
  updates in the backward, conversions, a tensor replaced by a new object, an older owner letting go and
  taking back, ``param_groups`` entries replaced after it was built);
- optim/update_handle.py: the update handle attached to each tensor (what the autograd layer calls);
- optim/telemetry.py: ``expert_grad_norm`` and ``expert_skipped_updates``;
- optim/updates.py: what this step's updates did, the checks before each, the ``.grad`` path, the step's end;
- optim/accumulation.py: micro-batch accumulation (``accumulation_steps``, buffers of ``grad_dtype``);
- optim/reentrant.py: reentrant activation checkpointing's held gradients;
- optim/param_groups.py: the options the update implements, torch's AdamW flags, the hyperparameters
  tensor the kernels read;
- optim/expert_state.py: the AdamW state created, converted, saved and loaded;
- optim/grad_hooks.py: the post-accumulate-grad hook, and the refusal of a hook of the user's;
- optim/distributed.py, optim/loss_scaling.py: several ranks; GradScaler's refusal.
"""

from __future__ import annotations

import weakref

import torch

from sonar_kernels import ops, specs
from sonar_kernels.optim import distributed, loss_scaling
from sonar_kernels.optim.expert_state import (
    EIGHT_BIT,
    check_loadable,
    check_master_weights,
    load_expert_state,
    load_fp32_masters,
    with_cpu_steps,
)
from sonar_kernels.optim.managed import ManagedTensors
from sonar_kernels.optim.param_groups import check_expert_clipping
from sonar_kernels.optim.telemetry import ExpertTelemetry
from sonar_kernels.optim.update_handle import expert_optimizer, release_entries
from sonar_kernels.optim.updates import InBackwardUpdates
from sonar_kernels.specs import is_expert_tensor, mark_expert_tensors

__all__ = ["InBackwardAdamW", "expert_optimizer", "is_expert_tensor", "mark_expert_tensors"]


class InBackwardAdamW(ExpertTelemetry):
    """Mixin for a torch.optim.Optimizer whose managed tensors are updated in the backward pass.

    The host-class protocol (the underscore names its subclasses use, and only they): the host calls
    :meth:`_init_in_backward` before ``Optimizer.__init__``, ``managed.check`` and ``managed.manage`` for
    the tensors to update in the backward (state created there, torch.optim.AdamW's layout), and
    :meth:`_run_closure_and_end_step` in its ``step()``. ``managed`` (:class:`ManagedTensors`,
    optim/managed.py) owns the tables: ``p in self.managed.tensors`` for the tensors it updates in the
    backward.
    """

    # -- Construction and the tables ---------------------------------------------------------------------

    def _init_in_backward(
        self,
        moments_dtype,
        grad_dtype,
        fused_epilogue,
        accumulation_steps=1,
        data_parallel_group=None,
        master_weights=None,
        rounding_seed=0,
        expert_clipping="none",
        spike_threshold=5000.0,
    ) -> None:
        # Expert clipping (docs/design.md, "Expert clipping"), checked before anything else is set up.
        self.expert_clipping, self.spike_threshold = check_expert_clipping(expert_clipping, spike_threshold)
        # "lagged": the coefficient the next step's expert updates multiply their gradients by (step() sets it).
        self.expert_clip_coef, self.lagged_coef_set = torch.ones((), dtype=torch.float32), False
        for name, dtype in (("moments_dtype", moments_dtype), ("grad_dtype", grad_dtype)):
            if name == "moments_dtype" and dtype == EIGHT_BIT:
                continue
            if dtype is not None and dtype not in ops.SUPPORTED_DTYPES:
                eight_bit = ', or "8bit"' if name == "moments_dtype" else ""
                raise TypeError(
                    f"{name} must be None, torch.float32, torch.bfloat16 or torch.float16{eight_bit}, got {dtype!r}"
                )
        self.master_weights = check_master_weights(master_weights)
        if not specs.is_integer(rounding_seed):
            raise TypeError(f"rounding_seed must be an int, got {type(rounding_seed).__name__}")
        self.rounding_seed = int(rounding_seed)
        if self.master_weights is not None and moments_dtype is None:
            moments_dtype = torch.float32  # AdamW on the fp32 master: fp32 moments, as torch.optim.AdamW's
        self.accumulation_steps = accumulation_steps
        loss_scaling.install()  # a backward of a GradScaler-scaled loss is refused before any update
        # The group over which the expert tensors are replicated; their gradients are averaged over it
        # before their update (optim/distributed.py).
        self.data_parallel_group = distributed.resolve_group(data_parallel_group)
        self.moments_dtype = moments_dtype
        self.grad_dtype = grad_dtype
        self.fused_epilogue = None if fused_epilogue is None else bool(fused_epilogue)  # None: tuned on CUDA
        # What this step's updates did, and the update path (optim/updates.py); raises ValueError for an
        # accumulation_steps that is not an int >= 1.
        self._record = InBackwardUpdates(self, accumulation_steps, grad_dtype)
        # The tensors it updates in the backward and their life cycle (optim/managed.py).
        self.managed = ManagedTensors(self, self._record)
        weakref.finalize(self, release_entries, self.managed.entries, self.managed.previous)

    # -- Ownership: which tensors this optimizer updates (optim/managed.py) --------------------------------

    def claim(self, p: torch.Tensor) -> None:
        """``p`` is an expert tensor that its experts module is about to run (called at each eager forward
        by :func:`sonar_kernels.optim.ownership.claim_expert_tensors`): when this optimizer updates it in
        the backward, rebuild its update if ``p`` was converted since (another dtype or device: its state
        follows, as if the optimizer had been built after the conversion when no update has run yet); when
        it holds ``p`` as a dense parameter (SonarAdamW), adopt it.

        Raises:
            RuntimeError: ``p`` was converted, or has a gradient of a dense backward, between a backward
                and ``step()``.
            ValueError, TypeError: ``p``'s parameter group sets an option the update does not implement,
                or ``p`` is not a tensor the update takes (see :meth:`ManagedTensors.check`).
        """
        self.managed.claim(p)

    def adopt_replacement(self, old: torch.Tensor, new: torch.Tensor) -> bool:
        """``new`` replaced ``old``, a tensor this optimizer updates in the backward, in its experts module
        after training started (``load_state_dict(assign=True)``, ``to_empty()`` or a conversion that makes
        new Parameter objects, an assignment; called by
        :func:`sonar_kernels.optim.ownership.claim_expert_tensors` at the module's next forward): ``new``
        takes ``old``'s place in its parameter group (the same index, so ``state_dict()`` ids are unchanged)
        with its state, step, seed and telemetry, and is updated in the backward from then on; ``old`` is
        let go (no update, no hook, no entry of this optimizer keeps it). The state is kept as it is when
        ``new`` has ``old``'s dtype, device and strides (the run equals one without the replacement, bit
        for bit, when ``new`` holds ``old``'s values), else converted as for a conversion of the tensor
        (:meth:`ManagedTensors.rebuild`). torch.optim.AdamW keeps training the old objects instead (PyTorch's advice:
        build the optimizer after such a load); the dense parameters of SonarAdamW follow torch's rule.

        Returns:
            False, with nothing changed, when ``old`` is no longer a tensor of this optimizer, ``new``
            already is one, or their shapes differ (the state cannot follow); True when adopted.
        Raises:
            RuntimeError: the replacement came between a backward and ``step()`` (``old`` was updated or
                holds micro-batches of this step), or ``new`` has a gradient; raised before any change.
            TypeError, ValueError: ``new`` is not a tensor the update takes (:meth:`ManagedTensors.check`).
        """
        return self.managed.adopt_replacement(old, new)

    # -- Telemetry -----------------------------------------------------------------------------------------

    @property
    def expert_tensors(self) -> list[torch.Tensor]:
        """The tensors this optimizer updates in the backward (it owns them), in param_groups order."""
        return [p for group in self.param_groups for p in group["params"] if p in self.managed.tensors]

    # -- The step, and torch.optim.Optimizer's methods -----------------------------------------------------

    @torch.compiler.disable
    def _run_closure_and_end_step(self, closure):
        """Check the step (:meth:`InBackwardUpdates.check_before_step`), run ``closure`` (with grad
        enabled, as torch.optim does) if given, then end the step, also when the closure raises.
        Returns the closure's loss or None. The step's end: :meth:`InBackwardUpdates.end_step`.

        Eager also under ``torch.compile(optimizer.step)`` (torch's compiled-optimizer recipe): per-tensor
        bookkeeping and hooks, no tensor math to compile (a closure runs eagerly there)."""
        self._record.check_before_step(self.managed.tensors)
        try:
            if closure is None:
                return None
            with torch.enable_grad():
                return closure()
        finally:
            try:
                self._record.end_step(list(self.managed.tensors))
            finally:
                self.managed.register_hooks()  # tensors unfrozen since get their hook

    def __deepcopy__(self, memo):
        raise TypeError(
            f"{type(self).__name__} cannot be copied: it owns the in-backward updates of its expert tensors "
            "(one owner per tensor); copy optimizer.state_dict() and load it into a new optimizer"
        )

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"{type(self).__name__} cannot be pickled: save optimizer.state_dict() (torch.save) and load it into "
            "a new optimizer"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim.Optimizer.zero_grad, and it starts a new gradient-accumulation window: the
        micro-batches counted towards ``accumulation_steps`` are forgotten with their gradient (the
        buffers of ``grad_dtype`` are released, or zeroed with ``set_to_none=False``, like ``.grad``)."""
        super().zero_grad(set_to_none)
        self._record.micro_batches.reset(set_to_none)

    def state_dict(self) -> dict:
        """As torch.optim.Optimizer.state_dict, with the ``step`` of the tensors updated in the backward
        as a CPU tensor (a copy; the live one stays on the device), as torch.optim.AdamW keeps it outside
        its fused and capturable modes: loaded into a non-fused torch.optim.AdamW it then does not read a
        device scalar on the host at every step. Reading it syncs with the device (checkpoint time)."""
        return with_cpu_steps(super().state_dict(), self.param_groups, self.managed.tensors.__contains__)

    def load_fp32_masters(self, masters) -> None:
        """Give bf16 expert tensors of ``master_weights`` their fp32 masters, e.g. the weights of an fp32
        checkpoint that torch.optim.AdamW trained (load its state_dict with :meth:`load_state_dict` too):
        with "remainder" each weight and its ``state[p]["remainder"]`` become the master's split (the weight
        the master rounded to nearest, a tie away from zero; together exactly the master,
        docs/design.md, "bf16 master weights"); with "stochastic", which keeps no master, the weight becomes
        the master rounded to nearest (torch's cast). Nothing else changes (moments, step, seeds).

        Args:
            masters: a mapping (or pairs) from expert tensors of this optimizer to float32 tensors of their
                shapes; the tensors not named keep their state.
        Raises:
            ValueError: master_weights is None; a tensor this optimizer does not update in the backward; a
                master of another shape, or with a non-finite entry. Checked for every tensor before any is
                written.
            TypeError: a master that is not a float32 tensor.
            RuntimeError: called after a backward that updated expert tensors and before ``step()``.
        """
        name = type(self).__name__
        if any(p in self.managed.tensors for p in self._record.updated):
            raise RuntimeError(
                f"{name}.load_fp32_masters after a backward that updated expert tensors and before step()"
            )
        load_fp32_masters(name, self.state, self.managed.tensors.__contains__, self.master_weights, masters)

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch.optim.Optimizer.load_state_dict (a torch.optim.AdamW state_dict loads too), except for
        the tensors updated in the backward: their exp_avg and exp_avg_sq keep the dtype they were saved
        with (torch casts them to the parameter's dtype), or become ``moments_dtype`` when it was given;
        their ``step`` becomes a float32 tensor on the parameter's device (the kernels read it there).

        Raises:
            ValueError: a group holding expert tensors with amsgrad, maximize, capturable, differentiable,
                or non-decoupled weight decay (Adam), which the in-backward update does not implement, or
                hyperparameters outside their ranges (groups of dense parameters only load whatever
                torch.optim.AdamW loads); another number of groups; a parameter state without moments, or
                moments whose shape is not the parameter's.
            RuntimeError: called after a backward that updated expert tensors and before ``step()``, unless
                each of them was restored since (replaced or written: a rollback, which then ends the step).
        """
        rolled_back = self._record.rolled_back(self.managed.tensors)
        if not rolled_back and any(p in self.managed.tensors for p in self._record.updated):
            raise RuntimeError(
                f"{type(self).__name__}: load_state_dict() after a backward that updated expert tensors and before "
                "step(): the weights already hold this step's update, and the loaded moments and step would not "
                "match them; call step() (or load before the forward, or restore the weights first: a rollback)"
            )
        managed = self.managed.tensors.__contains__
        pairs = check_loadable(type(self).__name__, state_dict, self.param_groups, managed)
        super().load_state_dict(state_dict)
        # torch's load_state_dict builds new group dicts: new hyperparameter tensors below (managed.attach).
        self._record.groups.forget()
        for param_id, p in pairs:
            if managed(p):
                saved = state_dict["state"].get(param_id, {})
                seed = self.managed.seeds.get(p, 0)
                load_expert_state(p, self.state[p], saved, self.moments_dtype, self.master_weights, seed)
                self.managed.attach(p)  # the update reads the new state tensors
        if rolled_back:
            self._record.end_rolled_back_step()
