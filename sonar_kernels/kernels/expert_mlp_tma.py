"""The down-projection / dX grouped GEMM with its operands loaded through TMA tensor descriptors.

The math of :func:`sonar_kernels.kernels.expert_mlp_fwd.expert_mlp_grouped_mm_kernel`, Y[r] = sum over the
halves of A[r, half] @ W[e(r), half]^T, with both operands read by the Tensor Memory Accelerator (Hopper's
``cp.async.bulk.tensor``) instead of per-thread pointer loads: the expert weight tile through a 4-D
descriptor over [E, halves, rows, columns] (one expert, one half), so the K tail and the N tail are
zero-filled by the hardware and a tile never reads the next half or the next expert; the A rows (contiguous
in expert order) through a 3-D descriptor over [halves, S, I], zero-filled past I and past S. Rows of a
tile past its expert's last row read the next expert's rows (or rows never written): they only reach
output rows that are masked at the store. Same tiles, same K order, same rounding of the operands as the
pointer kernel, so the interpreter gives the same bits (tests/test_configs.py).

The descriptors are built on the host (``triton.tools.tensor_descriptor.TensorDescriptor``, no device
allocation) by :func:`sonar_kernels.ops.triton_backend.tma.grouped_mm_descriptors`, which offers the kernel only where the
layout allows it (16-byte aligned base and strides, a unit stride along K or N of the weight).

With ``PERSISTENT`` the grid is a fixed number of programs (the SM count) that walk the tiles, row tile
major (so an expert's tiles run together and its weight stays in L2), the tile count read from
``tile_offsets[E]`` on the device (docs/design.md, "Forward").
"""

import triton
import triton.language as tl

from sonar_kernels.kernels.common import expert_tile, round_to
from sonar_kernels.kernels.expert_mlp_fwd import up_epilogue


