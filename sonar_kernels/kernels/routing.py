"""Routing metadata on the device: a stable counting sort of the S = T * top_k slots by expert."""

import triton
import triton.language as tl


@triton.jit
def _slot_block(
    top_k_index_ptr,
    s0,
    S,
    E,
    top_k,
    stride_index_t,
    stride_index_j,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Slots [s0, s0 + BLOCK_S): their indices, whether kept, and their int32 one-hot expert rows."""
    offs_s = s0 + tl.arange(0, BLOCK_S)
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


@triton.jit
def _routing_metadata_kernel(
    # pointers
    top_k_index_ptr,  # [T, top_k] int32/int64, read
    expert_offsets_ptr,  # [E + 1] int32, written
    tile_offsets_ptr,  # [E + 1] int32, written
    row_of_slot_ptr,  # [S] int32, written (every slot)
    token_of_row_ptr,  # [S] int32, written for rows < expert_offsets[E]
    slot_of_row_ptr,  # [S] int32, written for rows < expert_offsets[E]
    # sizes
    S,
    E,
    top_k,
    # strides
    stride_index_t,
    stride_index_j,
    # meta-parameters
    TILE_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Stable counting sort by expert id; ids outside [0, E) are dropped (row_of_slot = -1).

    row_of_slot[s] = expert_offsets[e] + #{s' < s : id[s'] == e} for id[s] == e; token_of_row and
    slot_of_row invert it. tile_offsets = exclusive prefix sum of ceil(rows of e / TILE_M).

    Grid: (1,). One program makes two passes over the slots, BLOCK_S at a time: a histogram, then ranks
    from a running per-expert count. Deterministic, no atomics.
    Preconditions: E <= BLOCK_E; S < 2**31.
    """
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E

    # Pass 1: rows per expert.
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for s0 in range(0, S, BLOCK_S):
        offs_s, kept, onehot = _slot_block(
            top_k_index_ptr, s0, S, E, top_k, stride_index_t, stride_index_j, BLOCK_S, BLOCK_E
        )
        counts += tl.sum(onehot, axis=0)

    ends = tl.cumsum(counts, axis=0)
    starts = ends - counts
    tiles_end = tl.cumsum((counts + TILE_M - 1) // TILE_M, axis=0)
    tl.store(expert_offsets_ptr + offs_e, starts, mask=mask_e)
    tl.store(expert_offsets_ptr + 1 + offs_e, ends, mask=mask_e)
    tl.store(tile_offsets_ptr + offs_e, tiles_end - (counts + TILE_M - 1) // TILE_M, mask=mask_e)
    tl.store(tile_offsets_ptr + 1 + offs_e, tiles_end, mask=mask_e)

    # Pass 2: each kept slot's row is its expert's start plus the kept slots of that expert before it.
    next_row = starts  # [BLOCK_E]
    for s0 in range(0, S, BLOCK_S):
        offs_s, kept, onehot = _slot_block(
            top_k_index_ptr, s0, S, E, top_k, stride_index_t, stride_index_j, BLOCK_S, BLOCK_E
        )
        rank = tl.cumsum(onehot, axis=0) - onehot  # [BLOCK_S, BLOCK_E], exclusive rank in the block
        row = tl.sum(onehot * (rank + next_row[None, :]), axis=1)  # [BLOCK_S]
        next_row += tl.sum(onehot, axis=0)
        tl.store(row_of_slot_ptr + offs_s, tl.where(kept, row, -1), mask=offs_s < S)
        tl.store(token_of_row_ptr + row, offs_s // top_k, mask=kept)
        tl.store(slot_of_row_ptr + row, offs_s, mask=kept)
