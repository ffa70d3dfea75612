"""Fit a KJT of any batch size to the EBC's fixed one (SparseCore shapes are static): split it
into chunks of ``size`` samples and pad the last with empty samples."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def fixed_size_chunks(kjt: KeyedJaggedTensor, size: int) -> Iterator[tuple[KeyedJaggedTensor, int]]:
    """(chunk of exactly ``size`` samples, how many of them are real), in sample order."""
    stride = kjt.stride()
    if stride == size:
        yield kjt, size
        return
    lengths = kjt.lengths().view(len(kjt.keys()), stride)
    offsets = torch.cat([lengths.new_zeros(len(kjt.keys()), 1), lengths.cumsum(1)], dim=1)
    starts = offsets[:, 0] + torch.cat([offsets.new_zeros(1), lengths.sum(1).cumsum(0)[:-1]])
    weights = kjt.weights_or_none()
    for first in range(0, stride, size):
        real = min(size, stride - first)
        picks = [torch.arange(int(s + offsets[k, first]), int(s + offsets[k, first + real]))
                 for k, s in enumerate(starts)]
        index = torch.cat(picks)
        chunk_lengths = torch.zeros(len(kjt.keys()), size, dtype=lengths.dtype)
        chunk_lengths[:, :real] = lengths[:, first:first + real]
        yield KeyedJaggedTensor(
            keys=kjt.keys(), values=kjt.values()[index], lengths=chunk_lengths.reshape(-1),
            weights=None if weights is None else weights[index],
        ), real
