"""sonar-train's arms that update parameters inside the backward with torch's own AdamW (torch's
optimizer-in-backward recipe: a post-accumulate-grad hook steps the tensor's optimizer, then releases its
gradient), beside SonarAdamW's in-backward update they are compared with.

- :class:`AllInBackward` (``--arms all-in-backward``): every parameter updated in the backward, nothing
  clipped (the paper's other comparison);
- :class:`TorchExpertsInBackward` (``--arms paper-inbwd`` and ``per-expert-inbwd``): the Sonar-MoE paper's
  method with torch's AdamW: each batched expert tensor (or, the paper's ablation, each expert slice)
  stepped from its hook, the dense parameters clipped by their own norm and stepped after the backward.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.optim.adamw import adamw as torch_adamw

# The expert tensors of transformers' MoE blocks (v5 layout: [E, 2I, H] and [E, H, I]).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


class AllInBackward:
    """Every parameter updated in the backward, no clipping anywhere (the paper's other comparison): the
    expert tensors by :class:`sonar_kernels.ExpertAdamW` (the fused wgrad epilogue on the triton backend;
    torch's AdamW with ``flags`` on the torch backend), each other trainable parameter by its own
    torch.optim.AdamW with ``flags`` from a post-accumulate-grad hook, its gradient released right after
    (torch's optimizer-in-backward recipe). ``step()`` ends the step."""

    def __init__(self, model, hyper: dict, flags: dict):
        import sonar_kernels

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        experts = [p for n, p in named if n.endswith(EXPERT_PARAMS)]
        self.experts = sonar_kernels.ExpertAdamW([{"params": experts, **flags}], **hyper)
        self.dense = {
            p: torch.optim.AdamW([p], **hyper, **flags) for n, p in named if not n.endswith(EXPERT_PARAMS)
        }
        # The hooks hold the optimizers weakly: a hook that refers back to its parameter (through
        # self.dense) would keep the model and the optimizer state alive for good.
        ref = weakref.ref(self)
        for p in self.dense:
            p.register_post_accumulate_grad_hook(functools.partial(_all_in_backward_update, ref))

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.experts, *self.dense.values()]

    def step(self) -> None:
        self.experts.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.experts.zero_grad(set_to_none)


def _all_in_backward_update(ref, p: torch.Tensor) -> None:
    owner = ref()
    if owner is not None:
        owner.dense[p].step()
        p.grad = None


class TorchExpertsInBackward:
    """The Sonar-MoE paper's method with torch's AdamW (the whole-model counterpart of bench/providers.py's
    ``paper-inbwd`` and ``per-expert-inbwd``): each expert tensor's gradient is written by the backward as
    a tensor (the experts have no SonarAdamW owner), stepped by its own optimizer with ``flags`` from its
    post-accumulate-grad hook and released; the dense parameters keep their gradients for the caller's
    clipping (sonar-train clips them by their own norm, as SonarAdamW does) and are stepped by ``step()``.

    ``per_expert=False`` (``paper-inbwd``): one torch.optim.AdamW call per batched tensor W[E, ...].
    ``per_expert=True`` (``per-expert-inbwd``, the paper's ablation): :class:`PerExpertAdamW`, one AdamW
    call per expert slice W[e]. Either way the update is elementwise with standard training's arguments:
    with the experts unclipped, the weights and moments equal ``standard-dense-clip``'s bit for bit."""

    def __init__(self, model, hyper: dict, flags: dict, per_expert: bool):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        dense = [p for n, p in named if not n.endswith(EXPERT_PARAMS)]
        self.dense = torch.optim.AdamW(dense, **hyper, **flags)
        cls = PerExpertAdamW if per_expert else torch.optim.AdamW
        self.experts = {p: cls([p], **hyper, **flags) for n, p in named if n.endswith(EXPERT_PARAMS)}
        ref = weakref.ref(self)  # held weakly, as AllInBackward's hooks
        for p in self.experts:
            p.register_post_accumulate_grad_hook(functools.partial(_torch_experts_update, ref))

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.dense, *self.experts.values()]

    def step(self) -> None:
        self.dense.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none)


class PerExpertAdamW(torch.optim.AdamW):
    """torch.optim.AdamW applied one expert slice at a time: for each parameter W[E, ...] with a gradient,
    E calls of torch's functional AdamW (``torch.optim.adamw.adamw``, the flags given: fused, else
    single-tensor), each on W[e], its gradient and moments' slices and its own step count (``state["steps"]``,
    E scalars, on W's device for the fused kernel, else on the CPU as torch keeps them). The paper's
    ablation of the batched update; the arithmetic of each element is torch's. amsgrad, maximize and
    capturable are not supported (ValueError)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            for option in ("amsgrad", "maximize", "capturable"):
                if group[option]:
                    raise ValueError(f"PerExpertAdamW does not support {option}=True")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            fused = bool(group["fused"])
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    device = p.device if fused else torch.device("cpu")
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["steps"] = [
                        torch.zeros((), dtype=torch.float32, device=device) for _ in range(p.shape[0])
                    ]
                for e in range(p.shape[0]):
                    torch_adamw(
                        [p[e]], [p.grad[e]], [state["exp_avg"][e]], [state["exp_avg_sq"][e]], [],
                        [state["steps"][e]], foreach=False, fused=fused, amsgrad=False, beta1=beta1,
                        beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                        maximize=False,
                    )  # fmt: skip
        return loss


def _torch_experts_update(ref, p: torch.Tensor) -> None:
    owner = ref()
    if owner is not None:
        owner.experts[p].step()
        p.grad = None
