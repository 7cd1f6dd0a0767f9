"""The expert MLP's autograd formula over the sonar_kernels:: custom ops, and the functional entry point."""

from sonar_kernels.autograd.moe_mlp import grouped_mlp, moe_mlp

__all__ = ["grouped_mlp", "moe_mlp"]
