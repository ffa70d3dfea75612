"""TorchRec 1.9.2's ``SparseCoreTrainPipeline`` + ``PrefetchDataLoader`` on 1 and 2 tpu_dist ranks
equal the pipeline's schedule computed with stock TorchRec on CPU (tests/torchrec_192/
pipeline_checks.py); the ranks' DCP checkpoint (``SparseCoreSavePlanner``) loads, with
``SparseCoreLoadPlanner``, into a stock CPU ``EmbeddingBagCollection`` (unsharded) and into a
one-device fused module (re-sharded)."""

from __future__ import annotations

# isort: off
import torch_tpu  # TorchTPU's environment (torch.tpu.ops, the preprocessing backend) before TorchRec's TPU module
# isort: on

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchrec.datasets.utils import Batch
from torchrec.experimental.torch_tpu import (
    SparseCoreBatch,
    SparseCoreDataLoader,
    SparseCoreFusedEmbeddingBagCollection,
    SparseCoreInputPreprocessor,
    SparseCoreLoadPlanner,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from tests.torchrec_192.pipeline_checks import (
    BATCH,
    LR,
    batches,
    pipeline_training,
    rank_body,
    reference_training,
)
from tests.torchrec_192.reference import bag_configs, kjt, logical_tables, sc_tables
from torch_tpu.distributed.local_launch import launch_local


def _check_against_reference(world: int, losses: list[float], tables: dict, dense: dict) -> None:
    ref_losses, ref_tables, ref_dense = reference_training(world)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, value in ref_tables.items():
        torch.testing.assert_close(tables[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for name, value in ref_dense.items():
        torch.testing.assert_close(dense[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _check_checkpoint(checkpoint_dir: str, tables: dict) -> None:
    cpu = EmbeddingBagCollection(tables=bag_configs(), device=torch.device("cpu"))
    dcp.load(cpu.state_dict(), checkpoint_id=checkpoint_dir,
             planner=SparseCoreLoadPlanner(num_sc_per_device=2, unshard_for_cpu=True))
    for name, bag in cpu.embedding_bags.items():
        torch.testing.assert_close(bag.weight.detach(), tables[name], rtol=0, atol=0, msg=name)
    one = SparseCoreFusedEmbeddingBagCollection(tables=sc_tables(bag_configs(), {"ta": "s", "tc": "s"}),
                                                optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": LR},
                                                batch_size=BATCH)
    # the target's own stacking (its shard rotations and padding depend on its SparseCore count)
    dcp.load(one.state_dict(), checkpoint_id=checkpoint_dir,
             planner=SparseCoreLoadPlanner(num_sc_per_device=2, stacked_configs=one.stacked_configs))
    for name, value in logical_tables(one).items():
        torch.testing.assert_close(value, tables[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_pipeline_with_prefetch_loader_on_one_rank_equals_its_schedule_on_cpu_and_checkpoints(tmp_path) -> None:
    torch_tpu.reset_metrics()
    losses, tables, dense = pipeline_training(0, 1, str(tmp_path))
    assert torch_tpu.fallback_counts() == {}, torch_tpu.fallback_counts()
    _check_against_reference(1, losses, tables, dense)
    _check_checkpoint(str(tmp_path), tables)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pipeline_on_two_tpu_dist_ranks_equals_its_schedule_on_cpu_and_checkpoints(tmp_path) -> None:
    results = launch_local(rank_body, 2, str(tmp_path), timeout_s=600)
    assert [status for status, _ in results] == ["ok", "ok"], "\n".join(status for status, _ in results)
    (losses, tables, dense), (losses1, tables1, _) = (r for _, r in results)
    assert losses == losses1
    for name in tables:
        torch.testing.assert_close(tables[name], tables1[name], rtol=0, atol=0)
    _check_against_reference(2, losses, tables, dense)
    _check_checkpoint(str(tmp_path), tables)


def test_sparsecore_data_loader_and_batch_preprocess_each_batch() -> None:
    """``SparseCoreDataLoader`` yields ``SparseCoreBatch.from_batch`` of each batch: the
    preprocessor's buffers, the dense features and labels untouched; ``.to`` moves them all."""
    tables = sc_tables(bag_configs())
    preprocessor = SparseCoreInputPreprocessor(tables=tables, batch_size=BATCH)
    raw = [Batch(dense_features=x[:BATCH], sparse_features=kjt(ids, 0, BATCH), labels=y[:BATCH])
           for x, y, ids in batches(1)[:2]]
    loader = SparseCoreDataLoader(raw, preprocessor)
    assert len(loader) == 2
    for batch, source in zip(loader, raw):
        assert isinstance(batch, SparseCoreBatch)
        expected = preprocessor(source.sparse_features)
        for name, t in batch.sparse_features.table_tensors.items():
            for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
                torch.testing.assert_close(getattr(t, field), getattr(expected.table_tensors[name], field),
                                           equal_nan=True)
        moved = batch.to(torch.device("tpu"))
        assert moved.dense_features.device.type == "tpu" and moved.labels.device.type == "tpu"
        assert all(t.gains.device.type == "tpu" for t in moved.sparse_features.table_tensors.values())
        torch.testing.assert_close(moved.dense_features.cpu(), source.dense_features)
