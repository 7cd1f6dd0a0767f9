"""Shared types and constants of every layer: the routing metadata and the names of backends,
activations and dtypes. Imports torch only, so that any layer may import it."""

from __future__ import annotations

from typing import NamedTuple

import torch

BACKENDS = ("auto", "triton", "torch")
ACTIVATIONS = ("silu", "gelu")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
# The routing metadata's expert axis is one register tile.
MAX_EXPERTS = 1024
# The order of the AdamW hyperparameters in the float64 tensor the update kernels read.
HYPERPARAMETERS = ("lr", "beta1", "beta2", "eps", "weight_decay")


class RoutingMetadata(NamedTuple):
    """Routing metadata of one MoE layer (DESIGN.md, "Forward", step 1).

    S = T * top_k slots; slot s = t * top_k + j. Slots whose expert id lies outside [0, E) are dropped.
    The kept slots are stably sorted by expert; row r of the sorted order belongs to expert e when
    ``expert_offsets[e] <= r < expert_offsets[e + 1]``.

    The Triton grouped GEMMs cut each expert's rows into blocks of ``block_m`` rows: tile m (an index over
    all experts) belongs to expert e when ``tile_offsets[e] <= m < tile_offsets[e + 1]``.

    Attributes:
        expert_offsets: [E + 1] int32, ``expert_offsets[0] == 0``, ``expert_offsets[E]`` = kept slots.
        tile_offsets: [E + 1] int32, exclusive prefix sum of ``ceil(rows of e / block_m)``.
        row_of_slot: [S] int32, the row of each slot, -1 for a dropped slot.
        token_of_row: [S] int32, the token of each row; rows >= ``expert_offsets[E]`` are unspecified.
        slot_of_row: [S] int32, the slot of each row; rows >= ``expert_offsets[E]`` are unspecified.
    """

    expert_offsets: torch.Tensor
    tile_offsets: torch.Tensor
    row_of_slot: torch.Tensor
    token_of_row: torch.Tensor
    slot_of_row: torch.Tensor
