"""The "triton" backend: the Triton launchers of the expert MLP's forward, backward and wgrad with its fused
AdamW update, their tile configurations and TMA descriptors, and the standalone update kernels' launchers."""
