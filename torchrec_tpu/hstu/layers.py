"""The STU layers and the HSTU stack over jagged sequences: Meta's two STU layers and this project's first.

``paper`` (generative-recommenders' ``research/modeling/sequential/hstu.py``, the ICML 2024 code)::

    U, V, Q, K = split(SiLU(LayerNorm(X) W1))                 LayerNorm without affine, eps 1e-6; no bias
    A V        = sum_j SiLU(q_i k_j + rab_pos(i - j) + rab_time(t_next(i) - t_j)) / N v_j
    Y          = Dropout(U * LayerNorm(A V)) W2 + b2 + X      N: the padded width (max_seq_len)

``dlrmv3`` (generative-recommenders' ``modules/stu.py`` and ``ops/``, which MLPerf's DLRMv4 forks)::

    U, V, Q, K = split(LayerNorm(X; g1, b1) W1 + c1),  U = SiLU(U)
    A V        = sum_j SiLU(q_i k_j / sqrt(d_qk)) / N v_j    N: the batch's longest history + most candidates
    Y          = Dropout([U, A V, U * LayerNorm(A V; g2, b2)]) W2 + X

``legacy``: the layer checkpoints written before the variants existed hold (``SiLU(X W1 + b1)``,
``q k / sqrt(d_qk)``, the time bias at the query's own time, no dropout, ``(LayerNorm(A V) * U) W2 + b2
+ X``); a checkpoint whose config names no ``stu`` loads into it.

Every variant attends by :func:`~torchrec_tpu.hstu.attention.stu_attention` (the jagged op):
``dlrmv3`` with all-zero bias tables, ``paper`` with its position table read causal half first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchrec_tpu.hstu.attention import stu_attention

STU_VARIANTS = ("paper", "dlrmv3", "legacy")
NORM_EPS = 1e-6  # both of Meta's layers' LayerNorm epsilon
PAPER_INIT_STD = 0.02  # the paper code's normal init of W1 and both bias tables


@dataclass(frozen=True)
class Sequences:
    """The jagged layout every layer of one batch shares: ``offsets [B + 1]`` into the rows,
    ``timestamps [T, 2]`` per row (the time the row queries at, then its own; rows past
    ``offsets[-1]`` are padding), ``num_targets [B]`` (the candidates closing each sequence),
    ``max_len``, the batch's length bucket, and ``longest``, its longest history plus its most
    candidates (``dlrmv3``'s N; a 0-dim float tensor inside a compiled step, whose program serves
    every N). The tensors live where the layers' attention runs
    (:func:`~torchrec_tpu.hstu.attention.attention_device`), so they cross devices once per batch,
    not once per layer. ``in_program``: the layers are traced into a compiled tpu step (on fake
    tensors), where every layer attends by the jagged op on the tensors as they are."""

    offsets: torch.Tensor
    timestamps: torch.Tensor
    num_targets: torch.Tensor
    max_len: int
    longest: int | torch.Tensor = 0
    in_program: bool = False


class LegacySTU(nn.Module):
    """The first STU layer of this project on ``x [T, dim]`` (module docstring); ``alpha = 1 /
    sqrt(qk_dim)``, N = ``max_seq_len``; ``time_buckets`` time-gap buckets (+ 1 for the largest gaps)."""

    def __init__(self, dim: int, heads: int, qk_dim: int, v_dim: int, max_seq_len: int, time_buckets: int = 128,
                 kernel: str = "xla"):
        super().__init__()
        self.heads, self.qk_dim, self.v_dim = heads, qk_dim, v_dim
        self.max_seq_len, self.kernel = max_seq_len, kernel
        self.uvqk = nn.Linear(dim, heads * (2 * v_dim + 2 * qk_dim))
        self.norm = nn.LayerNorm(heads * v_dim, eps=NORM_EPS)
        self.out = nn.Linear(heads * v_dim, dim)
        self.pos_weights = nn.Parameter(torch.zeros(max_seq_len))
        self.time_weights = nn.Parameter(torch.zeros(time_buckets + 1))

    def forward(self, x: torch.Tensor, seq: Sequences) -> torch.Tensor:
        rows, hv, hq = x.shape[0], self.heads * self.v_dim, self.heads * self.qk_dim
        u, vqk = torch.split(F.silu(self.uvqk(x)), [hv, hv + 2 * hq], dim=-1)
        av = stu_attention(vqk, seq.offsets, seq.timestamps, seq.num_targets, self.pos_weights, self.time_weights,
                           heads=self.heads, qk_dim=self.qk_dim, max_len=seq.max_len, max_seq_len=self.max_seq_len,
                           alpha=1.0 / math.sqrt(self.qk_dim), kernel=self.kernel,
                           in_program=seq.in_program)
        return self.out(self.norm(av.reshape(rows, hv)) * u) + x


class PaperSTU(nn.Module):
    """The 2024 paper code's layer (module docstring) and its init: ``W1`` and both bias tables
    normal(0, 0.02), ``W2`` Xavier-uniform. ``pos_weights`` is the paper's table of ``2 N - 1``
    relative positions (entry ``N - 1 + j - i`` for query ``i``, key ``j``); ``time_weights`` has
    ``time_buckets + 1`` entries; ``dropout`` is the paper's ``linear_dropout_rate``."""

    def __init__(self, dim: int, heads: int, qk_dim: int, v_dim: int, max_seq_len: int, time_buckets: int = 128,
                 dropout: float = 0.2, kernel: str = "xla"):
        super().__init__()
        self.dim, self.heads, self.qk_dim, self.v_dim = dim, heads, qk_dim, v_dim
        self.max_seq_len, self.dropout, self.kernel = max_seq_len, dropout, kernel
        self.uvqk = nn.Parameter(torch.empty(dim, heads * (2 * v_dim + 2 * qk_dim)).normal_(0, PAPER_INIT_STD))
        self.out = nn.Linear(heads * v_dim, dim)
        nn.init.xavier_uniform_(self.out.weight)
        self.pos_weights = nn.Parameter(torch.empty(2 * max_seq_len - 1).normal_(0, PAPER_INIT_STD))
        self.time_weights = nn.Parameter(torch.empty(time_buckets + 1).normal_(0, PAPER_INIT_STD))

    def forward(self, x: torch.Tensor, seq: Sequences) -> torch.Tensor:
        rows, hv, hq = x.shape[0], self.heads * self.v_dim, self.heads * self.qk_dim
        normed = F.layer_norm(x, (self.dim,), eps=NORM_EPS)
        u, vqk = torch.split(F.silu(normed @ self.uvqk), [hv, hv + 2 * hq], dim=-1)
        # the op indexes its table by the distance i - j >= 0: the paper's entries N - 1 down to 0
        causal = self.pos_weights[:self.max_seq_len].flip(0)
        av = stu_attention(vqk, seq.offsets, seq.timestamps, seq.num_targets, causal, self.time_weights,
                           heads=self.heads, qk_dim=self.qk_dim, max_len=seq.max_len, max_seq_len=self.max_seq_len,
                           alpha=1.0, kernel=self.kernel, in_program=seq.in_program)
        y = u * F.layer_norm(av.reshape(rows, hv), (hv,), eps=NORM_EPS)
        return self.out(F.dropout(y, self.dropout, self.training)) + x


