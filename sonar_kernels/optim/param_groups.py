"""The parameter groups as the in-backward update reads them: the torch.optim.AdamW options it implements,
the flags of torch's AdamW where torch's AdamW applies an update, and the hyperparameters tensor the kernels
read (docs/design.md, "When the updates run").

Used by :class:`sonar_kernels.optim.in_backward.InBackwardAdamW` (through :class:`GroupHyperparameters`)
and by the optimizers built on it.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch.distributed.tensor import DTensor

from sonar_kernels import ops, specs
from sonar_kernels.ops.arithmetic import has_torch_fused_adamw
from sonar_kernels.ops.validation import as_float
from sonar_kernels.specs import Hyperparameters

__all__ = [
    "EXPERT_CLIPPING",
    "OPTIMIZER_OPTIONS",
    "UNSUPPORTED_OPTIONS",
    "GroupHyperparameters",
    "check_expert_clipping",
    "check_group_options",
    "check_optimizer_options",
    "torch_adamw_flags",
]

# torch.optim.AdamW options the in-backward update does not implement, with the only value it accepts for
# a parameter group that holds expert tensors (foreach and fused pick torch's AdamW path and are honoured;
# lr may be a one-element CPU tensor).
UNSUPPORTED_OPTIONS = {
    "maximize": False,
    "amsgrad": False,
    "capturable": False,
    "differentiable": False,
    "decoupled_weight_decay": True,
}


# The optimizers' own options, which hold for all their groups: a group that sets one is refused rather
# than ignored (torch honours a group's own lr or betas, so a group's own expert_clipping would look honoured).
OPTIMIZER_OPTIONS = (
    "max_grad_norm",
    "clip_norm_includes_experts",
    "expert_clipping",
    "spike_threshold",
    "moments_dtype",
    "grad_dtype",
    "fused_epilogue",
    "accumulation_steps",
    "data_parallel_group",
    "master_weights",
    "rounding_seed",
)


def check_optimizer_options(owner: str, group: dict) -> None:
    """Raise ValueError, naming the key, when a parameter group sets one of :data:`OPTIMIZER_OPTIONS`:
    those are the optimizer's arguments, the same for every group, and are not implemented per group."""
    keys = [key for key in OPTIMIZER_OPTIONS if key in group]
    if keys:
        raise ValueError(
            f"{owner}: a parameter group sets {keys[0]}={group[keys[0]]!r}: {', '.join(keys)} "
            f"{'is an option' if len(keys) == 1 else 'are options'} of the whole optimizer, not of a parameter "
            "group (a group's own value would be ignored); give it to the optimizer's constructor, or use one "
            "optimizer per value"
        )


def check_group_options(owner: str, group: dict, has_experts: bool) -> None:
    """Raise ValueError, naming the option, when ``group`` holds expert tensors (``has_experts``) and sets
    an option of :data:`UNSUPPORTED_OPTIONS` to another value than the one the update implements; a group
    without expert tensors takes every torch.optim.AdamW option. The one check of every path that gives a
    group expert tensors or an option: the constructor and ``add_param_group`` (``group`` with the
    constructor's defaults filled in), an option set later, ``load_state_dict`` (the saved group), an
    expert tensor adopted at its module's first forward. Any group: :func:`check_optimizer_options`."""
    check_optimizer_options(owner, group)
    if not has_experts:
        return
    for key, accepted in UNSUPPORTED_OPTIONS.items():
        if key in group and group[key] is not None and bool(group[key]) != accepted:
            raise ValueError(
                f"{owner}: a parameter group with {key}={group[key]!r} (its own or the constructor's) holds "
                f"expert tensors, which are updated in the backward by AdamW without {key} (only "
                f"{key}={accepted} is implemented); put the expert tensors in a group that sets "
                f'"{key}": {accepted}'
            )


def torch_adamw_flags(group: dict, tensors: list[torch.Tensor]) -> tuple[bool | None, bool | None]:
    """(foreach, fused): the flags for torch's AdamW on ``tensors`` of the parameter group ``group``, the
    one rule of SonarAdamW and ExpertAdamW wherever torch's AdamW applies an update.

    The group's ``foreach`` and ``fused`` when one of them is set (torch's meaning: fused=False or
    foreach=False the for-loop, foreach=True the foreach kernels), or when the group asks for capturable
    or differentiable (torch's own choice then, as torch.optim.AdamW makes it). Otherwise torch's fused
    AdamW, ``(None, True)``, where torch has it for every tensor's device and dtype
    (:func:`has_torch_fused_adamw`) and the tensors are all DTensors or none (torch's fused AdamW refuses
    a call that mixes them): one pass over each tensor, no temporaries, a ``found_inf`` input (no
    host sync to skip a non-finite gradient); on the CPU several times faster than the for-loop AdamW
    torch picks there by default (3 to 4 times per thread for tensors of 1M to 4M fp32 elements, torch
    2.13). ``(None, None)`` (torch's default) where it has none.
    """
    foreach, fused = group.get("foreach"), group.get("fused")
    if foreach is not None or fused is not None or group.get("capturable") or group.get("differentiable"):
        return foreach, fused
    one_kind = len({isinstance(t, DTensor) for t in tensors}) == 1
    if one_kind and all(has_torch_fused_adamw(t.device, t.dtype) for t in tensors):
        return None, True
    return None, None


