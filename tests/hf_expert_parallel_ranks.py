"""One rank of transformers' own expert parallelism (``DistributedConfig(ep_size=2, fsdp_size=FSDP)``) on a
tiny OLMoE running experts_implementation "sonar": 3 steps with SonarAdamW, then (KINDS "sonar,torch") 3 with
torch.optim.AdamW(fused=True) (what SonarAdamW's default flags run) from the same checkpoint; each rank
saves each model's full parameters, the ShardedExpertsWarnings it saw and their text. Rank r's batch of
step s is seeded 10 * s + r. Run by torchrun from tests/test_transformers_expert_parallel.py:
``python -m torch.distributed.run --nproc-per-node FSDP tests/hf_expert_parallel_ranks.py CHECKPOINT OUT FSDP
KINDS`` (FSDP 2 and KINDS "sonar,torch" when left out)."""

import gc
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from transformers.distributed import DistributedConfig

import sonar_kernels
from sonar_kernels.integrations import transformers as sonar_transformers


def batch(step: int, rank: int) -> torch.Tensor:
    """The token ids [2, 16] of rank ``rank`` at step ``step``."""
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))


def main(checkpoint: str, out: str, fsdp_size: str = "2", kinds: str = "sonar,torch") -> None:
    sonar_transformers.register()
    for kind in kinds.split(","):
        model = transformers.OlmoeForCausalLM.from_pretrained(
            checkpoint,
            experts_implementation="sonar",
            distributed_config=DistributedConfig(ep_size=2, fsdp_size=int(fsdp_size)),
        )
        rank = dist.get_rank()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if kind == "sonar":
                optimizer = sonar_kernels.SonarAdamW(model, lr=1e-2)
                assert len(optimizer.expert_tensors) == 2 * model.config.num_hidden_layers
            else:
                # Fused: SonarAdamW's default flags run torch's fused AdamW on the CPU (every parameter here
                # is a DTensor, so one fused call takes them all).
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            for step in range(3):
                ids = batch(step, rank)
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        params = {
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()
        }
        # The sharded experts are updated from their reduced gradient, not in the wgrad epilogue: said once,
        # with the reason; the library's other warnings, by category.
        sharded = [w for w in caught if issubclass(w.category, sonar_kernels.optim.ShardedExpertsWarning)]
        params["sharded_warnings"], params["sharded_messages"] = (
            len(sharded),
            [str(w.message) for w in sharded],
        )
        params["other_warnings"] = [
            w.category.__name__
            for w in caught
            if w.category.__module__.startswith("sonar_kernels") and w not in sharded
        ]
        torch.save(params, Path(out) / f"{kind}-{rank}.pt")
        del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
