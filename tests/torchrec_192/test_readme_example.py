"""TorchRec TPU's README migration (examples/torchrec_tpu_api/dlrm_migration.py), TorchRec 1.9.2's
own module on the tpu device: the "after" DLRM
(fused SparseCore EBC with SGD on tpu, preprocessor, SparseCoreBatch, dense-only SGD) equals the
"before" stock TorchRec DLRM on CPU with one SGD over every parameter, over three steps, eagerly
and with the "after" model under torch.compile(backend="tpu", fullgraph=True)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.torchrec_192.reference import logical_tables

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrec_tpu_api" / "dlrm_migration.py"


def _example():
    spec = importlib.util.spec_from_file_location("dlrm_migration", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_readme_migration_after_equals_before_over_three_steps(compiled: bool) -> None:
    example = _example()
    batches = example.random_batches(3)
    stock, stock_losses, initial = example.before(batches)
    migrated, tpu_losses = example.after(batches, initial, compiled=compiled)
    assert tpu_losses == pytest.approx(stock_losses, rel=1e-5)
    ebc = migrated.model.sparse_arch.embedding_bag_collection
    table = stock.model.sparse_arch.embedding_bag_collection.embedding_bags["t_user"].weight
    torch.testing.assert_close(logical_tables(ebc)["t_user"], table.detach(), rtol=1e-5, atol=1e-6)
    dense = {k: v for k, v in migrated.state_dict().items() if "embedding_bag_collection" not in k}
    stock_dense = {k: v for k, v in stock.state_dict().items() if "embedding_bag_collection" not in k}
    assert dense.keys() == stock_dense.keys()
    for name, value in dense.items():
        torch.testing.assert_close(value.cpu(), stock_dense[name], rtol=1e-4, atol=1e-6, msg=name)
