"""@triton.jit kernels and their default configurations; launchers (and the tuning candidates,
``ops/triton_backend/configs.py``) live in ``sonar_kernels.ops.triton_backend``."""
