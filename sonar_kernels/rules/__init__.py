"""The update rules: what one AdamW update does to one element, for each state kind, in torch ops.

Each module states one rule; it is both the reference the Triton tiles are tested against and the torch
backend's implementation. The Triton tile of each is named in its docstring.

- ``adamw``: AdamW in the "fp64" arithmetic (the bias-corrected scalars, the gradient limit); its tile:
  ``kernels/adamw.py``'s ``_adamw_math``;
- ``moments_8bit``: the 8-bit moments' codes and block scales; tiles: ``kernels/moments_8bit.py``;
- ``master_weights``: the 16-bit remainder and stochastic rounding of bf16 weights; device functions:
  ``kernels/master_weights.py``;
- ``clipping``: expert clipping (the gradient's scale and SPAM's spike rule); tile: ``kernels/adamw.py``'s
  ``clip_tile``;
- ``update``: the rules composed (moments kind x master kind, with or without clipping), the torch
  backend's update of one slice, compiled on the CPU by ``compiled`` (torch.compile).

The modules import only downward (adamw; then moments_8bit, master_weights, clipping, compiled; then
update: a contract in pyproject.toml). The launchers and custom ops that run them are in ``sonar_kernels.ops``.
"""
