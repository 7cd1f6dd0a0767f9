"""README's quick start, as written there (`make quickstart` runs it from runs/quickstart/; tests/test_readme.py
keeps this file and README's block the same): a transformers MoE model with experts_implementation="sonar"
trained three steps by SonarAdamW, then saved as plain transformers weights."""

import torch
import transformers

import sonar_kernels  # makes experts_implementation="sonar" available in transformers (>= 5.13)

# Yours: transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="sonar"),
# e.g. "allenai/OLMoE-1B-7B-0924" in bf16 on a GPU. Here a tiny random
# OLMoE, built the same way.
config = transformers.OlmoeConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="sonar")
# Where torch.optim.AdamW was: the model, its parameters, or groups built by name all work. Pass
# max_grad_norm instead of calling clip_grad_norm_ (either way only the dense gradients are clipped).
optimizer = sonar_kernels.SonarAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
for _ in range(3):
    input_ids = torch.randint(0, config.vocab_size, (2, 12))
    model(input_ids=input_ids, labels=input_ids).loss.backward()  # the experts are updated here
    optimizer.step()  # the dense parameters: clipped (dense only), then torch.optim.AdamW
    optimizer.zero_grad()
assert len(optimizer.expert_tensors) == 4  # every experts tensor updated in the backward
model.save_pretrained("olmoe-finetuned")  # plain transformers weights, unchanged names and layout
print(f"{len(optimizer.expert_tensors)} expert tensors updated in the backward; saved olmoe-finetuned/")
