"""One expert tensor's in-backward update state: its kind (the moments exact or 8-bit; the master weights
none, a remainder or a stochastic rounding: docs/design.md, "8-bit moments" and "bf16 master weights"),
its tensors by name, and the one order in which the ``sonar_kernels::`` ops take them as a
``list[Tensor]`` (custom ops take no structures: torch.compile and ``torch.library.opcheck``). The only
module that knows that order, the optimizer's state keys of each kind, or how to tell a kind from the
tensors; everything else builds and reads an :class:`UpdateState` in one call.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

__all__ = [
    "MASTERS",
    "MOMENTS",
    "STATE_FIELDS",
    "StateKind",
    "UpdateState",
    "kind_of",
]

MOMENTS = ("exact", "8bit")
MASTERS = ("none", "remainder", "stochastic")

# The tensors of every update, first, in the order the ops take them. ``clipped``: a 0-dim int64 that
# receives the number of gradient entries the spike rule replaced in the update (expert clipping,
# docs/design.md; 0 without it).
STATE_FIELDS = ("exp_avg", "exp_avg_sq", "step", "grad_norm_sq", "skipped", "clipped")
# With 8-bit moments exp_avg and exp_avg_sq are their int8 and uint8 codes, and their fp32 block scales
# follow; then the master's tensor, if any: the int16 remainder, or the 0-dim int64 seed of the tensor's
# stochastic rounding.
_SCALE_FIELDS = ("exp_avg_scales", "exp_avg_sq_scales")
_MASTER_FIELDS = {"none": (), "remainder": ("remainder",), "stochastic": ("seed",)}
# The moments' fields by the length of their list (a master's tensor makes it one longer).
_MOMENT_FIELDS = {
    len(STATE_FIELDS): ("exact", STATE_FIELDS),
    len(STATE_FIELDS) + 2: ("8bit", STATE_FIELDS + _SCALE_FIELDS),
}
_present = functools.partial(operator.is_not, None)  # C calls only: the host path counts Python calls


class StateKind(NamedTuple):
    """What an update keeps: ``moments`` in :data:`MOMENTS`, ``master`` in :data:`MASTERS`."""

    moments: str = "exact"
    master: str = "none"

    @property
    def fields(self) -> tuple[str, ...]:
        """The names of the kind's tensors, in the ops' order."""
        return STATE_FIELDS + (_SCALE_FIELDS if self.moments == "8bit" else ()) + _MASTER_FIELDS[self.master]


def kind_of(state) -> StateKind:
    """The kind of ``state``: anything that holds an update's tensors by :class:`UpdateState`'s names (an
    :class:`UpdateState`, ``ops.AdamWUpdate``, ``specs.ExpertUpdate``)."""
    master = (
        "remainder" if state.remainder is not None else "stochastic" if state.seed is not None else "none"
    )
    return StateKind("8bit" if state.exp_avg_scales is not None else "exact", master)


class UpdateState(NamedTuple):
    """The tensors one expert tensor's update reads and writes (``hyper``, only read and shared by a
    parameter group, travels apart).

    Attributes:
        exp_avg, exp_avg_sq: the moments, the tensor's shape and strides (float32/bfloat16/float16), or
            with 8-bit moments their int8 and uint8 codes.
        step: [] float32 on the tensor's device, advanced by each applied update.
        grad_norm_sq: [] float32, receives the squared L2 norm of each update's gradient (inf if skipped).
        skipped: [] int64, counts the updates skipped for a non-finite or too large gradient.
        clipped: [] int64, receives the gradient entries the spike rule replaced (expert clipping).
        exp_avg_scales, exp_avg_sq_scales: None, or the 8-bit moments' fp32 block scales.
        remainder: None, or the int16 remainder that completes a bf16 weight to its fp32 master.
        seed: None, or the 0-dim int64 seed of a bf16 weight's stochastic rounding (not both).
    """

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    grad_norm_sq: torch.Tensor
    skipped: torch.Tensor
    clipped: torch.Tensor
    exp_avg_scales: torch.Tensor | None = None
    exp_avg_sq_scales: torch.Tensor | None = None
    remainder: torch.Tensor | None = None
    seed: torch.Tensor | None = None

    @property
    def kind(self) -> StateKind:
        return kind_of(self)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors in the ops' order (:attr:`StateKind.fields`: this tuple's order, the absent ones left
        out)."""
        return list(filter(_present, self))

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], name: str = "state") -> UpdateState:
        """The state of an op's ``list[Tensor]`` (:meth:`tensors`' order), its kind told by the list's length
        and, for a master's tensor, by its dtype.

        Raises:
            ValueError: a length no kind has, or a last tensor after the moments that is neither an int16
                remainder nor a 0-dim int64 seed (``name`` in the message).
        """
        count = len(tensors)
        master = count not in _MOMENT_FIELDS  # the master's tensor follows the moments' fields
        if (count - master) not in _MOMENT_FIELDS:
            raise ValueError(
                f"{name}: an update's state has {sorted(_MOMENT_FIELDS)} tensors, or one more (a remainder or a "
                f"seed); got {count}"
            )
        named = dict(zip(_MOMENT_FIELDS[count - master][1], tensors, strict=False))
        if master:
            last = tensors[-1]
            if last.dtype == torch.int16:
                named["remainder"] = last
            elif last.dtype == torch.int64 and last.dim() == 0:
                named["seed"] = last
            else:
                raise ValueError(
                    f"{name}: the state's last tensor must be an int16 remainder or a 0-dim int64 seed, got "
                    f"{last.dtype} of shape {tuple(last.shape)}"
                )
        return cls(**named)

    @classmethod
    def of_optimizer(cls, state: Mapping[str, torch.Tensor], grad_norm_sq, skipped, clipped) -> UpdateState:
        """The update state of an optimizer's ``state[p]`` (torch.optim.AdamW's ``exp_avg``, ``exp_avg_sq``
        and ``step``; with 8-bit moments ``exp_avg_codes``, ``exp_avg_sq_codes``, ``exp_avg_scales`` and
        ``exp_avg_sq_scales`` in their places; ``remainder`` or ``seed`` with bf16 master weights: the keys
        of ``optim/expert_state.py``) and the owner's telemetry tensors."""
        if "exp_avg_codes" in state:
            moments = {
                "exp_avg": state["exp_avg_codes"],
                "exp_avg_sq": state["exp_avg_sq_codes"],
                "exp_avg_scales": state["exp_avg_scales"],
                "exp_avg_sq_scales": state["exp_avg_sq_scales"],
            }
        else:
            moments = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        return cls(
            **moments, step=state["step"], grad_norm_sq=grad_norm_sq, skipped=skipped, clipped=clipped,
            remainder=state.get("remainder"), seed=state.get("seed"),
        )  # fmt: skip
