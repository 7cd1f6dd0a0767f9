"""The expert optimizer: AdamW applied inside the backward pass."""

from sonar_kernels.optim.expert_adamw import ExpertAdamW, expert_optimizer

__all__ = ["ExpertAdamW", "expert_optimizer"]
