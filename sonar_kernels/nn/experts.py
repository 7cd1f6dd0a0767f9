"""SonarExperts: the experts of one MoE layer as an nn.Module, in the transformers v5 weight layout."""

from __future__ import annotations

import math

import torch
from torch import nn

from sonar_kernels.autograd.moe_mlp import moe_mlp
from sonar_kernels.nn.expert_parallel import expert_parallel_moe_mlp, resolve_ep_group
from sonar_kernels.nn.fsdp_guard import check_not_fsdp_managed
from sonar_kernels.ops.validation import check_moe_mlp_args
from sonar_kernels.optim.ownership import claim_expert_tensors
from sonar_kernels.specs import (
    BACKENDS,
    MAX_EXPERTS,
    SUPPORTED_DTYPES,
    expert_parallel_group,
    is_integer,
    mark_expert_parallel,
    mark_expert_tensors,
    parse_activation,
)


class SonarExperts(nn.Module):
    """E gated expert MLPs stored as two batched tensors, run by :func:`sonar_kernels.moe_mlp`.

    Parameters (the layout of transformers' ``OlmoeExperts`` / ``GraniteMoeExperts``, so a state_dict
    moves between them unchanged):

    - ``gate_up_proj``: [num_experts, 2 * intermediate_size, hidden_size], gate rows first;
    - ``down_proj``: [num_experts, hidden_size, intermediate_size].

    Args:
        num_experts: E >= 1.
        hidden_size: H >= 1.
        intermediate_size: I >= 1, per expert.
        activation: "silu" (SwiGLU), "gelu" (GeGLU, exact erf GELU), "gelu_tanh" (GeGLU, tanh-approximated
            GELU) or a clamped SwiGLU (:func:`sonar_kernels.clamped_swiglu`).
        backend: "auto", "triton" or "torch" (see :func:`sonar_kernels.moe_mlp`).
        device, dtype: of the parameters (dtype float32, bfloat16 or float16).
        ep_group: expert parallelism over this torch.distributed ProcessGroup (or 1-D DeviceMesh) of P
            ranks: rank r holds experts [r * E / P, (r + 1) * E / P), so ``gate_up_proj`` is
            [E / P, 2I, H] and ``down_proj`` [E / P, H, I] (a state_dict holds the local experts). The
            forward takes this rank's tokens [T_r, H] with global expert ids, sends each routed token to
            the rank of its expert with ``all_to_all_single`` (the counts exchanged first: one host read
            per layer), runs the local experts, brings the outputs back and combines them here. The
            local experts' gradient is then complete, so SonarAdamW updates them in the backward with no
            gradient collective (they are declared with ``specs.mark_expert_parallel``). Gradient
            convention: each rank's loss is a mean over its tokens, the objective the mean over ranks
            (DDP's); see ``sonar_kernels/nn/expert_parallel.py``. None: all E experts on this rank.
    Raises:
        ValueError: a size below 1, an unknown activation or backend, num_experts not divisible by the
            size of ep_group, or ep_group without an initialized torch.distributed; at the forward, an
            expert-parallel module whose tensors FSDP2 manages (docs/distributed.md, "Expert parallel
            with the dense layers on FSDP2").
        TypeError: an unsupported dtype, or an ep_group that is not a ProcessGroup or DeviceMesh.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: str = "silu",
        backend: str = "auto",
        device=None,
        dtype=None,
        ep_group=None,
    ):
        super().__init__()
        for name, value in (
            ("num_experts", num_experts),
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
        ):
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        num_experts, hidden_size, intermediate_size = (
            int(num_experts),
            int(hidden_size),
            int(intermediate_size),
        )
        if num_experts > MAX_EXPERTS:
            raise ValueError(f"num_experts must be at most {MAX_EXPERTS}, got {num_experts}")
        parse_activation(activation)  # ValueError naming what is expected
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if dtype is not None and dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        self.ep_group = None if ep_group is None else resolve_ep_group(ep_group)
        ranks = 1 if self.ep_group is None else torch.distributed.get_world_size(self.ep_group)
        if num_experts % ranks:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by the size of ep_group ({ranks})"
            )
        self.num_local_experts = num_experts // ranks
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.backend = backend
        factory = {"device": device, "dtype": dtype}
        local = self.num_local_experts
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size, **factory))
        self.down_proj = nn.Parameter(torch.empty(local, hidden_size, intermediate_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Per expert, the default init of nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        with torch.no_grad():
            self.gate_up_proj.uniform_(-1 / math.sqrt(self.hidden_size), 1 / math.sqrt(self.hidden_size))
            bound = 1 / math.sqrt(self.intermediate_size)
            self.down_proj.uniform_(-bound, bound)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Args and errors as :func:`sonar_kernels.moe_mlp`: [T, H], [T, top_k], [T, top_k] -> [T, H]
        (with ``ep_group``: this rank's tokens, global expert ids)."""
        if self.ep_group is not None and not all(
            expert_parallel_group(t) is self.ep_group for t in (self.gate_up_proj, self.down_proj)
        ):
            # The tensors were replaced without register_parameter: FSDP2 (refused: its reduce-scatter
            # would mix different experts' gradients), or a conversion that dropped the mark.
            check_not_fsdp_managed(self, self.ep_group)
            mark_expert_parallel(self.ep_group, self.gate_up_proj, self.down_proj)
        claim_expert_tensors(self.gate_up_proj, self.down_proj, module=self)
        if self.ep_group is not None:
            # The rank's own arguments checked before the token counts are exchanged: an error raised inside
            # the exchange would leave the other ranks waiting in it. moe_mlp checks the received rows again
            # (its own arguments, a different batch: the rows of the local experts from every rank).
            backend = check_moe_mlp_args(
                hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                self.activation, self.backend,
            )  # fmt: skip
            return expert_parallel_moe_mlp(
                hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                group=self.ep_group, num_experts=self.num_experts, activation=self.activation, backend=backend,
            )  # fmt: skip
        return moe_mlp(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.gate_up_proj,
            self.down_proj,
            activation=self.activation,
            backend=self.backend,
        )

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """As nn.Module.register_parameter; ``gate_up_proj`` and ``down_proj`` are marked as expert
        tensors (which SonarAdamW updates in the backward) whenever they are set: at construction, by
        assignment and by ``load_state_dict(assign=True)``."""
        super().register_parameter(name, param)
        if name in ("gate_up_proj", "down_proj") and param is not None:
            mark_expert_tensors(param)
            if getattr(self, "ep_group", None) is not None:
                mark_expert_parallel(self.ep_group, param)

    def __setstate__(self, state) -> None:
        # copy.deepcopy and unpickling rebuild the module without __init__ (and a deep-copied Parameter
        # keeps no attributes): mark the new tensors.
        super().__setstate__(state)
        mark_expert_tensors(self.gate_up_proj, self.down_proj)
        if getattr(self, "ep_group", None) is not None:
            mark_expert_parallel(self.ep_group, self.gate_up_proj, self.down_proj)

    def expert_tensors(self) -> tuple[nn.Parameter, nn.Parameter]:
        """(gate_up_proj, down_proj): the tensors :class:`sonar_kernels.SonarAdamW` updates in the backward."""
        return self.gate_up_proj, self.down_proj

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, activation={self.activation!r}, backend={self.backend!r}"
            + (
                ""
                if getattr(self, "ep_group", None) is None
                else f", local_experts={self.num_local_experts} (expert parallel)"
            )
        )
