"""In-backward updates with several processes: which expert tensors get their complete gradient, the
refusal of those that would not, and the data-parallel reduction of expert gradients before their update.

The rule (docs/design.md, "Where the fused update is valid"): an expert tensor is updated only from its
complete gradient. With more than one rank an expert tensor is one of:

- ``"sharded"``: a DTensor sharded (``Shard``, or FSDP2's ``_StridedShard``) on every mesh dimension of
  more than one rank (FSDP2's ``fully_shard``; experts sharded over an expert-parallel mesh, and by FSDP2
  over "efsdp" too): the forward runs on another tensor object, which carries no update; FSDP2
  reduce-scatters the gradient into the sharded parameter's ``.grad``, and the owner's
  post-accumulate-grad hook applies the update there. A DTensor replicated over more than one rank (HSDP's
  replicate dimension, a ``Replicate()`` placement) is ``"local"``: nothing here can tell whether its
  gradient was reduced over the replicas.
- ``"expert-parallel"``: declared with :func:`sonar_kernels.specs.mark_expert_parallel`: each rank holds
  its own experts and receives every token routed to them, so its gradient is complete; the update runs
  in the backward as on one process. (With a ``data_parallel_group`` as well, the experts are also
  replicated over that group, and their gradients are averaged over it first.)
- ``"data-parallel"``: replicated over the optimizer's ``data_parallel_group``: its gradient reaches
  ``.grad``, is averaged over the group by an asynchronous all-reduce (as DDP averages: divided by the
  group's size, then summed), and updated when the reduction is done (:class:`GradientReducer`).
- ``"local"``: anything else. With more than one rank in the job it is refused before any update: each
  rank would apply AdamW to its own partial gradient and the replicas would silently diverge.

torch.distributed is the engine (process groups, DeviceMesh, DTensor, DDP's ignore list); nothing here
communicates by other means.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from sonar_kernels import specs

__all__ = [
    "DEEPSPEED",
    "FIX",
    "GradientReducer",
    "check_complete",
    "deepspeed_note",
    "exclude_from_ddp",
    "layout",
    "partial_gradient_message",
    "resolve_group",
    "world_size",
]

# How many expert tensors' gradients may be in flight (all-reduce started, update not yet applied) at
# once: one layer's two expert tensors (gate_up_proj, down_proj). With the gradients of the layer whose
# backward just produced them, at most two layers' expert gradients are alive at any time.
MAX_IN_FLIGHT = 2

FIX = (
    "pass data_parallel_group= (the process group, or a 1-D DeviceMesh, over which the experts are "
    "replicated) to the optimizer, shard the experts with FSDP2's fully_shard, or, when each rank holds "
    "its own experts and receives every token routed to them, declare them with "
    "sonar_kernels.specs.mark_expert_parallel(group, *tensors)"
)


DEEPSPEED = (
    "DeepSpeed is not supported: its engine reduces (ZeRO: partitions) every gradient after the backward, "
    "and ZeRO replaces the optimizer's parameters by flat partitions, while the expert tensors are updated "
    "inside the backward from their complete gradient. Use FSDP2 (accelerate or Trainer with "
    'fsdp_config={"fsdp_version": 2}, or fully_shard) or DDP with data_parallel_group= (docs/frameworks.md)'
)


def deepspeed_note() -> str:
    """:data:`DEEPSPEED` as a sentence to append to a refusal when DeepSpeed is imported in this process
    (a refusal there is most likely DeepSpeed's doing), else an empty string."""
    return f" {DEEPSPEED}." if "deepspeed" in sys.modules else ""


def world_size() -> int:
    """Ranks of the default process group; 1 when torch.distributed is not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def resolve_group(group, name: str = "data_parallel_group", dim: str = "dp") -> dist.ProcessGroup | None:
    """The process group of ``group``: a ProcessGroup, a 1-D DeviceMesh (e.g. one dimension of a larger
    mesh, ``mesh["dp"]``), or None. ``name`` and ``dim`` name the argument and the mesh dimension in errors.

    Raises:
        TypeError: anything else.
        ValueError: a DeviceMesh of more than one dimension, or torch.distributed not initialized.
    """
    if group is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{name} needs torch.distributed to be initialized (init_process_group)")
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f'{name}: a DeviceMesh of {group.ndim} dimensions; pass one, e.g. mesh["{dim}"]')
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(
        f"{name} must be None, a torch.distributed ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}"
    )


def layout(p: torch.Tensor, group: dist.ProcessGroup | None) -> str:
    """``"sharded"``, ``"expert-parallel"``, ``"data-parallel"`` or ``"local"`` (see the module
    docstring)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, DTensor):
        mesh = p.device_mesh
        # _StridedShard: FSDP2's shard of a dimension already sharded on another mesh dimension (transformers'
        # and torchtitan's experts on ("efsdp", "ep") with efsdp > 1); not a Shard subclass in torch 2.13.
        if all(
            isinstance(placement, (Shard, _StridedShard)) or mesh.size(dim) == 1
            for dim, placement in enumerate(p.placements)
        ):
            return "sharded"
        return "local"
    if group is not None:
        return "data-parallel"
    if specs.expert_parallel_group(p) is not None:
        return "expert-parallel"
    return "local"