@triton.jit
def _tma_tile(
    acc,  # [BLOCK_M, BLOCK_N] fp32, added to
    a_desc,
    w_desc,
    expert,
    row_start,
    n_start,
    I,
    HALVES: tl.constexpr,
    W_KN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """acc + sum over halves and K blocks of A[rows, half, k] @ W[expert, half]^T[k, cols] (the order of
    grouped_mm_acc: half by half, K ascending). Returns [BLOCK_M, BLOCK_N] fp32."""
    for half in tl.static_range(HALVES):
        for k0 in range(0, I, BLOCK_K):
            a = tl.reshape(a_desc.load([half, row_start, k0]), (BLOCK_M, BLOCK_K))
            if W_KN:  # the weight's unit stride along N: the tile comes as [K, N]
                b = tl.reshape(w_desc.load([expert, half, k0, n_start]), (BLOCK_K, BLOCK_N))
            else:  # unit stride along K: [N, K], transposed in registers (wgmma reads either order)
                b = tl.trans(tl.reshape(w_desc.load([expert, half, n_start, k0]), (BLOCK_N, BLOCK_K)))
            a = round_to(a, DOT_DTYPE, INTERPRET)
            b = round_to(b, DOT_DTYPE, INTERPRET)
            if INTERPRET:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit(do_not_specialize=("E",))  # E only bounds loops and masks: one build for every expert count
def expert_mlp_grouped_mm_tma_kernel(
    # descriptors and pointers
    a_desc,  # [HALVES, S, I] activation dtype, block [1, BLOCK_M, BLOCK_K], read
    w_desc,  # [E, HALVES, I, H] (W_KN) or [E, HALVES, H, I], activation dtype or fp32, block of one expert
    b2_ptr,  # [E, H] dtype of the weight, read when HAS_BIAS
    expert_offsets_ptr,  # [E + 1] int32, read
    tile_offsets_ptr,  # [E + 1] int32, read
    y_ptr,  # [S, H] activation dtype, written for rows < expert_offsets[E]
    # sizes
    E,
    H,
    I,
    # strides
    stride_ys,
    stride_yh,
    stride_be,
    stride_bh,
    # meta-parameters
    HALVES: tl.constexpr,
    W_KN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PERSISTENT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Y[r] = A[r] @ W2[e(r)]^T (+ b2[e(r)]) (HALVES 1), or the dX rows dHpre[r] @ W1[e(r)] (HALVES 2),
    as :func:`sonar_kernels.kernels.expert_mlp_fwd.expert_mlp_grouped_mm_kernel`, operands through TMA.

    Mapping: M -> rows r, N -> H, K -> I (per half).
    Grid: (row tiles * cdiv(H, BLOCK_N),) as the pointer kernel; with PERSISTENT (SM count,), each program
    taking tiles pid, pid + programs, ... below tile_offsets[E] * cdiv(H, BLOCK_N).
    Preconditions: tile_offsets for row tiles of BLOCK_M rows (ops.common.tile_offsets_for); descriptors
    from ops.triton_backend.tma.grouped_mm_descriptors.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    if PERSISTENT:
        for tile in range(pid, tl.load(tile_offsets_ptr + E) * num_pid_n, tl.num_programs(0)):
            _tma_output_tile(
                tile // num_pid_n, tile % num_pid_n, a_desc, w_desc, b2_ptr, expert_offsets_ptr,
                tile_offsets_ptr, y_ptr, E, H, I, stride_ys, stride_yh, stride_be, stride_bh,
                HALVES, W_KN, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, INTERPRET,
            )  # fmt: skip
    elif pid // num_pid_n < tl.load(tile_offsets_ptr + E):  # programs past the last row tile exit
        _tma_output_tile(
            pid // num_pid_n, pid % num_pid_n, a_desc, w_desc, b2_ptr, expert_offsets_ptr, tile_offsets_ptr,
            y_ptr, E, H, I, stride_ys, stride_yh, stride_be, stride_bh,
            HALVES, W_KN, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, INTERPRET,
        )  # fmt: skip


@triton.jit
def _tma_output_tile(
    pid_m, pid_n, a_desc, w_desc, b2_ptr, expert_offsets_ptr, tile_offsets_ptr, y_ptr, E, H, I,
    stride_ys, stride_yh, stride_be, stride_bh,
    HALVES: tl.constexpr, W_KN: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Output tile (pid_m, pid_n) of Y: its GEMM, the bias, the one rounding, the masked store."""
    dtype = y_ptr.dtype.element_ty
    expert, row_start, row_end = expert_tile(pid_m, tile_offsets_ptr, expert_offsets_ptr, E, BLOCK_M)
    acc = _tma_tile(
        tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_desc, w_desc, expert, row_start, pid_n * BLOCK_N, I,
        HALVES, W_KN, BLOCK_M, BLOCK_N, BLOCK_K, dtype, INPUT_PRECISION, INTERPRET,
    )  # fmt: skip  # [BLOCK_M, BLOCK_N]
    rows = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = rows < row_end
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = cols < H
    if HAS_BIAS:  # Y = A W2^T + b2[e], added in fp32 before the one rounding
        b_ptrs = b2_ptr + expert.to(tl.int64) * stride_be + cols * stride_bh
        acc += tl.load(b_ptrs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_ys + cols[None, :] * stride_yh
    tl.store(y_ptrs, round_to(acc, dtype, INTERPRET), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=("E",))  # E only bounds loops and masks: one build for every expert count
def expert_mlp_fwd_up_tma_kernel(
    # pointers and descriptors
    x_ptr,  # [T, H] activation dtype, read (rows gathered by token_of_row)
    w1_desc,  # [E, HALVES, I, H] activation dtype or fp32, block [1, HALVES, BLOCK_N, BLOCK_K], read
    b1_ptr,  # [E, 2, I] dtype of w1, read when HAS_BIAS
    token_of_row_ptr,  # [S] int32, read
    expert_offsets_ptr,  # [E + 1] int32, read
    tile_offsets_ptr,  # [E + 1] int32, read
    hpre_ptr,  # [S, 2I] activation dtype, written for rows < expert_offsets[E]
    a_ptr,  # [S, I] activation dtype, written for rows < expert_offsets[E]
    # sizes
    E,
    H,
    I,
    # strides
    stride_xt,
    stride_xh,
    stride_hs,
    stride_hn,
    stride_as,
    stride_an,
    stride_be,
    stride_bg,
    stride_bn,
    # the clamped SwiGLU's slope and clamp (read only by ACTIVATION "clamped_swiglu")
    alpha: tl.float32,
    limit: tl.float32,
    # meta-parameters
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """:func:`sonar_kernels.kernels.expert_mlp_fwd.expert_mlp_fwd_up_kernel` with W1 read through a TMA
    descriptor: each K step loads the gate rows and the up rows of the tile's columns in one copy
    ([1, HALVES, BLOCK_N, BLOCK_K], zero-filled past I and past H); the gathered X rows stay pointer loads.
    Same dot, same epilogue (``up_epilogue``), so the interpreter gives the pointer kernel's bits.

    Mapping: M -> rows r, N -> I (gate and up columns n, one dot of width HALVES * BLOCK_N), K -> H.
    Grid: (row tiles * cdiv(I, BLOCK_N),).
    Preconditions: W1's unit stride along H (ops.triton_backend.tma.up_descriptor); tile_offsets for row tiles of BLOCK_M
    rows (ops.common.tile_offsets_for).
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    if pid_m >= tl.load(tile_offsets_ptr + E):
        return
    expert, row_start, row_end = expert_tile(pid_m, tile_offsets_ptr, expert_offsets_ptr, E, BLOCK_M)
    dtype = hpre_ptr.dtype.element_ty
    HALVES: tl.constexpr = 2 if GATED else 1

    offs_m = row_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < row_end
    tokens = tl.load(token_of_row_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros((BLOCK_M, HALVES * BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k < H - k0)[None, :], other=0.0)
        # Rows j < BLOCK_N the gate rows n of W1, j >= BLOCK_N the up rows: the pointer kernel's columns.
        w = tl.reshape(w1_desc.load([expert, 0, pid_n * BLOCK_N, k0]), (HALVES * BLOCK_N, BLOCK_K))
        x = round_to(x, dtype, INTERPRET)
        w = round_to(w, dtype, INTERPRET)
        if INTERPRET:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xh
    up_epilogue(
        acc, expert, offs_m, mask_m, pid_n, b1_ptr, hpre_ptr, a_ptr, I, stride_hs, stride_hn, stride_as,
        stride_an, stride_be, stride_bg, stride_bn, alpha, limit, ACTIVATION, GATED, HAS_BIAS, BLOCK_M, BLOCK_N,
        INTERPRET,
    )  # fmt: skip
