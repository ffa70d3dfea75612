"""The host's one-gather lookup (:mod:`torchrec_tpu.inference.stacked_tables`) against TorchRec's own
DLRM forward over the stock ``EmbeddingBagCollection`` of the same checkpoint."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from pipelines.arrow_batch import dense_from_arrow, sparse_from_arrow
from pipelines.schema import CRITEO
from torchrec_tpu.inference.model import load_inference_model
from torchrec_tpu.inference.stacked_tables import StackedTables


def _torchrec(model, rows: pa.Table) -> torch.Tensor:
    with torch.inference_mode():
        logits = model.dlrm(dense_from_arrow(rows, CRITEO), sparse_from_arrow(rows, CRITEO, model.table_sizes))
    return torch.sigmoid(logits.squeeze(-1))


def test_stacked_lookup_equals_torchrec_bit_for_bit(checkpoint, infer_data) -> None:
    model = load_inference_model(checkpoint)
    rows = pq.read_table(sorted(infer_data.glob("*.parquet"))[0]).slice(0, 700)
    assert rows.column("C3").null_count > 0  # missing ids: the zero row, as an empty bag pools 0
    negative = rows.set_column(rows.schema.get_field_index("C5"), "C5", pc.negate(rows.column("C5")))
    assert model.stacked is not None
    for table in (rows, negative):  # negative ids: floor modulo, as the KJT path hashes them
        assert model.stacked.row_numbers(table, CRITEO) is not None
        assert torch.equal(model.predict_rows(table, CRITEO), _torchrec(model, table))
    # the tables are the stock EBC's (views of the stack, no second copy)
    ebc = model.dlrm.sparse_arch.embedding_bag_collection
    assert all(bag.weight.untyped_storage().data_ptr() == model.stacked.weight.untyped_storage().data_ptr()
               for bag in ebc.embedding_bags.values())


def test_a_list_column_takes_the_keyed_jagged_path(checkpoint, infer_data) -> None:
    model = load_inference_model(checkpoint)
    rows = pq.read_table(sorted(infer_data.glob("*.parquet"))[0]).slice(0, 300)
    ids = rows.column("C7").to_numpy(zero_copy_only=False)
    lists = pa.array([None if np.isnan(v) else [int(v), int(v) + 1] for v in ids], type=pa.list_(pa.int64()))
    multi = rows.set_column(rows.schema.get_field_index("C7"), "C7", lists)
    assert model.stacked.row_numbers(multi, CRITEO) is None
    assert torch.equal(model.predict_rows(multi, CRITEO), _torchrec(model, multi))


def test_a_weight_of_other_rows_is_refused() -> None:
    with pytest.raises(ValueError, match=r"stacked tables of \[3, 4\] rows need 8 rows, got 7"):
        StackedTables(torch.zeros(7, 2), [3, 4])
    assert torch.equal(StackedTables.empty([3, 4], 2)[-1], torch.zeros(2))
