"""The telemetry of the in-backward updates: the expert gradients' norm and the skipped updates
(docs/usage.md), read from what the updates recorded (optim/updates.py)."""

from __future__ import annotations

import torch

from sonar_kernels.optim import distributed

__all__ = ["ExpertTelemetry"]


class ExpertTelemetry:
    """Mixin of :class:`sonar_kernels.optim.in_backward.InBackwardAdamW`. The host-class protocol: ``_record``
    (its :class:`~sonar_kernels.optim.updates.InBackwardUpdates`: ``grad_norm_sq`` and ``skipped`` per
    tensor), ``managed.tensors`` (the tensors it updates in the backward) and ``expert_tensors`` (those in
    param_groups order)."""

    def expert_grad_norm(self, params=None) -> torch.Tensor:
        """L2 norm of the expert gradients of the current step (read it after the backward, or after
        ``step()``, until the next step's backward writes new values): a 0-dim float32 tensor on the
        tensors' device, summed in param_groups order from per-tensor squared norms that the wgrad
        kernels sum deterministically. A tensor that got no gradient in that step counts as 0; one whose
        update was skipped (see :meth:`expert_skipped_updates`) as inf. Reading it (``float()``) syncs
        with the device.

        With several ranks it is the norm of the whole model's expert gradients, the same on every rank:
        expert-parallel tensors (each rank holds other experts) add their squared norms over their
        expert-parallel group (a collective: call it on every rank); data-parallel ones are averaged
        before their update and sharded ones (FSDP2) are reduced over their mesh already.

        Args:
            params: the expert tensors to include (e.g. one layer's ``SonarExperts.parameters()``); None:
                all of this optimizer's expert tensors.
        Raises:
            ValueError: a tensor this optimizer does not update in the backward.
        """
        return distributed.sum_over_expert_parallel_groups(
            self._record.grad_norm_sq, self._ordered(params), torch.float32
        ).sqrt()

    def expert_skipped_updates(self, params=None) -> torch.Tensor:
        """How many in-backward updates were skipped because the gradient had an entry that was NaN,
        infinite, or beyond ``sonar_kernels.ops.grad_limit`` (the update is then not applied at all:
        weights, moments and step stay as they were; see ``ops.AdamWUpdate``). Counted on the device
        since this optimizer was built (not saved in ``state_dict()``): a 0-dim int64 tensor, summed over
        ``params`` (None: all expert tensors of this optimizer). Reading it syncs with the device.

        Raises:
            ValueError: a tensor this optimizer does not update in the backward.
        """
        return self._sum_counts(self._record.skipped, params)

    def expert_clipped_elements(self, params=None) -> torch.Tensor:
        """How many gradient entries the spike rule (``expert_clipping="spike"``, docs/design.md, "Expert
        clipping") replaced in the last step's in-backward updates of ``params`` (None: all expert tensors
        of this optimizer): a 0-dim int64 tensor, summed over the tensors (0 for a tensor with no update in
        that step, a skipped update, or another expert_clipping). Read it after the backward or after
        ``step()``, as :meth:`expert_grad_norm`; reading it syncs with the device. FSDP2's sharded tensors
        updated from ``.grad`` count this rank's shard.

        Raises:
            ValueError: a tensor this optimizer does not update in the backward.
        """
        return self._sum_counts(self._record.clipped, params)

    def _sum_counts(self, counts: dict, params) -> torch.Tensor:
        """The 0-dim int64 sum of ``counts`` (tensor -> 0-dim int64) over ``params`` in param_groups order,
        on the first tensor's device (a CPU 0 when there is none)."""
        ordered = self._ordered(params)
        if not ordered:
            return torch.zeros((), dtype=torch.int64)
        total = counts[ordered[0]].clone()
        for p in ordered[1:]:
            total += counts[p].to(total.device)
        return total

    def _ordered(self, params) -> list[torch.Tensor]:
        """``params`` (None: all managed tensors) in param_groups order.

        Raises:
            ValueError: a tensor this optimizer does not update in the backward.
        """
        chosen = None if params is None else list(params)
        if chosen is not None:
            for p in chosen:
                if p not in self.managed.tensors:
                    raise ValueError(
                        f"a tensor of shape {tuple(p.shape)} is not an expert tensor of this optimizer"
                    )
        ordered = self.expert_tensors
        if chosen is not None:
            ordered = [p for p in ordered if any(p is q for q in chosen)]
        return ordered
