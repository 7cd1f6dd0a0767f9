"""Routing metadata on the device: a stable counting sort of the S = T * top_k slots by expert.

Three launches, none of them serial over the slots: a per-block histogram (one program per BLOCK_S
slots), a scan over the blocks (one program; it walks S / BLOCK_S blocks, not S slots), and a scatter
(one program per block). The order is the stable one by (expert, slot); no atomics, so it is
deterministic.
"""

import triton
import triton.language as tl


@triton.jit
def _slot_block(
    top_k_index_ptr,
    block,
    S,
    E,
    top_k,
    stride_index_t,
    stride_index_j,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Slots [block * BLOCK_S, (block + 1) * BLOCK_S): indices, whether kept, int32 one-hot expert rows."""
    offs_s = block * BLOCK_S + tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    ids = tl.load(
        top_k_index_ptr + (offs_s // top_k) * stride_index_t + (offs_s % top_k) * stride_index_j,
        mask=mask_s,
        other=-1,
    )
    # Compare in the index dtype before narrowing: a large int64 id must not wrap into [0, E).
    kept = mask_s & (ids >= 0) & (ids < E)
    onehot = (ids.to(tl.int32)[:, None] == tl.arange(0, BLOCK_E)[None, :]) & kept[:, None]
    return offs_s, kept, onehot.to(tl.int32)  # [BLOCK_S], [BLOCK_S], [BLOCK_S, BLOCK_E]


@triton.jit(do_not_specialize=("E",))  # E only bounds loops and masks: one build for every expert count
def routing_histogram_kernel(
    top_k_index_ptr,  # [T, top_k] int32/int64, read
    block_rows_ptr,  # [num_blocks, E] int32, written: kept slots of each expert in each block
    S,
    E,
    top_k,
    stride_index_t,
    stride_index_j,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Grid: (cdiv(S, BLOCK_S),). Program b counts the kept slots of block b per expert."""
    block = tl.program_id(0)
    _, _, onehot = _slot_block(
        top_k_index_ptr, block, S, E, top_k, stride_index_t, stride_index_j, BLOCK_S, BLOCK_E
    )
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(block_rows_ptr + block * E + offs_e, tl.sum(onehot, axis=0), mask=offs_e < E)


@triton.jit(do_not_specialize=("E",))  # E only bounds loops and masks: one build for every expert count
def routing_scan_kernel(
    block_rows_ptr,  # [num_blocks, E] int32, read, then overwritten with each block's first row per expert
    expert_offsets_ptr,  # [E + 1] int32, written
    tile_offsets_ptr,  # [E + 1] int32, written
    num_blocks,
    E,
    TILE_M: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Grid: (1,). Exclusive prefix sums: over the blocks per expert, then over the experts.

    Pass 1 turns block_rows[b, e] into the rows of expert e in blocks before b; the expert totals then
    give expert_offsets and tile_offsets (ceil(rows / TILE_M) tiles per expert); pass 2 adds each
    expert's first row, so block_rows[b, e] becomes the row of block b's first slot of expert e.
    """
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for b0 in range(0, num_blocks, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        ptrs = block_rows_ptr + offs_b[:, None] * E + offs_e[None, :]
        mask = (offs_b[:, None] < num_blocks) & mask_e[None, :]
        rows = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(rows, axis=0) - rows + counts[None, :], mask=mask)
        counts += tl.sum(rows, axis=0)

    ends = tl.cumsum(counts, axis=0)
    starts = ends - counts
    tiles = (counts + TILE_M - 1) // TILE_M
    tiles_end = tl.cumsum(tiles, axis=0)
    tl.store(expert_offsets_ptr + offs_e, starts, mask=mask_e)
    tl.store(expert_offsets_ptr + 1 + offs_e, ends, mask=mask_e)
    tl.store(tile_offsets_ptr + offs_e, tiles_end - tiles, mask=mask_e)
    tl.store(tile_offsets_ptr + 1 + offs_e, tiles_end, mask=mask_e)

    for b0 in range(0, num_blocks, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        ptrs = block_rows_ptr + offs_b[:, None] * E + offs_e[None, :]
        mask = (offs_b[:, None] < num_blocks) & mask_e[None, :]
        tl.store(ptrs, tl.load(ptrs, mask=mask, other=0) + starts[None, :], mask=mask)


@triton.jit(do_not_specialize=("E",))  # E only bounds loops and masks: one build for every expert count
def routing_scatter_kernel(
    top_k_index_ptr,  # [T, top_k] int32/int64, read
    block_rows_ptr,  # [num_blocks, E] int32, read: the row of each block's first slot per expert
    row_of_slot_ptr,  # [S] int32, written (every slot)
    token_of_row_ptr,  # [S] int32, written for rows < expert_offsets[E]
    slot_of_row_ptr,  # [S] int32, written for rows < expert_offsets[E]
    S,
    E,
    top_k,
    stride_index_t,
    stride_index_j,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Grid: (cdiv(S, BLOCK_S),). A kept slot's row: its block's first row of its expert plus the
    slots of that expert before it in the block. Dropped slots get row_of_slot = -1."""
    block = tl.program_id(0)
    offs_s, kept, onehot = _slot_block(
        top_k_index_ptr, block, S, E, top_k, stride_index_t, stride_index_j, BLOCK_S, BLOCK_E
    )
    offs_e = tl.arange(0, BLOCK_E)
    first = tl.load(block_rows_ptr + block * E + offs_e, mask=offs_e < E, other=0)  # [BLOCK_E]
    rank = tl.cumsum(onehot, axis=0) - onehot  # [BLOCK_S, BLOCK_E], exclusive rank in the block
    row = tl.sum(onehot * (rank + first[None, :]), axis=1)  # [BLOCK_S]
    tl.store(row_of_slot_ptr + offs_s, tl.where(kept, row, -1), mask=offs_s < S)
    tl.store(token_of_row_ptr + row, offs_s // top_k, mask=kept)
    tl.store(slot_of_row_ptr + row, offs_s, mask=kept)
