"""Two ranks over tpu_dist (loopback processes): every sharding type trains exactly like stock
TorchRec on the global batch (and so like the 1-rank run, tested in test_single_rank)."""

import pytest
import torch

from torch_tpu.distributed import launch_local

from .rank_checks import LAYOUTS, column_blocks, train_sharded
from .reference import train_reference

LOCAL_BATCH, STEPS = 8, 3


@pytest.fixture(scope="module", params=["xla", pytest.param("ops", marks=pytest.mark.slow)])
def two_rank_results(request):
    """Every layout trained on two ranks, each rank's shards on the local backend ``request.param``
    (``ops``: the tpu:: SparseCore ops on each rank's tpu device)."""
    # (ops: no row-wise Adagrad on column blocks narrower than the padded dim: the op averages over it)
    layouts = [name for name in LAYOUTS if not (request.param == "ops" and name == "column_wise_rowwise")]
    return launch_local(train_sharded, 2, layouts, STEPS, LOCAL_BATCH, request.param, timeout_s=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_equal_stock_torchrec(two_rank_results, layout):
    optimizer, _ = LAYOUTS[layout]
    if layout not in two_rank_results[0]:
        pytest.skip(f"{layout} is not run on this backend")
    expected_outputs, expected_weights = train_reference(optimizer, STEPS, 2 * LOCAL_BATCH, column_blocks(layout))
    for rank, results in enumerate(two_rank_results):
        outputs, weights, _ = results[layout]
        for step, out in enumerate(outputs):
            torch.testing.assert_close(out, expected_outputs[step][rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH],
                                       atol=1e-5, rtol=1e-5)
        for name, weight in weights.items():
            torch.testing.assert_close(weight, expected_weights[name], atol=1e-5, rtol=1e-5)
    # every rank reassembles the same tables and slots
    for name in two_rank_results[0][layout][1]:
        assert torch.equal(two_rank_results[0][layout][1][name], two_rank_results[1][layout][1][name])
    slots0, slots1 = two_rank_results[0][layout][2], two_rank_results[1][layout][2]
    assert slots0.keys() == slots1.keys()
    for table in slots0:
        for slot in slots0[table]:
            assert torch.equal(slots0[table][slot], slots1[table][slot])


@pytest.fixture(scope="module")
def input_dist_results() -> list[dict]:
    """Each rank's input dist exchanges and prefetched passes, from one 2-rank job."""
    from .rank_checks import input_dists

    return launch_local(input_dists, 2, LOCAL_BATCH, timeout_s=300)


@pytest.mark.multiprocess
def test_input_dist_skips_the_gains_exchange_when_every_gain_is_one(input_dist_results):
    """Sum-pooled tables without weights: every rank's gains are 1, so the input dist exchanges
    lengths and ids only (2 all_to_alls, not 3) and still pools like stock TorchRec; with a mean
    table the gains go too."""
    from .reference import random_kjt, reference_ebc

    results = [by_rank["exchanges"] for by_rank in input_dist_results]
    kjt = random_kjt(2 * LOCAL_BATCH, 0)
    for pooling, exchanges in (("sum", 2), ("mixed", 3)):
        expected = reference_ebc(sum_pooled=pooling == "sum")(kjt).values().detach()
        for rank, by_pooling in enumerate(results):
            got_exchanges, out = by_pooling[pooling]
            assert got_exchanges == exchanges, f"{pooling}, rank {rank}: {got_exchanges} all_to_alls"
            torch.testing.assert_close(out, expected[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH], atol=1e-5, rtol=1e-5)


@pytest.mark.multiprocess
def test_prefetching_ranks_agree_on_each_batch_inside_its_input_dist(input_dist_results):
    """The prefetch thread's ranks agree on every batch without collectives of their own: each
    batch takes its 2 all_to_alls (lengths with every rank's word riding along, then ids) and one
    more lengths exchange ends the pass. A rank one batch short ends the pass on both; an id over
    its table on rank 1 fails both ranks with rank 1's message after the batch before it. The
    batches taken pool like stock TorchRec."""
    from .reference import random_kjt, reference_ebc

    results = [by_rank["passes"] for by_rank in input_dist_results]
    tables = reference_ebc(sum_pooled=True)
    expected = [tables(random_kjt(2 * LOCAL_BATCH, step)).values().detach() for step in range(3)]
    for name, taken in (("even", 3), ("short", 2), ("bad", 1)):
        for rank, by_pass in enumerate(results):
            calls, outputs, error = by_pass[name]
            assert calls == {"all_to_all_single": 2 * taken + 1, "all_reduce": 0}, (name, rank, calls)
            assert len(outputs) == taken, (name, rank)
            for out, want in zip(outputs, expected):
                torch.testing.assert_close(out, want[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH], atol=1e-5, rtol=1e-5)
            if name == "bad":
                assert error is not None and error.startswith("RankFailure: rank 1: "), error
                assert "feature '" in error and "1000" in error, error
            else:
                assert error is None, error
        if name == "bad":
            assert results[0][name][2] == results[1][name][2]
