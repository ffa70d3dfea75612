"""HSTU written from the paper's equations (Zhai et al., ICML 2024), one sequence at a time, in plain
CPU PyTorch: the independent reference of the attention op and the STU layer.

For a sequence of n events whose last ``targets`` are candidates, position ids are
``min(i, n - targets)``; row i attends to column j iff ``i == j`` or ``id(i) > id(j)``;
``A = SiLU(alpha Q K^T + rab_pos + rab_time) / N`` on those pairs, zero elsewhere;
``rab_pos = pos_w[min(id(i) - id(j), P - 1)]``,
``rab_time = ts_w[min(floor(ln(max(|t_i - t_j|, 1)) / 0.301), NB)]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def attention(q, k, v, offsets, timestamps, pos_w, ts_w, *, max_seq_len, alpha, num_targets=None):
    """``[T, H, Dv]`` in the dtype of the inputs' promotion (pass float64 for a tight reference)."""
    outs = []
    for b in range(offsets.numel() - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        n = end - start
        if n == 0:
            continue
        history = n - (int(num_targets[b]) if num_targets is not None else 0)
        ids = torch.arange(n).clamp(max=history)
        rel = ids[:, None] - ids[None, :]
        allowed = (rel > 0) | torch.eye(n, dtype=torch.bool)
        rab_pos = pos_w[rel.clamp(0, pos_w.numel() - 1)]
        ts = timestamps[start:end]
        gap = (ts[:, None] - ts[None, :]).abs().clamp(min=1).double()
        bucket = torch.floor(torch.log(gap) / 0.301).clamp(0, ts_w.numel() - 1).long()
        rab_time = ts_w[bucket]
        scores = alpha * torch.einsum("ihd,jhd->hij", q[start:end], k[start:end]) + rab_pos + rab_time
        a = F.silu(scores) / max_seq_len * allowed
        outs.append(torch.einsum("hij,jhd->ihd", a, v[start:end]))
    if not outs:
        return v[:0] * 0
    return torch.cat(outs)


def stu_layer(x, offsets, timestamps, params, *, heads, qk_dim, v_dim, max_seq_len, num_targets=None, eps=1e-6):
    """One STU layer: ``U, V, Q, K = split(SiLU(X W1 + b1))``; ``A V`` by :func:`attention` with
    ``alpha = 1 / sqrt(qk_dim)``; ``Y = (LayerNorm(A V) * U) W2 + b2 + X``. ``params``:
    ``w1, b1, w2, b2, pos_w, ts_w, ln_w, ln_b``."""
    t = x.shape[0]
    h = F.silu(x @ params["w1"] + params["b1"])
    u, v, q, k = torch.split(h, [heads * v_dim, heads * v_dim, heads * qk_dim, heads * qk_dim], dim=-1)
    av = attention(q.reshape(t, heads, qk_dim), k.reshape(t, heads, qk_dim), v.reshape(t, heads, v_dim), offsets,
                   timestamps, params["pos_w"], params["ts_w"], max_seq_len=max_seq_len,
                   alpha=1.0 / math.sqrt(qk_dim), num_targets=num_targets).reshape(t, heads * v_dim)
    normed = F.layer_norm(av, (heads * v_dim,), params["ln_w"], params["ln_b"], eps)
    return (normed * u) @ params["w2"] + params["b2"] + x
