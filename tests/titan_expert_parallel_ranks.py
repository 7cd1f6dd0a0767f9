"""One rank of torchtitan's own expert parallelism with its FSDP (torchtitan 0.3.0), without its trainer: a
tiny decoder of torchtitan MoE layers (its router, AllToAllTokenDispatcher and the experts swapped to
SonarGroupedExperts by torchtitan's override mechanism), made expert-parallel by torchtitan's
``Module.parallelize(ParallelDims)`` (the experts ``Shard(0)`` over "ep", the dispatcher wired to the "ep"
mesh) and sharded by its ``apply_fsdp_to_decoder`` (the dense parameters over "fsdp", the experts over
"efsdp" through ``shard_placement_fn``), ParallelDims(dp_shard=WORLD, ep=2), backend "partial_dtensor".

One run per entry of KINDS: "sonar", 3 steps with SonarAdamW through torchtitan's optimizer container
(``sonar_adamw``: torchtitan's default AdamW hyperparameters), the dense parameters clipped by torchtitan's
``clip_grad_norm_``; "torch", the same with torchtitan's stock container of torch.optim.AdamW(fused=True)
(``default_adamw(fused=True)``: what SonarAdamW's default flags run) and the same clipping; "resume",
SonarAdamW's step 0, a DCP checkpoint, then steps 1 and 2 on a fresh model and optimizer loaded from it;
"hsdp", with data_parallel_replicate_degree 2 as well (HSDP), SonarAdamW's first step, which is refused. Each saves this rank's view of the full parameters (and the warnings it saw) as
"KIND-RANK.pt" in OUT. Rank r's batch of step s is seeded 10 * s + r; each rank's loss is its summed
cross-entropy over the global token count (torchtitan's convention: FSDP's gradient division is off).

Two things stand between torchtitan's functions and a CPU mesh, both set here as the trainer cannot:
torchtitan.tools.utils.device_type is "cuda" on a machine without an accelerator
(``_get_available_device_type() or "cuda"``), so ``ParallelDims.build_mesh`` calls
``init_device_mesh("cuda", ...)``, which fails in ``torch.cuda.set_device``: set to "cpu" here; and
``apply_fsdp_to_decoder`` turns FSDP's gradient division off (factor 1.0), which FSDP2 runs as a
reduce-scatter with ``ReduceOp.PREMUL_SUM`` that gloo refuses: ``set_force_sum_reduction_for_comms(True)``
makes it the plain sum it means (docs/distributed.md, "From the stacks users run").

Run by torchrun from tests/test_torchtitan_expert_parallel.py (KINDS "sonar,torch" when left out):
``python -m torch.distributed.run --nproc-per-node WORLD tests/titan_expert_parallel_ranks.py OUT KINDS``.
"""

import gc
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from dcp_resume import load_checkpoint
from torch import nn
from torchtitan.config import OverrideConfig
from torchtitan.config.override import apply_overrides
from torchtitan.models.common.config_utils import (
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)

import sonar_kernels

D, F, E, TOP_K, VOCAB, LAYERS, EP = 16, 8, 4, 2, 32, 2, 2
LR, MAX_NORM, STEPS = 1e-2, 0.25, 3
EXPERTS_OVERRIDE = "sonar_kernels.integrations.torchtitan.sonar_grouped_experts"


def batch(step: int, rank: int) -> torch.Tensor:
    """The token ids [2, 8] of rank ``rank`` at step ``step``."""
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))


class Block(nn.Module):
    """A transformer block of torchtitan's MoE layer alone (``moe_enabled`` and ``moe``: what
    apply_fsdp_to_decoder reads); attention is left out: torchtitan's language models take flex or varlen
    attention only, and torch's FlexAttention has no backward on the CPU ("FlexAttention does not support
    backward on CPU")."""

    moe_enabled = True

    def __init__(self, ep: bool):
        super().__init__()
        config = make_moe_config(
            num_experts=E,
            load_balance_coeff=None,
            router=make_router_config(
                dim=D, num_experts=E, gate_param_init={}, top_k=TOP_K, score_func="softmax"
            ),
            routed_experts=make_routed_experts_config(
                dim=D, hidden_dim=F, num_experts=E, top_k=TOP_K, param_init={}, comm_backend="standard"
            ),
        )
        if ep:
            from torchtitan.models.common.moe_sharding import set_moe_sharding_config
            from torchtitan.models.qwen3.sharding import _GROUPED_EXPERTS_PARAM_LAYOUT

            set_moe_sharding_config(
                config, enable_ep=True, enable_sp=False, expert_param_layout=_GROUPED_EXPERTS_PARAM_LAYOUT
            )
        options = {"backend": "torch", "compute_dtype": "input"}
        apply_overrides(OverrideConfig(imports=[(EXPERTS_OVERRIDE, options)]), config)
        self.moe = config.build()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(h)


class Decoder(nn.Module):
    """What torchtitan's Decoder gives apply_fsdp_to_decoder: tok_embeddings, layers (a ModuleDict), norm,
    lm_head, enable_weight_tying."""

    enable_weight_tying = False

    def __init__(self, ep: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleDict({str(i): Block(ep) for i in range(LAYERS)})
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for block in self.layers.values():
            h = block(h)
        return self.lm_head(self.norm(h))


def loss_of(model: nn.Module, ids: torch.Tensor, global_tokens: int) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="sum") / global_tokens


