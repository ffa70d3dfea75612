"""Column gathers of ``[rows, width]`` host tensors, copied as whole blocks.

``index_select`` along dim 1 copies element by element: 0.9 ms for ``[1024, 1664]`` float32 on one
core. A sharded EBC's columns come in runs (a feature's embedding dim, or a column shard of it):
with every run starting and ending on a multiple of ``w``, the tensor viewed as
``[rows, width / w, w]`` gives up whole blocks of ``w`` contiguous values, 0.22 ms there (a plain
copy's cost). ``w`` is the largest such block, 1 (element-wise) when the columns have no structure.
"""

from __future__ import annotations

import math

import torch


class ColumnSelection:
    """``x.index_select(1, columns)`` for ``x`` of ``width`` columns, by blocks where it can."""

    def __init__(self, columns: torch.Tensor, width: int):
        self.columns = columns
        self.width = width
        self.block = _block_width(columns, width)
        self.blocks = columns[::self.block] // self.block

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != self.width:
            raise ValueError(f"a column selection over {self.width} columns got a tensor of {x.shape[1]}")
        if self.block == 1:
            return x.index_select(1, self.columns)
        rows = x.shape[0]
        return x.reshape(rows, self.width // self.block, self.block).index_select(1, self.blocks).view(rows, -1)


def _block_width(columns: torch.Tensor, width: int) -> int:
    """The largest ``w`` dividing ``width`` and every run's start and length in ``columns``."""
    if columns.numel() == 0:
        return 1
    breaks = (torch.nonzero(columns[1:] != columns[:-1] + 1).flatten() + 1).tolist()
    bounds = [0, *breaks, columns.numel()]
    block = width
    for start, stop in zip(bounds, bounds[1:]):
        block = math.gcd(block, int(columns[start]), stop - start)
    return max(block, 1)