def hyperparameters(group: dict) -> Hyperparameters:
    """(lr, beta1, beta2, eps, weight_decay) of ``group`` as Python floats, as torch.optim.AdamW reads them."""
    beta1, beta2 = group["betas"]
    return Hyperparameters(
        as_float(group["lr"], "lr"),
        as_float(beta1, "beta1"),
        as_float(beta2, "beta2"),
        as_float(group["eps"], "eps"),
        as_float(group["weight_decay"], "weight_decay"),
    )


def torch_hyperparameters(group: dict) -> Hyperparameters:
    """(lr, beta1, beta2, eps, weight_decay) of ``group`` as torch.optim.AdamW.step passes them to torch's
    AdamW: as the group holds them (Python floats or one-element tensors), so that torch's AdamW applied
    to a managed tensor (the torch backend, a gradient that reached ``.grad``) uses its arithmetic for
    tensor values, as standard training does."""
    beta1, beta2 = group["betas"]
    return Hyperparameters(group["lr"], beta1, beta2, group["eps"], group["weight_decay"])


EXPERT_CLIPPING = ("none", "spike", "lagged")


def check_expert_clipping(expert_clipping, spike_threshold) -> tuple[str, float]:
    """(expert_clipping, spike_threshold as a float) after checking them.

    Raises:
        ValueError: expert_clipping not one of :data:`EXPERT_CLIPPING`, or spike_threshold not a finite
            number > 0.
    """
    if expert_clipping not in EXPERT_CLIPPING:
        raise ValueError(f"expert_clipping must be one of {EXPERT_CLIPPING}, got {expert_clipping!r}")
    if (
        not specs.is_real_number(spike_threshold)
        or not math.isfinite(spike_threshold)
        or spike_threshold <= 0
    ):
        raise ValueError(f"spike_threshold must be a finite number > 0, got {spike_threshold!r}")
    return expert_clipping, float(spike_threshold)


