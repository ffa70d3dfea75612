"""Large sum all_reduces of ranks on one host go through shared memory (torch_tpu.distributed.
shm_reduce), giving plain gloo's bits on two ranks and the rank-order sum on three."""

from __future__ import annotations

import pytest
import torch

from tests.torch_tpu.distributed.shm_checks import SIZES, rank_data, reduce_both_ways
from torch_tpu.distributed.local_launch import launch_local

pytestmark = pytest.mark.multiprocess

CALLS = len(SIZES) + 2
ON_GLOO = [i for i, n in enumerate(SIZES) if n * 4 < 1 << 20]  # under shm_reduce.MIN_BYTES


def test_two_ranks_get_gloos_bits_through_shared_memory() -> None:
    ranks = launch_local(reduce_both_ways, 2, timeout_s=300)
    for rank, got in enumerate(ranks):
        assert len(got["results"]) == CALLS
        for call, (ours, ref) in enumerate(got["results"]):
            assert torch.equal(ours, ref), f"rank {rank}, call {call}"
        assert got["taken"] == [True] * (CALLS - len(ON_GLOO)), got["taken"]  # every large one, none refused
        assert not got["files_left"], got["files_left"]  # the segments' names go once every rank mapped them


def test_a_tensor_over_the_piece_size_goes_in_pieces() -> None:
    """Segments never grow past the piece size (1.5 MiB here): the 4 and 12 MiB tensors go in
    pieces and still get gloo's bits."""
    ranks = launch_local(reduce_both_ways, 2, None, 3 << 19, timeout_s=300)
    for rank, got in enumerate(ranks):
        for call, (ours, ref) in enumerate(got["results"]):
            assert torch.equal(ours, ref), f"rank {rank}, call {call}"
        assert got["taken"] == [True] * (CALLS - len(ON_GLOO)), got["taken"]
        assert got["capacity"] == 3 << 19


@pytest.mark.slow
def test_three_ranks_sum_in_rank_order() -> None:
    ranks = launch_local(reduce_both_ways, 3, timeout_s=300)
    for rank, got in enumerate(ranks):
        for call, (ours, ref) in enumerate(got["results"][:len(SIZES)]):
            parts = [rank_data(r, ours.numel(), torch.float32, call) for r in range(3)]
            want = parts[0] + parts[1] + parts[2]
            if call in ON_GLOO:
                torch.testing.assert_close(ours, want)  # gloo's own order
            else:
                assert torch.equal(ours, want), f"rank {rank}, call {call}"
            torch.testing.assert_close(ours, ref)


def test_a_rank_without_room_sends_every_rank_back_to_gloo() -> None:
    ranks = launch_local(reduce_both_ways, 2, 1, timeout_s=300)
    for rank, got in enumerate(ranks):
        for call, (ours, ref) in enumerate(got["results"]):
            assert torch.equal(ours, ref), f"rank {rank}, call {call}"
        assert got["taken"] == [False], got["taken"]  # refused once, on both ranks; gloo from then on
        assert not got["files_left"], got["files_left"]
