"""Expert parallelism beside FSDP2: the dense layers sharded by ``fully_shard``, the experts held whole by
their expert-parallel rank and updated in the backward from their complete gradient (docs/distributed.md,
"Expert parallel with the dense layers on FSDP2").

FSDP2 must not manage an expert-parallel experts module: its reduce-scatter would average the gradients of
*different* experts (rank r holds experts [r * E / P, (r + 1) * E / P)), and the update would run on that
mixture. ``nn/fsdp_guard.py`` refuses that layout at the module's forward, before anything changes;
:func:`fully_shard_dense` builds the right one and checks the mesh against the model.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from sonar_kernels.nn.experts import SonarExperts
from sonar_kernels.nn.fsdp_guard import check_not_fsdp_managed

__all__ = ["fully_shard_dense"]


def fully_shard_dense(model: nn.Module, mesh, *, layers=(), ep_dim: str = "ep", **fsdp_kwargs) -> nn.Module:
    """``fully_shard`` each of ``layers`` and then ``model`` over every rank of ``mesh`` (flattened), with
    the expert tensors of every expert-parallel :class:`sonar_kernels.SonarExperts` in ``ignored_params``:
    the dense layers sharded by FSDP2, the experts held whole by their expert-parallel rank and updated in
    the backward (docs/distributed.md, "Expert parallel with the dense layers on FSDP2").

    Args:
        model: the bare model (nothing sharded yet) with its SonarExperts built with
            ``ep_group=mesh[ep_dim]``.
        mesh: a DeviceMesh whose dimension ``ep_dim`` is the experts' expert-parallel dimension: 1-D
            (``("ep",)``, EP over every rank) or 2-D (e.g. ``("dp", "ep")``: the experts replicated over
            ``mesh["dp"]``, which then goes to ``SonarAdamW(model, data_parallel_group=mesh["dp"])``).
        layers: submodules to shard on their own (e.g. the decoder blocks), before ``model``.
        **fsdp_kwargs: passed to every ``fully_shard`` (``mp_policy``, ``reshard_after_forward``, ...).
    Returns:
        ``model`` (now an FSDPModule).
    Raises:
        TypeError: ``mesh`` is not a DeviceMesh.
        ValueError: ``mesh`` has no dimension named ``ep_dim``; an expert-parallel SonarExperts whose
            ``ep_group`` is not the ranks of ``mesh[ep_dim]`` (the mesh's dims disagree with the model's);
            ``model`` has no expert-parallel SonarExperts; ``ignored_params`` passed; an experts module
            already under FSDP2. Raised before anything is sharded.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names or ()
    if ep_dim not in names:
        raise ValueError(f"mesh must have a dimension named {ep_dim!r} (ep_dim), got dimensions {names}")
    if "ignored_params" in fsdp_kwargs:
        raise ValueError("ignored_params is set by fully_shard_dense (the expert tensors); do not pass it")
    ep_ranks = dist.get_process_group_ranks(mesh[ep_dim].get_group())
    experts = [m for m in model.modules() if isinstance(m, SonarExperts) and m.ep_group is not None]
    if not experts:
        raise ValueError(
            "model has no expert-parallel SonarExperts (built with ep_group=mesh[ep_dim]); for experts "
            "replicated on every rank, fully_shard the experts modules as well (docs/distributed.md, FSDP2)"
        )
    for module in experts:
        ranks = dist.get_process_group_ranks(module.ep_group)
        if ranks != ep_ranks:
            raise ValueError(
                f"mesh[{ep_dim!r}] holds ranks {ep_ranks} on this rank, but a SonarExperts' ep_group holds "
                f"{ranks} (its {module.num_experts} experts over {len(ranks)} ranks): the mesh's dims disagree "
                f"with the model's. Build the experts with ep_group=mesh[{ep_dim!r}]"
            )
        check_not_fsdp_managed(module, module.ep_group)
    ignored = {p for module in experts for p in module.parameters(recurse=False)}
    flat = mesh if mesh.ndim == 1 else mesh._flatten("_".join(names))
    for layer in layers:
        fully_shard(layer, mesh=flat, ignored_params=ignored, **fsdp_kwargs)
    return fully_shard(model, mesh=flat, ignored_params=ignored, **fsdp_kwargs)