class GroupHyperparameters:
    """An optimizer's parameter groups as its in-backward updates read them: the group of each tensor,
    and per (group, device) the [5] float64 tensor of the group's hyperparameters (``specs.HYPERPARAMETERS``
    order) that the kernels read, written again only when the group's values change.

    Holds the optimizer weakly and reads its ``param_groups`` at each call (``load_state_dict`` replaces
    the list and its dicts)."""

    def __init__(self, optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)
        # (group index, device) -> (the values written, the tensor).
        self._tensors: dict[tuple[int, torch.device], tuple[tuple[float, ...], torch.Tensor]] = {}
        # tensor -> (index, group dict) in param_groups.
        self._index: dict = {}

    @property
    def param_groups(self) -> list[dict]:
        return self._optimizer().param_groups

    def index(self, p: torch.Tensor) -> int:
        """The index of ``p``'s group in ``param_groups``; remembered per tensor with its group dict (each
        update asks it), looked up again when that dict is no longer at the index (``load_state_dict``).

        Raises:
            RuntimeError: ``p`` is in no group.
        """
        groups = self.param_groups
        cached = self._index.get(p)
        if cached is not None and cached[0] < len(groups) and groups[cached[0]] is cached[1]:
            return cached[0]
        for index, group in enumerate(groups):
            if any(q is p for q in group["params"]):
                self._index[p] = (index, group)
                return index
        raise RuntimeError(f"{type(self._optimizer()).__name__}: tensor not found in param_groups")

    def group(self, p: torch.Tensor) -> dict:
        """The parameter group that holds ``p``."""
        return self.param_groups[self.index(p)]

    def _clipping(self) -> tuple[float, torch.Tensor | None] | None:
        """(spike_threshold, the lagged coefficient tensor or None for 1) of an optimizer with expert
        clipping, else None: its hyperparameter tensors are then [7] (``specs.CLIPPING``), spike_threshold
        inf under "lagged" and the coefficient 1 under "spike" and before the first ``step()`` (each rule an
        exact no-op when off)."""
        optimizer = self._optimizer()
        mode = getattr(optimizer, "expert_clipping", "none")
        if mode == "none":
            return None
        threshold = optimizer.spike_threshold if mode == "spike" else float("inf")
        coef = optimizer.expert_clip_coef if mode == "lagged" and optimizer.lagged_coef_set else None
        return threshold, coef

    def set_clip_coef(self, coef: torch.Tensor) -> None:
        """Write the lagged clipping coefficient (0-dim) into every hyperparameter tensor, on the device (no
        host read), keeping their version counters (see :meth:`tensor`)."""
        with torch.no_grad():
            for _, tensor in self._tensors.values():
                if tensor.numel() == 7:
                    with torch.autograd._unsafe_preserve_version_counter(tensor):
                        tensor[6].copy_(coef)

    def tensor(self, p: torch.Tensor) -> torch.Tensor:
        """The [5] float64 tensor on ``p``'s device holding its group's hyperparameters, which the kernels
        read ([7] with expert clipping: then spike_threshold and the lagged coefficient, :meth:`_clipping`). Called when an update of ``p`` is about to run (also inside a compiled backward); written
        again only when the group's values changed since (``group[key] = ...``, ``group.update``, a tensor
        lr filled in place by an LR scheduler).

        The tensor is saved by each forward that uses the group's expert tensors, and the backward of
        the first layer rewrites it before the later layers' backward unpacks it: the write keeps its
        version counter, so that autograd does not take it for a modified saved tensor (it is read, never
        differentiated).

        Raises:
            ValueError: a hyperparameter out of its range (:func:`sonar_kernels.ops.check_hyperparameters`).
        """
        index = self.index(p)
        values = hyperparameters(self.param_groups[index])
        key = (index, p.device)
        cached = self._tensors.get(key)
        clipping = self._clipping()
        size = 5 if clipping is None else 7
        if cached is None or cached[0] != values or cached[1].numel() != size:
            # Values equal to the cached ones were checked when they were cached (a NaN never equals).
            ops.check_hyperparameters(values[0], values[1:3], values[3], values[4])
            tensor = (
                cached[1]
                if cached is not None and cached[1].numel() == size
                else torch.empty(size, dtype=torch.float64, device=p.device)
            )
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tensor):
                # One copy from the host; a lagged coefficient follows from where step() computed it (the
                # dense gradients' device: no host read).
                row = values if clipping is None else (*values, clipping[0], 1.0)
                tensor.copy_(torch.tensor(row, dtype=torch.float64))
                if clipping is not None and clipping[1] is not None:
                    tensor[6].copy_(clipping[1])
            self._tensors[key] = (values, tensor)
            return tensor
        return cached[1]

    def forget_tensor(self, p: torch.Tensor) -> None:
        """Drop what is remembered of ``p`` (it left the optimizer's groups)."""
        self._index.pop(p, None)

    def forget(self) -> None:
        """Drop the tensors: ``load_state_dict`` built new group dicts (the updates get new tensors)."""
        self._tensors = {}

    def check_unchanged(self, owner: str, managed, updated) -> None:
        """Raise before ``step()`` does anything (RuntimeError; the step is not ended, so it raises again
        until the value is set back) when a hyperparameter of a group whose expert tensors were updated in
        this step's backward (``managed``, ``updated``: containers of tensors) changed since that update,
        however it was set (``group[key] = ...``, ``group.update``, a tensor lr filled in place): the update
        used the old value, and the dense step would use the new one. ValueError when a group holding
        expert tensors sets an option the update does not implement, or any group an option of the whole
        optimizer (:func:`check_optimizer_options`)."""
        for index, group in enumerate(self.param_groups):
            check_optimizer_options(owner, group)
            held = [p for p in group["params"] if p in managed]
            if not held:
                continue
            check_group_options(owner, group, True)
            keys = {(index, p.device) for p in held if p in updated} & self._tensors.keys()
            if not keys:
                continue
            values = hyperparameters(group)
            for before in {self._tensors[key][0] for key in keys}:
                changed = [
                    (key, old, new)
                    for key, old, new in zip(specs.HYPERPARAMETERS, before, values, strict=True)
                    if old != new
                ]
                if changed:
                    details = ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changed)
                    raise RuntimeError(
                        f"{owner}: {changed[0][0]} of parameter group {index} changed after its expert tensors were "
                        f"updated in this step's backward and before step() ({details}): their update already "
                        "used the old value, where torch.optim.AdamW takes the new one in this step (as this step() "
                        "would for the dense parameters); nothing was changed. Set the value back and call step(); "
                        "set hyperparameters after optimizer.step() (an LR scheduler's step() after the optimizer's, "
                        "as torch documents) or before the backward"
                    )
