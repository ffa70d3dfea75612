"""Block-wise column selection against ``index_select`` (the reference)."""

from __future__ import annotations

import pytest
import torch

from torchrec_tpu.sharding.column_blocks import ColumnSelection


def _runs(*runs: tuple[int, int]) -> torch.Tensor:
    return torch.cat([torch.arange(start, start + length) for start, length in runs])


@pytest.mark.parametrize("columns,width,block", [
    (_runs((64, 64), (0, 64), (128, 32)), 160, 32),  # whole features of dims 64 and 32
    (_runs((8, 4), (0, 4)), 16, 4),
    (_runs((0, 24)), 24, 24),  # identity: one block
    (_runs((3, 3)), 24, 3),
    (_runs((16, 16), (2, 6)), 32, 2),  # a column shard starting mid-feature
    (torch.tensor([5, 1, 2]), 8, 1),  # no structure: element-wise
    (torch.zeros(0, dtype=torch.int64), 8, 1),
])
def test_selects_what_index_select_does_by_the_largest_block(columns, width, block) -> None:
    selection = ColumnSelection(columns, width)
    assert selection.block == block
    x = torch.randn(7, width)
    assert torch.equal(selection(x), x.index_select(1, columns))


def test_random_feature_permutations_match_index_select() -> None:
    generator = torch.Generator().manual_seed(0)
    dims = [16, 64, 16, 32, 64, 8]
    offsets = torch.tensor([0, *dims]).cumsum(0)
    for _ in range(20):
        order = torch.randperm(len(dims), generator=generator)[:4]
        columns = torch.cat([torch.arange(int(offsets[f]), int(offsets[f + 1])) for f in order])
        x = torch.randn(5, int(offsets[-1]), generator=generator)
        assert torch.equal(ColumnSelection(columns, x.shape[1])(x), x.index_select(1, columns))


def test_a_tensor_of_another_width_is_refused() -> None:
    with pytest.raises(ValueError, match="over 16 columns got a tensor of 12"):
        ColumnSelection(_runs((0, 8)), 16)(torch.zeros(2, 12))
