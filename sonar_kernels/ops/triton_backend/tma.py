"""Host-side TMA tensor descriptors of the grouped GEMMs, and where they may be used.

Hopper's Tensor Memory Accelerator reads a tile of a tensor described by its base, shape and strides:
the base and every stride but the last must be 16-byte aligned, the last stride 1 (docs/design.md,
"Speed on the GPU"). The expert weights' layouts vary (:data:`sonar_kernels.specs.LAYOUTS`): a layout
whose weight has no unit stride along the GEMM's K or N (interleaved transposed W1 in dX: its unit stride
is between the gate and the up half), a separate layout whose up tensor lies before its gate tensor or an
unaligned number of bytes after it, or operands at unaligned addresses get no descriptor, and the TMA
candidates of ops/triton_backend/configs.py are then not offered (a pinned or already tuned TMA configuration runs the
pointer kernel at the same tile).

The descriptors are host objects (``triton.tools.tensor_descriptor.TensorDescriptor``): the kernel gets
them as ``__grid_constant__`` parameters, so nothing is allocated on the device and nothing is synced.
The Triton interpreter emulates them (the tests); a CUDA device takes them from compute capability 9
(sm_90) on.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from sonar_kernels.kernels.expert_mlp_tma import expert_mlp_grouped_mm_tma_kernel
from sonar_kernels.ops.common import max_row_tiles, tile_offsets_for

# Programs per SM of a persistent grid: the persistent candidates fit at least 2 CTAs per sm_90 SM
# (make kernel-report; tests/test_aot_compile.py holds it).
PERSISTENT_CTAS_PER_SM = 2
# The interpreter's persistent grid: a few programs, so that each walks several tiles (the tests).
INTERPRETER_PROGRAMS = 3


def tma_supported(device: torch.device) -> bool:
    """Whether ``device`` runs TMA descriptor loads: a CUDA device of compute capability 9 or later, or
    the CPU (the Triton interpreter emulates them)."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device: torch.device, tiles: int) -> int:
    """Programs of a persistent grid over at most ``tiles`` output tiles: PERSISTENT_CTAS_PER_SM per SM
    of a CUDA device (its properties, no sync), INTERPRETER_PROGRAMS under the interpreter."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        programs = PERSISTENT_CTAS_PER_SM * _sm_count(index)
    else:
        programs = INTERPRETER_PROGRAMS
    return max(1, min(programs, tiles))


def _describable(base: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """TMA's rule: a 16-byte aligned base, every stride but the last positive and 16-byte aligned, the last 1."""
    size = base.element_size()
    if base.data_ptr() % 16 or strides[-1] != 1:
        return False
    return all(stride > 0 and (stride * size) % 16 == 0 and stride * size < 2**40 for stride in strides[:-1])


def grouped_mm_descriptors(
    a: torch.Tensor,
    weight: torch.Tensor,
    weight_strides: tuple[int, int, int, int],
    halves: int,
    H: int,
    block_m: int,
    block_n: int,
    block_k: int,
) -> tuple[TensorDescriptor, TensorDescriptor, bool] | None:
    """The descriptors of ``expert_mlp_grouped_mm_tma_kernel`` (kernels/expert_mlp_tma.py), or None where
    the operands' layout does not allow TMA.

    Args:
        a: [S, halves * I] rows of A (the down projection) or dHpre (dX), expert-sorted; the half h of a
            row is its columns [h I, (h + 1) I).
        weight: the tensor whose first element is W[expert 0, half 0, k 0, n 0] (W2's view, or the base of
            :class:`sonar_kernels.ops.common.GateUpOperand`), [E, ...], any floating dtype.
        weight_strides: (expert, half, k, n) element strides of W[e, half] seen as [K = I, N = H]; the half
            stride is not read when ``halves`` is 1.
        halves: 1 (the down projection, an ungated dX) or 2 (dX over W1's gate and up halves).
        H: the GEMM's N (the hidden size).
        block_m, block_n, block_k: the tile.
    Returns:
        (a_desc over [halves, S, I], w_desc over [E, halves, I, H] or [E, halves, H, I], W_KN: whether the
        weight's unit stride is along N, its descriptor then the first of the two).
    """
    S, I = a.shape[0], a.shape[1] // halves
    E = weight.shape[0]
    stride_e, stride_half, stride_k, stride_n = weight_strides
    if halves == 1:
        stride_half = stride_e  # a dimension of one entry: never stepped, any valid stride
    if min(S, I, E, H) == 0 or a.stride(1) != 1:
        return None
    a_strides = (I if halves == 2 else a.stride(0), a.stride(0), 1)
    if not _describable(a, a_strides):
        return None
    if stride_n == 1:
        w_kn, w_shape, w_strides = True, (E, halves, I, H), (stride_e, stride_half, stride_k, 1)
        w_block = (1, 1, block_k, block_n)
    elif stride_k == 1:
        w_kn, w_shape, w_strides = False, (E, halves, H, I), (stride_e, stride_half, stride_n, 1)
        w_block = (1, 1, block_n, block_k)
    else:
        return None
    if not _describable(weight, w_strides):
        return None
    a_desc = TensorDescriptor(a, [halves, S, I], list(a_strides), [1, block_m, block_k])
    w_desc = TensorDescriptor(weight, list(w_shape), list(w_strides), list(w_block))
    return a_desc, w_desc, w_kn


