"""The in-backward optimizers: AdamW applied to the expert weights inside the backward pass."""

from sonar_kernels.optim.expert_adamw import ExpertAdamW
from sonar_kernels.optim.in_backward import expert_optimizer

__all__ = ["ExpertAdamW", "expert_optimizer"]
