"""@triton.jit kernels and their fixed configurations; launchers live in ``sonar_kernels.ops``."""