def _replicated_dims(p: torch.Tensor) -> list[str]:
    """The mesh dimensions of more than one rank over which the DTensor ``p`` is not sharded, as
    "name (size)"; empty for anything else."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(p, DTensor):
        return []
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or tuple(str(dim) for dim in range(mesh.ndim))
    return [
        f"'{names[dim]}' ({mesh.size(dim)})"
        for dim, placement in enumerate(p.placements)
        if mesh.size(dim) > 1 and not isinstance(placement, (Shard, _StridedShard))
    ]


def check_complete(owner: str, params, group: dist.ProcessGroup | None, error=ValueError) -> None:
    """Raise ``error`` when the job has more than one rank and one of ``params`` is ``"local"``: its
    in-backward update would use this rank's partial gradient."""
    if world_size() <= 1:
        return
    local = [p for p in params if layout(p, group) == "local"]
    if local:
        raise error(partial_gradient_message(owner, local))


def partial_gradient_message(owner: str, local: list, note: str = "") -> str:
    """Why the ``"local"`` expert tensors ``local`` are refused, and the fix; ``note`` follows the reason
    (e.g. " (nothing was changed)"). DTensors replicated over a mesh dimension (HSDP) are named with it."""
    shapes = ", ".join(str(tuple(p.shape)) for p in local[:4]) + (", ..." if len(local) > 4 else "")
    head = f"{owner}: torch.distributed runs {world_size()} ranks, and {len(local)} expert tensor(s) (shapes {shapes})"
    replicated = sorted({dim for p in local for dim in _replicated_dims(p)})
    if replicated:
        return (
            f"{head} are DTensors replicated over the mesh dimension(s) {', '.join(replicated)} (HSDP's "
            "replicate dimension: transformers' DistributedConfig(dp_replicate_size=...), torchtitan's "
            "data_parallel_replicate_degree, fully_shard over a 2-D mesh): nothing here tells whether the gradient "
            "that reaches .grad was reduced over those replicas, and an update from a partial one would let the "
            f"replicas diverge{note}. Fix: shard the experts on every mesh dimension of more than one rank (FSDP2 "
            "over all the ranks: DistributedConfig(dp_replicate_size=1), torchtitan's "
            "data_parallel_replicate_degree=1), or keep them whole on plain tensors with "
            "data_parallel_group= (docs/distributed.md)."
        )
    return (
        f"{head} are neither sharded nor given a data-parallel group: each rank would update them from its own "
        f"partial gradient and the ranks would diverge{note}. Fix: {FIX}.{deepspeed_note()}"
    )


