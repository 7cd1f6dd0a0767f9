"""One rank of transformers' own expert parallelism (``DistributedConfig(ep_size=2, fsdp_size=FSDP)``) on a
tiny OLMoE running experts_implementation "sonar", one run per entry of KINDS: "sonar", 3 steps with
SonarAdamW; "torch", 3 with torch.optim.AdamW(fused=True) (what SonarAdamW's default flags run); "resume",
SonarAdamW's step 0, a DCP checkpoint, then steps 1 and 2 on a fresh model and optimizer loaded from it;
"hsdp", with dp_replicate_size=2 as well, SonarAdamW's first step, which is refused.
Every run starts from the same checkpoint and saves this rank's view of the full parameters (the first
two also the ShardedExpertsWarnings they saw, their text and the library's other warnings). Rank r's batch
of step s is seeded 10 * s + r. Run by torchrun from tests/test_transformers_expert_parallel.py:
``python -m torch.distributed.run --nproc-per-node FSDP tests/hf_expert_parallel_ranks.py CHECKPOINT OUT FSDP
KINDS`` (FSDP 2 and KINDS "sonar,torch" when left out)."""

import gc
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from dcp_resume import load_checkpoint
from transformers.distributed import DistributedConfig

import sonar_kernels
from sonar_kernels.integrations import transformers as sonar_transformers


def batch(step: int, rank: int) -> torch.Tensor:
    """The token ids [2, 16] of rank ``rank`` at step ``step``."""
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))


def load(checkpoint: str, fsdp_size: str, dp_replicate_size: int = 1) -> transformers.OlmoeForCausalLM:
    return transformers.OlmoeForCausalLM.from_pretrained(
        checkpoint,
        experts_implementation="sonar",
        distributed_config=DistributedConfig(
            ep_size=2, fsdp_size=int(fsdp_size), dp_replicate_size=dp_replicate_size
        ),
    )


def hsdp(checkpoint: str, out: str, fsdp_size: str) -> None:
    """HSDP (dp_replicate_size 2) beside EP: SonarAdamW's first step is refused; saved as "hsdp-RANK.pt":
    the refusal's type and text, and whether any parameter changed."""
    model = load(checkpoint, fsdp_size, dp_replicate_size=2)
    optimizer = sonar_kernels.SonarAdamW(model, lr=1e-2)
    before = full_parameters(model)
    try:
        train(model, optimizer, range(1))
        refusal = None
    except (RuntimeError, ValueError) as error:
        refusal = (type(error).__name__, str(error))
    after = full_parameters(model)
    changed = [name for name, p in after.items() if not torch.equal(p, before[name])]
    torch.save({"refusal": refusal, "changed": changed}, Path(out) / f"hsdp-{dist.get_rank()}.pt")


def full_parameters(model) -> dict:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def train(model, optimizer, steps: range) -> None:
    for step in steps:
        ids = batch(step, dist.get_rank())
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def resume(checkpoint: str, out: str, fsdp_size: str) -> None:
    """Step 0 with SonarAdamW, a DCP checkpoint of the model and optimizer (torch's get_state_dict), then a
    fresh model (its weights moved off the checkpoint's) and optimizer loaded from it (set_state_dict) for
    steps 1 and 2: saved as "resume-RANK.pt", to equal the run without a break bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = load(checkpoint, fsdp_size)
    optimizer = sonar_kernels.SonarAdamW(model, lr=1e-2)
    train(model, optimizer, range(1))
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=Path(out) / "dcp")
    del model, optimizer
    resumed = load(checkpoint, fsdp_size)
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)
    optimizer = sonar_kernels.SonarAdamW(resumed, lr=1e-2)
    load_checkpoint(resumed, optimizer, Path(out) / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sonar_kernels.optim.ShardedExpertsWarning)
        train(resumed, optimizer, range(1, 3))
    torch.save(full_parameters(resumed), Path(out) / f"resume-{dist.get_rank()}.pt")


def main(checkpoint: str, out: str, fsdp_size: str = "2", kinds: str = "sonar,torch") -> None:
    sonar_transformers.register()
    for kind in kinds.split(","):
        if kind in ("resume", "hsdp"):
            {"resume": resume, "hsdp": hsdp}[kind](checkpoint, out, fsdp_size)
            continue
        model = load(checkpoint, fsdp_size)
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
            train(model, optimizer, range(3))
        params = full_parameters(model)
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
