"""The in-backward optimizers: AdamW applied to the expert weights inside the backward pass."""

from sonar_kernels.optim.expert_adamw import ExpertAdamW
from sonar_kernels.optim.in_backward import expert_optimizer, is_expert_tensor, mark_expert_tensors
from sonar_kernels.optim.ownership import ShardedExpertsWarning, UnownedExpertsWarning
from sonar_kernels.optim.sonar_adamw import SonarAdamW

__all__ = [
    "ExpertAdamW",
    "ShardedExpertsWarning",
    "SonarAdamW",
    "UnownedExpertsWarning",
    "expert_optimizer",
    "is_expert_tensor",
    "mark_expert_tensors",
]