def sum_over_expert_parallel_groups(values, params: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The sum of the 0-dim ``values[p]`` over ``params``, in order, on the first one's device, where the
    part of expert-parallel tensors (:func:`sonar_kernels.specs.mark_expert_parallel`) is summed over their
    group as well (each rank holds other experts): a collective per group, in the order the groups first
    appear in ``params`` (the same on every rank). A 0-dim CPU zero of ``dtype`` when ``params`` is empty."""
    if not params:
        return torch.zeros((), dtype=dtype)
    device = values[params[0]].device
    total = torch.zeros((), dtype=dtype, device=device)
    groups: dict = {}
    for p in params:
        group = specs.expert_parallel_group(p)
        if group is None:
            total = total + values[p].to(device)
        else:
            groups.setdefault(group, []).append(p)
    for group, members in groups.items():
        part = torch.zeros((), dtype=dtype, device=device)
        for p in members:
            part = part + values[p].to(device)
        if world_size() > 1:
            dist.all_reduce(part, group=group)
        total = total + part
    return total


def ddp_class():
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def exclude_from_ddp(model: torch.nn.Module, experts, apply: bool = True) -> None:
    """Put ``experts`` on DDP's ignore list of ``model`` (the module DDP will wrap), so that DDP's reducer
    does not hold them: their gradients are reduced by the optimizer before their update. With ``apply``
    False, only the check below (nothing is changed).

    Raises:
        ValueError: ``model`` is already wrapped by DistributedDataParallel and its reducer holds one of
            ``experts`` (the optimizer must be built on the bare module first).
    """
    ddp = ddp_class()
    experts = list(experts)
    if isinstance(model, ddp):
        ignored = getattr(model, "parameters_to_ignore", set())
        held = [
            name for name, p in model.module.named_parameters() if name not in ignored and _among(p, experts)
        ]
        if held:
            raise ValueError(
                f"the model is already wrapped by DistributedDataParallel, whose reducer holds the expert "
                f"tensors {held[:4]}: DDP would all-reduce buckets of them every step while they are updated "
                "here. Build the optimizer on the bare module first, then wrap it: "
                "opt = SonarAdamW(model, data_parallel_group=group); model = DistributedDataParallel(model)"
            )
        return
    if not apply:
        return
    names = [name for name, p in model.named_parameters() if _among(p, experts)]
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    ddp._set_params_and_buffers_to_ignore_for_model(model, ignored + [n for n in names if n not in ignored])


def _among(p: torch.Tensor, tensors) -> bool:
    return any(p is q for q in tensors)


class GradientReducer:
    """Averages expert gradients over a data-parallel group, then applies their updates.

    :meth:`reduce` divides the gradient by the group's size and starts an asynchronous all-reduce (sum)
    of it, in place: the same arithmetic as DDP's default communication hook. The update is applied once
    the reduction is done: when more than :data:`MAX_IN_FLIGHT` reductions are in flight (the oldest
    first), and for all of them at the end of the backward pass (an autograd engine callback), so the
    backward of the next layers overlaps with the communication. Every rank must reduce the same tensors
    in the same order: the autograd order of one model is the same on every rank.
    """

    def __init__(self, group: dist.ProcessGroup, max_in_flight: int = MAX_IN_FLIGHT):
        self.group = group
        self.size = dist.get_world_size(group)
        self.max_in_flight = max_in_flight
        self._pending: deque = deque()
        self._drain_queued = False

    def reduce(self, grad: torch.Tensor, apply: Callable[[], None], in_backward: bool = True) -> None:
        """Average ``grad`` over the group in place, then call ``apply`` (after the reduction). Outside a
        backward (``in_backward=False``) it waits for the reduction at once."""
        with torch.no_grad():
            grad.div_(self.size)
            work = dist.all_reduce(grad, group=self.group, async_op=True)
        self._pending.append((work, apply))
        if not in_backward:
            self.drain()
            return
        if not self._drain_queued:
            self._drain_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.drain)
        while len(self._pending) > self.max_in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, apply = self._pending.popleft()
        work.wait()
        apply()

    def drain(self) -> None:
        """Wait for every reduction in flight and apply its update, oldest first."""
        self._drain_queued = False
        while self._pending:
            self._finish_oldest()

    @property
    def in_flight(self) -> int:
        return len(self._pending)
