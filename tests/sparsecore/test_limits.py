import numpy as np
import pytest

from sparsecore.limits import FdoRecorder, PartitionOverflowError
from sparsecore.preprocess import preprocess
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking

from .helpers import random_kjt


def _plan(max_ids, max_unique=None):
    table = TableSpec("t", 4096, 8, max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_unique or max_ids)
    return plan_stacking([table], [FeatureSpec("f", "t", 64)], SparseCoreTopology("v6e", 1))


def test_error_policy_names_table_partition_and_counts():
    kjt = random_kjt(_plan(8), seed=0, max_hot=40)
    with pytest.raises(PartitionOverflowError,
                       match="'t': partition \\(source SC \\d, destination SC \\d\\) got \\d+ ids > "
                             "max_ids_per_partition 8"):
        preprocess(kjt, _plan(8))


def test_unique_limit_is_separate():
    kjt = random_kjt(_plan(256), seed=0, max_hot=40)
    with pytest.raises(PartitionOverflowError, match="unique ids > max_unique_ids_per_partition 8"):
        preprocess(kjt, _plan(1024, max_unique=8))


def test_drop_policy_counts_every_dropped_id_and_keeps_stats_pre_drop():
    kjt = random_kjt(_plan(8), seed=0, max_hot=40)
    full = preprocess(kjt, _plan(1024)).stacks["t"]
    dropped = preprocess(kjt, _plan(8), overflow="drop").stacks["t"]
    kept = int((dropped.embedding_ids != 2**31 - 1).sum())
    assert kept == int(np.minimum(_partition_sizes(full), 8).sum())
    assert dropped.stats.dropped_ids == int(kjt.lengths().sum()) - kept  # no duplicates at this vocab
    np.testing.assert_array_equal(dropped.stats.max_ids_per_partition, full.stats.max_ids_per_partition)


def _partition_sizes(csr):
    pointers = csr.row_pointers.reshape(2, 8)[:, :2]  # v6e: 2 SCs, row pointers padded to 8
    starts = np.concatenate([np.zeros((2, 1), dtype=np.int64), -(-pointers[:, :-1] // 8) * 8], axis=1)
    return pointers - starts


def test_fdo_records_merges_like_an_allreduce_and_proposes_with_headroom():
    plan = _plan(1024)
    ranks = []
    for rank in range(2):
        recorder = FdoRecorder()
        for step in range(3):
            recorder.record(preprocess(random_kjt(plan, seed=10 * rank + step, max_hot=20), plan).stats)
        ranks.append(recorder)
    merged = FdoRecorder.merge_states([r.state() for r in ranks])
    expected_max = max(int(r.stats["t"].max_ids_per_partition.max()) for r in ranks)
    assert int(merged["t/max_ids"].max()) == expected_max
    recorder = FdoRecorder()
    recorder.load(merged)
    proposal = recorder.propose(headroom=1.5)["t"]
    assert proposal.max_ids_per_partition == -(-int(np.ceil(expected_max * 1.5)) // 8) * 8
    assert proposal.max_unique_ids_per_partition <= proposal.max_ids_per_partition
    # the proposed limits are enough: the same batches preprocess without overflow
    tuned = plan.with_limits(recorder.propose(headroom=1.5))
    assert tuned.stacks[0].max_ids_per_partition == proposal.max_ids_per_partition
    for seed in (0, 1, 2, 10, 11, 12):
        preprocess(random_kjt(tuned, seed=seed, max_hot=20), tuned)
    with pytest.raises(KeyError, match="unknown stacks \\['u'\\]"):
        plan.with_limits({"u": proposal})
    with pytest.raises(ValueError, match="headroom"):
        recorder.propose(0.5)
