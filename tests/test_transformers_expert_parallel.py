"""transformers' own expert parallelism (its DTensor-sharded experts, sentinel ids for other ranks' experts)
with experts_implementation "sonar" and SonarAdamW, on 2 CPU processes: bitwise equal to the same run with
torch.optim.AdamW(fused=True), what SonarAdamW's default flags run (tests/hf_expert_parallel_ranks.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ranks
import torch
import transformers

from sonar_kernels.integrations import transformers as sonar_transformers

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_transformers_expert_parallel_with_sonar_equals_torch_adamw(tmp_path):
    config = transformers.OlmoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    sonar_transformers.register()
    initial = transformers.OlmoeForCausalLM(config)
    initial.save_pretrained(tmp_path / "checkpoint")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
         str(ranks.free_port()), str(ROOT / "tests" / "hf_expert_parallel_ranks.py"), str(tmp_path / "checkpoint"),
         str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env=os.environ | {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    start = dict(initial.named_parameters())
    for r in range(2):
        sonar, standard = torch.load(tmp_path / f"sonar-{r}.pt"), torch.load(tmp_path / f"torch-{r}.pt")
        assert sonar.pop("sharded_warnings") == 1 and standard.pop("sharded_warnings") == 0
        assert sonar.keys() == standard.keys()
        for name, p in sonar.items():
            assert torch.equal(p, standard[name]), (r, name)
        # The experts trained (a comparison of untouched weights would prove nothing).
        name = "model.layers.0.mlp.experts.gate_up_proj"
        assert not torch.equal(sonar[name], start[name].detach())