class DLRMv3STU(nn.Module):
    """The DLRMv3 layer (module docstring) and its init: ``W1``, ``W2`` Xavier-uniform, ``c1``
    zeros, both LayerNorms ones and zeros; ``dropout`` is its ``output_dropout_ratio``. No relative
    bias: position and time enter the model as input embeddings."""

    def __init__(self, dim: int, heads: int, qk_dim: int, v_dim: int, dropout: float = 0.1, kernel: str = "xla"):
        super().__init__()
        self.heads, self.qk_dim, self.v_dim, self.dropout, self.kernel = heads, qk_dim, v_dim, dropout, kernel
        width = heads * (2 * v_dim + 2 * qk_dim)
        self.input_norm = nn.LayerNorm(dim, eps=NORM_EPS)
        self.uvqk_weight = nn.Parameter(nn.init.xavier_uniform_(torch.empty(dim, width)))
        self.uvqk_bias = nn.Parameter(torch.zeros(width))
        self.output_norm = nn.LayerNorm(heads * v_dim, eps=NORM_EPS)
        self.output_weight = nn.Parameter(nn.init.xavier_uniform_(torch.empty(3 * heads * v_dim, dim)))
        # the op always adds its two bias tables: one zero entry each adds nothing
        self.register_buffer("no_bias", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor, seq: Sequences) -> torch.Tensor:
        if isinstance(seq.longest, int) and seq.longest < 1:
            raise ValueError(f"DLRMv3STU: Sequences.longest={seq.longest}; it must be the batch's N (>= 1)")
        rows, hv, hq = x.shape[0], self.heads * self.v_dim, self.heads * self.qk_dim
        u, vqk = torch.split(torch.addmm(self.uvqk_bias, self.input_norm(x), self.uvqk_weight), [hv, hv + 2 * hq],
                             dim=-1)
        u = F.silu(u)
        # N = 1 in the op and the batch's N here: the op's N is a compiled constant, this one varies by batch
        av = stu_attention(vqk, seq.offsets, seq.timestamps, seq.num_targets, self.no_bias, self.no_bias,
                           heads=self.heads, qk_dim=self.qk_dim, max_len=seq.max_len, max_seq_len=1,
                           alpha=1.0 / math.sqrt(self.qk_dim), kernel=self.kernel,
                           in_program=seq.in_program).reshape(rows, hv) / seq.longest
        y = torch.cat([u, av, u * self.output_norm(av)], dim=-1)
        return torch.addmm(x, F.dropout(y, self.dropout, self.training), self.output_weight)


def stu_layer(stu: str, dim: int, heads: int, qk_dim: int, v_dim: int, max_seq_len: int, time_buckets: int,
              dropout: float, kernel: str) -> nn.Module:
    """One layer of variant ``stu`` (:data:`STU_VARIANTS`)."""
    if stu == "paper":
        return PaperSTU(dim, heads, qk_dim, v_dim, max_seq_len, time_buckets, dropout, kernel)
    if stu == "dlrmv3":
        return DLRMv3STU(dim, heads, qk_dim, v_dim, dropout, kernel)
    if stu == "legacy":
        return LegacySTU(dim, heads, qk_dim, v_dim, max_seq_len, time_buckets, kernel)
    raise ValueError(f"STU variant {stu!r}; expected one of {list(STU_VARIANTS)}")


class HSTUStack(nn.Module):
    """``layers`` STU layers of variant ``stu`` applied in turn."""

    def __init__(self, layers: int, dim: int, heads: int, qk_dim: int, v_dim: int, max_seq_len: int,
                 time_buckets: int = 128, kernel: str = "xla", *, stu: str = "paper", dropout: float = 0.0):
        super().__init__()
        self.layers = nn.ModuleList(stu_layer(stu, dim, heads, qk_dim, v_dim, max_seq_len, time_buckets, dropout,
                                              kernel) for _ in range(layers))

    def forward(self, x: torch.Tensor, seq: Sequences) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, seq)
        return x
