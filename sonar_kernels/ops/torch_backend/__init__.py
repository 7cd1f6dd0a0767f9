"""The "torch" backend: the expert MLP on torch's GEMMs, and the updates outside the wgrad epilogue (torch's
AdamW on one tensor; 8-bit moments and stochastic rounding in the "fp64" arithmetic, on the CPU in C)."""
