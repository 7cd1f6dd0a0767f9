"""torch.autograd.Function classes and the functional entry points."""

from sonar_kernels.autograd.moe_mlp import MoEMLPFunction, moe_mlp

__all__ = ["MoEMLPFunction", "moe_mlp"]
