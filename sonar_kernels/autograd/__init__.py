"""The expert MLP's functional entry points (``moe_mlp``, ``grouped_mlp``) and their autograd formula over the
sonar_kernels:: custom ops (``formula``)."""

from sonar_kernels.autograd.moe_mlp import grouped_mlp, moe_mlp

__all__ = ["grouped_mlp", "moe_mlp"]