def usable(a: torch.Tensor, weight: torch.Tensor, weight_strides: tuple, halves: int, H: int) -> bool:
    """Whether the TMA grouped GEMM may run on these operands here (the device, then the layout)."""
    if not tma_supported(a.device):
        return False
    return grouped_mm_descriptors(a, weight, weight_strides, halves, H, 64, 64, 32) is not None


def launch_grouped_mm(
    cfg, a, weight, weight_strides, halves, bias, bias_strides, meta, y, E, H, I, precision, interpret
) -> bool:
    """Launch ``expert_mlp_grouped_mm_tma_kernel`` at tile ``cfg`` (a TMA :class:`ops.triton_backend.configs.Config`) for
    y[r] = sum over halves of a[r, half] @ W[e(r), half]^T (+ bias[e(r)]); False, launching nothing,
    where the device or the operands' layout does not allow TMA (the caller then runs the pointer kernel
    at the same tile). Arguments as :func:`grouped_mm_descriptors`; ``bias`` [E, H] or None, ``bias_strides``
    its (expert, column) strides; ``meta`` the routing metadata; ``y`` [S, H], written for kept rows."""
    if not tma_supported(a.device):
        return False
    descriptors = grouped_mm_descriptors(
        a, weight, weight_strides, halves, H, cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K
    )
    if descriptors is None:
        return False
    a_desc, w_desc, w_kn = descriptors
    S = a.shape[0]
    tiles = max_row_tiles(S, E, cfg.BLOCK_M) * triton.cdiv(H, cfg.BLOCK_N)
    grid = (persistent_programs(a.device, tiles) if cfg.PERSISTENT else tiles,)
    expert_mlp_grouped_mm_tma_kernel[grid](
        a_desc, w_desc, weight if bias is None else bias, meta.expert_offsets,
        tile_offsets_for(meta, cfg.BLOCK_M), y,
        E, H, I,
        y.stride(0), y.stride(1), *bias_strides,
        HALVES=halves, W_KN=w_kn, HAS_BIAS=bias is not None, PERSISTENT=cfg.PERSISTENT, **cfg.blocks(),
        INPUT_PRECISION=precision, INTERPRET=interpret, **cfg.launch(),
    )  # fmt: skip
    return True


def up_descriptor(w1, H: int, block_n: int, block_k: int) -> TensorDescriptor | None:
    """The W1 descriptor of ``expert_mlp_fwd_up_tma_kernel``: over [E, halves, I, H] (``w1`` a
    :class:`sonar_kernels.ops.common.GateUpOperand`), block [1, halves, block_n, block_k], or None where the
    layout does not allow it (W1's unit stride not along H: the transposed layouts; a separate layout's up
    tensor before its gate tensor or an unaligned number of bytes after it; an unaligned base or row)."""
    E, halves, I = w1.base.shape[0], w1.halves, w1.I
    stride_e, stride_half, stride_i, stride_h = w1.strides
    if halves == 1:
        stride_half = stride_e  # a dimension of one entry: never stepped, any valid stride
    strides = (stride_e, stride_half, stride_i, stride_h)
    if min(E, I, H) == 0 or not _describable(w1.base, strides):
        return None
    return TensorDescriptor(w1.base, [E, halves, I, H], list(strides), [1, halves, block_n, block_k])


def up_usable(w1, H: int) -> bool:
    """Whether the TMA up-projection may run on this W1 here (the device, then the layout)."""
    return tma_supported(w1.base.device) and up_descriptor(w1, H, 64, 32) is not None
