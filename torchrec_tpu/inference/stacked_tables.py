"""A one-hot DLRM's fp32 tables in one tensor, looked up straight from Arrow rows in one gather.

The host's other lookups (TorchRec's ``EmbeddingBagCollection``, FBGEMM's TBE) take a
``KeyedJaggedTensor`` (ids key-major), pool feature by feature and hand the towers ``[B, features
* dim]``, which the interaction then concatenates with the dense output. Here every table is a
block of rows of one ``[rows + 1, dim]`` tensor (the last row zeros: a missing id), the ids of a
batch are read from its Arrow columns into ``[B, features + 1]`` row numbers (slot 0 of each sample
left for the dense output) and one ``index_select`` writes ``[B, features + 1, dim]``, which is
the interaction's input once the dense output is copied into slot 0. For single-valued
categorical columns (one id or none per row); a list column takes the ``KeyedJaggedTensor`` path.
The logits equal TorchRec's bit for bit (a bag of one row is that row).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import nn

from pipelines.schema import DatasetSchema


class StackedTables(nn.Module):
    """``weight`` (float32[rows + 1, dim], the tables' rows in feature order, then a zero row) and
    each feature's first row and table size."""

    def __init__(self, weight: torch.Tensor, sizes: Sequence[int]) -> None:
        super().__init__()
        if int(weight.shape[0]) != sum(sizes) + 1:
            raise ValueError(f"stacked tables of {list(sizes)} rows need {sum(sizes) + 1} rows, got {weight.shape[0]}")
        self.register_buffer("weight", weight, persistent=False)
        self.sizes = tuple(int(n) for n in sizes)
        self.first_rows = np.cumsum((0, *self.sizes[:-1]), dtype=np.int64)

    @staticmethod
    def empty(sizes: Sequence[int], dim: int) -> torch.Tensor:
        """The weight for tables of ``sizes`` rows: uninitialised rows, then the zero row."""
        weight = torch.empty(sum(sizes) + 1, dim)
        weight[-1].zero_()
        return weight

    def views(self) -> list[torch.Tensor]:
        """Each feature's table, a view of ``weight``."""
        return [self.weight[int(first) : int(first) + size] for first, size in zip(self.first_rows, self.sizes)]

    def row_numbers(self, data: pa.Table | pa.RecordBatch, schema: DatasetSchema) -> torch.Tensor | None:
        """int64[B, features + 1]: each sample's row of every feature (id modulo its table;
        a missing id: the zero row), slot 0 the zero row; None when a column is a list."""
        zero_row = int(self.weight.shape[0]) - 1
        by_feature = np.empty((len(self.sizes) + 1, data.num_rows), dtype=np.int64)
        by_feature[0] = zero_row
        for j, (name, size, first) in enumerate(zip(schema.sparse, self.sizes, self.first_rows), start=1):
            column = data.column(name)
            if not pa.types.is_integer(column.type):
                return None
            if column.null_count:
                np.mod(pc.fill_null(column, 0).to_numpy(), size, out=by_feature[j], casting="unsafe")
                by_feature[j] += first
                by_feature[j][pc.is_null(column).to_numpy(zero_copy_only=False)] = zero_row
            else:
                np.mod(column.to_numpy(), size, out=by_feature[j], casting="unsafe")
                by_feature[j] += first
        return torch.from_numpy(by_feature).t().contiguous()

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """float32[B, features + 1, dim]: the rows ``rows`` (:meth:`row_numbers`) of the tables."""
        out = torch.empty(*rows.shape, self.weight.shape[1], dtype=self.weight.dtype)
        torch.index_select(self.weight, 0, rows.view(-1), out=out.view(-1, self.weight.shape[1]))
        return out
