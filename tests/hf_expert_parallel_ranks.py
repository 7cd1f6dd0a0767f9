"""One rank of transformers' own expert parallelism (``DistributedConfig(ep_size=2, fsdp_size=2)``) on a tiny
OLMoE running experts_implementation "sonar": 3 steps with SonarAdamW, then 3 with
torch.optim.AdamW(fused=True) (what SonarAdamW's default flags run) from the same checkpoint; each rank
saves both models' full parameters. Run by torchrun from tests/test_transformers_expert_parallel.py:
``python -m torch.distributed.run --nproc-per-node 2 tests/hf_expert_parallel_ranks.py CHECKPOINT OUT``."""

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


def main(checkpoint: str, out: str) -> None:
    sonar_transformers.register()
    for kind in ("sonar", "torch"):
        model = transformers.OlmoeForCausalLM.from_pretrained(
            checkpoint,
            experts_implementation="sonar",
            distributed_config=DistributedConfig(ep_size=2, fsdp_size=2),
        )
        rank = dist.get_rank()
        if kind == "sonar":
            optimizer = sonar_kernels.SonarAdamW(model, lr=1e-2)
            assert len(optimizer.expert_tensors) == 2 * model.config.num_hidden_layers
        else:
            # Fused: SonarAdamW's default flags run torch's fused AdamW on the CPU (every parameter here is
            # a DTensor, so one fused call takes them all).
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", sonar_kernels.optim.ShardedExpertsWarning)
            for step in range(3):
                ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        params = {
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()
        }
        # The sharded experts are updated from their reduced gradient, not in the wgrad epilogue: said once.
        params["sharded_warnings"] = sum(
            issubclass(w.category, sonar_kernels.optim.ShardedExpertsWarning) for w in caught
        )
        torch.save(params, Path(out) / f"{kind}-{rank}.pt")
        del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
