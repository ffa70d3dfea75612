"""The STU layer and the HSTU stack over jagged sequences (Zhai et al., ICML 2024):

    U, V, Q, K = split(SiLU(X W1 + b1))
    A V        = HSTU attention (pointwise SiLU / N, causal, position and time-gap biases)
    Y          = (LayerNorm(A V) * U) W2 + b2 + X
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchrec_tpu.hstu.attention import stu_attention


@dataclass(frozen=True)
class Sequences:
    """The jagged layout every layer of one batch shares: ``offsets [B + 1]`` into the rows,
    ``timestamps`` per row (rows past ``offsets[-1]`` are padding), ``num_targets [B]`` (the
    candidates closing each sequence) and ``max_len``, the batch's length bucket. The tensors live
    where the layers' attention runs (:func:`~torchrec_tpu.hstu.attention.attention_device`), so
    they cross devices once per batch, not once per layer."""

    offsets: torch.Tensor
    timestamps: torch.Tensor
    num_targets: torch.Tensor
    max_len: int


class STULayer(nn.Module):
    """One STU layer on ``x [T, dim]`` (module docstring); ``alpha = 1 / sqrt(qk_dim)``, N =
    ``max_seq_len``; ``time_buckets`` time-gap buckets (+ 1 for the largest gaps)."""

    def __init__(self, dim: int, heads: int, qk_dim: int, v_dim: int, max_seq_len: int, time_buckets: int = 128,
                 kernel: str = "xla"):
        super().__init__()
        self.heads, self.qk_dim, self.v_dim = heads, qk_dim, v_dim
        self.max_seq_len, self.kernel = max_seq_len, kernel
        self.uvqk = nn.Linear(dim, heads * (2 * v_dim + 2 * qk_dim))
        self.norm = nn.LayerNorm(heads * v_dim, eps=1e-6)
        self.out = nn.Linear(heads * v_dim, dim)
        self.pos_weights = nn.Parameter(torch.zeros(max_seq_len))
        self.time_weights = nn.Parameter(torch.zeros(time_buckets + 1))

    def forward(self, x: torch.Tensor, seq: Sequences) -> torch.Tensor:
        rows, hv, hq = x.shape[0], self.heads * self.v_dim, self.heads * self.qk_dim
        u, vqk = torch.split(F.silu(self.uvqk(x)), [hv, hv + 2 * hq], dim=-1)
        av = stu_attention(vqk, seq.offsets, seq.timestamps, seq.num_targets, self.pos_weights, self.time_weights,
                           heads=self.heads, qk_dim=self.qk_dim, max_len=seq.max_len, max_seq_len=self.max_seq_len,
                           alpha=1.0 / math.sqrt(self.qk_dim), kernel=self.kernel)
        return self.out(self.norm(av.reshape(rows, hv)) * u) + x


class HSTUStack(nn.Module):
    """``layers`` STU layers applied in turn."""

    def __init__(self, layers: int, dim: int, heads: int, qk_dim: int, v_dim: int, max_seq_len: int,
                 time_buckets: int = 128, kernel: str = "xla"):
        super().__init__()
        self.layers = nn.ModuleList(STULayer(dim, heads, qk_dim, v_dim, max_seq_len, time_buckets, kernel)
                                    for _ in range(layers))

    def forward(self, x: torch.Tensor, seq: Sequences) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, seq)
        return x
