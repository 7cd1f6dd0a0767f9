"""The Triton routing-metadata kernel against reference.routing_metadata (exact)."""

import pytest
import torch
from cases import CASES
from conftest import UNWRITTEN_INT

from sonar_kernels import ops, reference
from sonar_kernels.kernels.expert_mlp_fwd import TILE_M


def check_against_reference(index, E):
    meta = ops.routing_metadata(index, E)
    ref = reference.routing_metadata(index, E, block_m=TILE_M)
    n = int(ref.expert_offsets[-1])
    assert torch.equal(meta.expert_offsets, ref.expert_offsets)
    assert torch.equal(meta.tile_offsets, ref.tile_offsets)
    assert torch.equal(meta.row_of_slot, ref.row_of_slot)
    assert torch.equal(meta.token_of_row[:n], ref.token_of_row[:n])
    assert torch.equal(meta.slot_of_row[:n], ref.slot_of_row[:n])
    # The tail (rows of dropped slots) is never written.
    assert (meta.token_of_row[n:] == UNWRITTEN_INT).all()
    assert (meta.slot_of_row[n:] == UNWRITTEN_INT).all()
    return meta


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("case", CASES)
def test_routing_matches_reference(case, index_dtype, device):
    _, index, *_ = case.make(torch.float32, index_dtype=index_dtype, device=device)
    check_against_reference(index, case.E)


@pytest.mark.parametrize("E", [1, 16, 17, 300, 1024])
def test_routing_expert_counts_across_block_sizes(E, device):
    # BLOCK_E (and with it BLOCK_S) changes with E; T * top_k spans several BLOCK_S blocks.
    index = torch.randint(-2, E + 2, (600, 2), device=device)
    check_against_reference(index, E)


def test_routing_non_contiguous_index_and_wide_sentinels(device):
    index = torch.randint(0, 6, (4, 50), device=device).T  # [50, 4], column-major
    index[::7, 1] = 2**33 + 3  # an int64 id whose low 32 bits are the valid id 3: still dropped
    index[::5, 2] = -(2**40)
    assert not index.is_contiguous()
    meta = check_against_reference(index, 6)
    assert (meta.row_of_slot.view(50, 4)[::7, 1] == -1).all()


@pytest.mark.parametrize("T", [0, 1])
def test_routing_of_no_tokens_or_one(T, device):
    # No slots: one block of the histogram and scatter, all counts zero.
    check_against_reference(torch.randint(0, 4, (T, 2), device=device), 4)
