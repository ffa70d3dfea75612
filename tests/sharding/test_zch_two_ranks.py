"""Managed collisions at two ranks (loopback processes) against stock TorchRec's sharded
``ManagedCollisionEmbeddingBagCollection`` (DMP, its own sharder, row-wise): each rank's remaps
slot for slot after every step (evictions included), its outputs and its table shards within 1e-5;
and a resume at two ranks is bit-identical to the run that never stopped."""

import pytest
import torch

from torch_tpu.distributed import launch_local

from .zch_rank_checks import STEPS, our_rank, stock_rank


@pytest.fixture(scope="module")
def straight():
    return launch_local(our_rank, 2, timeout_s=300)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_remap_and_train_like_torchrecs_sharded_mc_ebc(straight):
    expected = launch_local(stock_rank, 2, timeout_s=300)
    evictions = 0
    for rank in range(2):
        (want_steps, want_tables), (got_steps, got_tables, _) = expected[rank], straight[rank]
        for step in range(STEPS):
            (want_out, want_remaps), (got_out, got_remaps) = want_steps[step], got_steps[step]
            for table, (ids, slots) in want_remaps.items():
                order = torch.argsort(ids, stable=True)
                assert torch.equal(got_remaps[table][0], ids[order]), (rank, step, table)
                assert torch.equal(got_remaps[table][1], slots[order]), (rank, step, table)
                if step:
                    evictions += int((want_steps[step - 1][1][table][0] != ids).sum())
            torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
        for table, weight in want_tables.items():
            torch.testing.assert_close(got_tables[table], weight, atol=1e-5, rtol=1e-5)
    assert evictions > 20  # the drift evicted ids on both ranks' remaps


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_resume_the_remap_bit_identically(straight):
    resumed = launch_local(our_rank, 2, 3, timeout_s=300)
    for rank in range(2):
        (steps, tables, state), (want_steps, want_tables, want_state) = resumed[rank], straight[rank]
        for (out, _), (want, _) in zip(steps, want_steps):
            assert torch.equal(out, want)
        for table, weight in want_tables.items():
            assert torch.equal(tables[table], weight), (rank, table)
        assert state == want_state
