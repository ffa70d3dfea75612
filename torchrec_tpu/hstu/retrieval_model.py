"""HSTU for the paper's retrieval task: generative-recommenders' ``research/`` sequential encoder
(``modeling/sequential/hstu.py``'s ``HSTU`` with ``LearnablePositionalEmbeddingInputFeaturesPreprocessor``
and ``L2NormEmbeddingPostprocessor``) over jagged user sequences::

    x_i = Dropout(e(item_i) sqrt(D) + p(i))       p: learned positions from the sequence's start
    y   = the ``paper`` STU stack over x, each event's time bias taken at the next event's time
    q_i = y_i / max(||y_i||, 1e-6)                the output at i scores the item after event i

The item table ``e`` serves the inputs and the softmax over items; its init is the paper code's
truncated normal (std 0.02, cut at 2 std), the position table's Xavier-normal (its ``reset_params``).
The stack's padded width N (its 1/N and the position bias table of 2N - 1) is the history cap plus
the paper code's ``gr_output_length + 1`` = 11, as there.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchrec_tpu.hstu.attention import PADDED
from torchrec_tpu.hstu.layers import HSTUStack, Sequences
from torchrec_tpu.hstu.retrieval import NORM_EPS

OUTPUT_SLOTS = 11  # the paper code's gr_output_length (10) + 1, added to the history cap in N
ITEM_INIT_STD = 0.02


@dataclass(frozen=True)
class RetrievalConfig:
    """The encoder; the defaults are the paper's MovieLens-1M config
    (``configs/ml-1m/hstu-sampled-softmax-n128-final.gin``): D 50, 2 blocks, 1 head, d_qk = d_v
    = 50, histories of at most 200 events, dropout 0.2 on the input and in each layer."""

    item_rows: int
    dim: int = 50
    layers: int = 2
    heads: int = 1
    qk_dim: int = 50
    v_dim: int = 50
    max_history: int = 200
    time_buckets: int = 128
    dropout: float = 0.2

    def __post_init__(self) -> None:
        for name in ("item_rows", "dim", "layers", "heads", "qk_dim", "v_dim", "max_history", "time_buckets"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RetrievalConfig.{name}={value!r}: it must be a positive integer")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"RetrievalConfig.dropout={self.dropout!r}: it must lie in [0, 1)")

    @property
    def width(self) -> int:
        """The stack's padded width N: the history cap plus :data:`OUTPUT_SLOTS`."""
        return self.max_history + OUTPUT_SLOTS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RetrievalBatch:
    """Users' sequences, jagged: ``offsets [B + 1]`` into the events' ``ids``, ``times`` (oldest
    first), ``next_ids`` and ``next_times`` (each event's next item and its time: the last event's
    is the split's target); ``seen [B, S]`` (-1: padding) the items each user's ranking leaves out."""

    offsets: torch.Tensor
    ids: torch.Tensor
    times: torch.Tensor
    next_ids: torch.Tensor
    next_times: torch.Tensor
    seen: torch.Tensor

    @property
    def rows(self) -> int:
        """Users in the batch."""
        return self.offsets.numel() - 1

    @property
    def last(self) -> torch.Tensor:
        """Each user's last event's row: where the user's query for the target is."""
        return self.offsets[1:] - 1

    def to(self, device: torch.device | str) -> "RetrievalBatch":
        return RetrievalBatch(*(t.to(device) for t in (self.offsets, self.ids, self.times, self.next_ids,
                                                       self.next_times, self.seen)))


class RetrievalHSTU(nn.Module):
    """The encoder of the module docstring: ``forward(batch) -> [T, D]``, one normalized query per event."""

    def __init__(self, config: RetrievalConfig):
        super().__init__()
        self.config = config
        self.items = nn.Embedding(config.item_rows, config.dim)
        nn.init.trunc_normal_(self.items.weight, std=ITEM_INIT_STD, a=-2 * ITEM_INIT_STD, b=2 * ITEM_INIT_STD)
        self.positions = nn.Embedding(config.width, config.dim)
        nn.init.xavier_normal_(self.positions.weight)
        self.stack = HSTUStack(config.layers, config.dim, config.heads, config.qk_dim, config.v_dim, config.width,
                               config.time_buckets, PADDED, stu="paper", dropout=config.dropout)

    def forward(self, batch: RetrievalBatch) -> torch.Tensor:
        offsets = batch.offsets
        lengths = offsets[1:] - offsets[:-1]
        longest = int(lengths.max()) if lengths.numel() else 0
        if longest > self.config.max_history:
            raise ValueError(f"retrieval HSTU: a user has {longest} events, above max_history="
                             f"{self.config.max_history}; keep the latest when reading")
        user = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)
        position = torch.arange(batch.ids.numel(), device=offsets.device) - offsets[user]
        x = self.items(batch.ids) * math.sqrt(self.config.dim) + self.positions(position)
        x = F.dropout(x, self.config.dropout, self.training)
        seq = Sequences(offsets, torch.stack([batch.next_times, batch.times], dim=1), torch.zeros_like(lengths),
                        max(longest, 1), longest)
        return F.normalize(self.stack(x, seq), dim=-1, eps=NORM_EPS)