def parallelized(dp_replicate: int = 1) -> Decoder:
    """The Decoder through torchtitan's EP (Module.parallelize) and FSDP (apply_fsdp_to_decoder) on the
    meshes its parallelize_qwen3 picks (with ``dp_replicate`` 2: HSDP, the dense parameters on
    ("dp_replicate", "fsdp"), the experts on ("dp_replicate", "efsdp"))."""
    import torchtitan.distributed.parallel_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    torchtitan.distributed.parallel_dims.device_type = "cpu"
    world = dist.get_world_size()
    dims = ParallelDims(
        dp_replicate=dp_replicate,
        dp_shard=world // dp_replicate,
        cp=1,
        tp=1,
        pp=1,
        ep=EP,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    model = Decoder(ep=True)
    for block in model.layers.values():
        block.moe.parallelize(dims)
    replicate = ["dp_replicate"] if dp_replicate > 1 else []
    apply_fsdp_to_decoder(
        model,
        dims.get_mesh([*replicate, "fsdp"]),
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        pp_enabled=False,
        ep_degree=EP,
        edp_mesh=dims.get_optional_mesh([*replicate, "efsdp"]),
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def hsdp(out: str) -> None:
    """HSDP beside EP (dp_replicate 2): SonarAdamW's first step is refused; "hsdp-RANK.pt" holds the
    refusal's type and text and the names of the parameters that changed."""
    model = parallelized(dp_replicate=2)
    before = full_parameters(model)
    try:
        train(model, optimizers_of(model, "sonar"), range(1))
        refusal = None
    except (RuntimeError, ValueError) as error:
        refusal = (type(error).__name__, str(error))
    changed = [name for name, p in full_parameters(model).items() if not torch.equal(p, before[name])]
    torch.save({"refusal": refusal, "changed": changed}, Path(out) / f"hsdp-{dist.get_rank()}.pt")


def dense_parameters(model: nn.Module) -> list[torch.Tensor]:
    return [p for name, p in model.named_parameters() if "inner_experts" not in name]


def train(model, optimizers, steps: range) -> list[float]:
    """Train ``steps``; the dense gradients' norms before clipping."""
    from torchtitan.distributed.utils import clip_grad_norm_

    world = dist.get_world_size()
    norms = []
    for step in steps:
        ids = batch(step, dist.get_rank())
        loss_of(model, ids, ids.numel() * world).backward()
        # torchtitan's clipping, dense parameters only (the experts' gradients are not there with
        # SonarAdamW; the torch run clips the same parameters).
        norm = clip_grad_norm_(dense_parameters(model), MAX_NORM)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizers.step()
        optimizers.zero_grad()
    return norms


def full_parameters(model) -> dict:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def optimizers_of(model, kind: str):
    """torchtitan's optimizer container: its default AdamW (betas (0.9, 0.95), eps 1e-8, weight_decay 0.1)
    with SonarAdamW in its place (``sonar_adamw``), or torch.optim.AdamW(fused=True) (``default_adamw``)."""
    from torchtitan.components.optimizer import default_adamw

    from sonar_kernels.integrations.torchtitan import sonar_adamw

    config = default_adamw(lr=LR, fused=True) if kind == "torch" else sonar_adamw(lr=LR)
    return config.build(model_parts=[model])


def resume(out: str) -> None:
    """Step 0 with SonarAdamW, a DCP checkpoint of the model and optimizer (torch's get_state_dict), then a
    fresh model (its weights moved off) and optimizer loaded from it for steps 1 and 2: "resume-RANK.pt"."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = parallelized()
    optimizers = optimizers_of(model, "sonar")
    train(model, optimizers, range(1))
    (optimizer,) = optimizers.optimizers
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=Path(out) / "dcp")
    del model, optimizers, optimizer
    resumed = parallelized()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)
    optimizers = optimizers_of(resumed, "sonar")
    (optimizer,) = optimizers.optimizers
    load_checkpoint(resumed, optimizer, Path(out) / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sonar_kernels.optim.ShardedExpertsWarning)
        train(resumed, optimizers, range(1, STEPS))
    torch.save(full_parameters(resumed), Path(out) / f"resume-{dist.get_rank()}.pt")


def main(out: str, kinds: str = "sonar,torch") -> None:
    dist.init_process_group("gloo")
    try:
        for kind in kinds.split(","):
            if kind in ("resume", "hsdp"):
                {"resume": resume, "hsdp": hsdp}[kind](out)
                continue
            model = parallelized()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                optimizers = optimizers_of(model, kind)
                norms = train(model, optimizers, range(STEPS))
            params = full_parameters(model)
            params["grad_norms"] = norms
            sharded = [w for w in caught if issubclass(w.category, sonar_kernels.optim.ShardedExpertsWarning)]
            params["sharded_messages"] = [str(w.message) for w in sharded]
            params["other_warnings"] = [
                w.category.__name__
                for w in caught
                if w.category.__module__.startswith("sonar_kernels") and w not in sharded
            ]
            params["placements"] = {
                name: (tuple(p.device_mesh.mesh_dim_names), tuple(str(x) for x in p.placements))
                for name, p in model.named_parameters()
            }
            torch.save(params, Path(out) / f"{kind}-{dist.get_rank()}.pt")
            del model, optimizers
        gc.collect()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
