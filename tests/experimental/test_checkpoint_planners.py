"""torchrec_tpu.experimental.checkpoint: a fused module's DCP checkpoint (one rank) loads into a
fresh module, into one at another SparseCore count (re-MOD-sharded) and, unsharded, into a plain
CPU TorchRec EmbeddingBagCollection."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from sparsecore.stacking import unstack_rows
from torchrec_tpu.experimental import SparseCoreEmbeddingConfig, SparseCoreFusedEmbeddingBagCollection
from torchrec_tpu.experimental.checkpoint import SparseCoreLoadPlanner, SparseCoreSavePlanner

BATCH = 8


def _configs() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="ta", num_embeddings=100, embedding_dim=8, feature_names=["fa"]),
            EmbeddingBagConfig(name="tb", num_embeddings=40, embedding_dim=8, feature_names=["fb"],
                               pooling=PoolingType.MEAN)]


def _fused(num_sc: int) -> SparseCoreFusedEmbeddingBagCollection:
    return SparseCoreFusedEmbeddingBagCollection([SparseCoreEmbeddingConfig(c) for c in _configs()],
                                                 torch.optim.Adagrad, {"lr": 0.1}, batch_size=BATCH,
                                                 num_sc_per_device=num_sc)


def _logical_accumulators(module: SparseCoreFusedEmbeddingBagCollection, num_sc: int) -> dict[str, torch.Tensor]:
    from torchrec_tpu.experimental import SparseCoreInputPreprocessor

    plan = SparseCoreInputPreprocessor([SparseCoreEmbeddingConfig(c) for c in _configs()], BATCH,
                                       num_sc_per_device=num_sc).plan
    return {name: unstack_rows(plan.stack(name), acc.detach().cpu())[name] for name, acc in module.accumulators.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint of a module at 2 SparseCores with random tables and accumulators."""
    module = _fused(2)
    g = torch.Generator().manual_seed(0)
    tables = {c.name: torch.randn(c.num_embeddings, c.embedding_dim, generator=g) for c in _configs()}
    module.set_unstacked_table_weights(tables)
    with torch.no_grad():
        for acc in module.accumulators.values():
            acc.copy_(torch.rand(acc.shape, generator=g).to(acc.device))
    path = str(tmp_path_factory.mktemp("dcp"))
    dcp.save(module.state_dict(), checkpoint_id=path, planner=SparseCoreSavePlanner(num_sc_per_device=2))
    return path, tables, _logical_accumulators(module, 2)


@pytest.mark.parametrize("num_sc", [2, 4])
def test_loads_into_a_fresh_module_at_the_same_or_another_sparsecore_count(saved, num_sc: int) -> None:
    """At 4 SparseCores the tables and accumulators are re-MOD-sharded (and re-padded)."""
    path, tables, accumulators = saved
    module = _fused(num_sc)
    planner = SparseCoreLoadPlanner(num_sc_per_device=num_sc)
    dcp.load(module.state_dict(), checkpoint_id=path, planner=planner)
    assert planner.cross_topology == (num_sc != 2)
    for name, value in module.get_unstacked_table_weights().items():
        torch.testing.assert_close(value, tables[name], rtol=0, atol=0)
    for name, value in _logical_accumulators(module, num_sc).items():
        torch.testing.assert_close(value, accumulators[name], rtol=0, atol=0)


def test_unshards_into_a_cpu_torchrec_ebc(saved) -> None:
    path, tables, _ = saved
    ebc = EmbeddingBagCollection(tables=_configs(), device=torch.device("cpu"))
    dcp.load(ebc.state_dict(), checkpoint_id=path,
             planner=SparseCoreLoadPlanner(num_sc_per_device=2, unshard_for_cpu=True))
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(bag.weight.detach(), tables[name], rtol=0, atol=0)


def test_unshard_for_cpu_needs_the_saved_topology(tmp_path) -> None:
    ebc = EmbeddingBagCollection(tables=_configs(), device=torch.device("cpu"))
    dcp.save(ebc.state_dict(), checkpoint_id=str(tmp_path))
    with pytest.raises(CheckpointException, match="saved with SparseCoreSavePlanner"):
        dcp.load(ebc.state_dict(), checkpoint_id=str(tmp_path),
                 planner=SparseCoreLoadPlanner(unshard_for_cpu=True))
