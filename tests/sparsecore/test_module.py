"""The nn.Module path on one rank (``ShardedSparseCoreEBC``, every sparsecore backend): pooled
activations feed a dense tower, loss.backward() runs the fused update. Checked against
F.embedding_bag + the same tower with plain autograd and hand SGD."""

import pytest
import torch
import torch.nn.functional as F

from sparsecore.optimizers import SGD
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs
from torchrec_tpu.sharding import ShardedSparseCoreEBC
from torchrec_tpu.sharding.shards import TableSharding

from .helpers import random_kjt
from .reference import reference_forward

LR = 0.5


def _one_rank(tables, features, topology=SparseCoreTopology(), **options):
    """(the EBC on one rank, the plan of its logical tables and features)."""
    sharding = {t.name: TableSharding("table_wise", (0,)) for t in tables}
    return (ShardedSparseCoreEBC(tables, features, sharding, topology=topology, **options),
            plan_stacking(tables, features, topology))


@pytest.mark.parametrize("backend", ["xla", "fbgemm"])
def test_dense_tower_trains_through_the_fused_update(backend):
    tables = [TableSpec("user", 120, 8, "mean", SGD(LR)), TableSpec("item", 80, 4, "sum", SGD(LR))]
    features = [FeatureSpec("u", "user", 16, weighted=True), FeatureSpec("i", "item", 16),
                FeatureSpec("i_hist", "item", 16, weighted=True)]
    ebc, plan = _one_rank(tables, features, SparseCoreTopology("v6e", 2), backend=backend, seed=4)
    tower = torch.nn.Linear(16, 1)
    reference_tower = torch.nn.Linear(16, 1)
    reference_tower.load_state_dict(tower.state_dict())
    weights = {k: v.clone() for k, v in ebc.unsharded_weights().items()}
    for step in range(2):
        kjt = random_kjt(plan, seed=step, max_hot=5, id_range=20)
        labels = torch.randn(16, 1, generator=torch.Generator().manual_seed(step))

        pooled = ebc(kjt)
        assert pooled.keys() == ["u", "i", "i_hist"]
        loss = F.mse_loss(tower(pooled.values()), labels)
        tower.zero_grad()
        loss.backward()

        leaves = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
        inputs = feature_inputs(kjt, plan.features, plan.tables)
        acts = reference_forward(plan, leaves, inputs)
        torch.testing.assert_close(pooled.values(), torch.cat([acts[n] for n in ["u", "i", "i_hist"]], 1).detach(),
                                   atol=1e-6, rtol=1e-5)
        reference_tower.zero_grad()
        F.mse_loss(reference_tower(torch.cat([acts[n] for n in ["u", "i", "i_hist"]], 1)), labels).backward()
        torch.testing.assert_close(tower.weight.grad, reference_tower.weight.grad)
        with torch.no_grad():
            for name in weights:  # SGD on touched rows == dense SGD (untouched rows have zero grad)
                weights[name] -= LR * leaves[name].grad
            for t in (tower, reference_tower):
                t.weight -= 0.1 * t.weight.grad
        for name, w in ebc.unsharded_weights().items():
            torch.testing.assert_close(w, weights[name], atol=1e-6, rtol=1e-5)


def test_last_stats_feed_fdo():
    from sparsecore.limits import FdoRecorder

    tables = [TableSpec("t", 500, 8)]
    ebc, plan = _one_rank(tables, [FeatureSpec("f", "t", 16)], SparseCoreTopology("v5p", 1))
    kjt = random_kjt(plan, seed=1, max_hot=8)
    ebc(kjt)
    recorder = FdoRecorder()
    recorder.record(ebc.local_backend.last_stats)
    assert int(recorder.stats["t"].max_ids_per_partition.max()) > 0
    assert int(recorder.stats["t"].required_buffer_size_per_sc.sum()) >= int(kjt.lengths().sum())


def test_no_grad_forward_does_not_update():
    tables = [TableSpec("t", 50, 8, optimizer=SGD(1.0))]
    ebc, plan = _one_rank(tables, [FeatureSpec("f", "t", 8)])
    before = ebc.unsharded_weights()["t"]
    with torch.no_grad():
        out = ebc(random_kjt(plan, seed=0))
    assert out.values().shape == (8, 8) and not out.values().requires_grad
    assert torch.equal(ebc.unsharded_weights()["t"], before)


def test_module_rejects_mixed_batch_sizes():
    with pytest.raises(ValueError, match="one batch size"):
        _one_rank([TableSpec("t", 50, 8)], [FeatureSpec("f", "t", 8), FeatureSpec("g", "t", 16)])
