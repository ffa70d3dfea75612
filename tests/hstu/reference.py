"""HSTU written from the paper's equations (Zhai et al., ICML 2024), one sequence at a time, in plain
CPU PyTorch: the independent reference of the attention op and the STU layer.

For a sequence of n events whose last ``targets`` are candidates, position ids are
``min(i, n - targets)``; row i attends to column j iff ``i == j`` or ``id(i) > id(j)``;
``A = SiLU(alpha Q K^T + rab_pos + rab_time) / N`` on those pairs, zero elsewhere;
``rab_pos = pos_w[min(id(i) - id(j), P - 1)]``,
``rab_time = ts_w[min(floor(ln(max(|t_i - t_j|, 1)) / 0.301), NB)]`` (``timestamps [T, 2]``: row i's
query time, then column j's own time, in that difference).

The STU layers: :func:`stu_layer` (the project's first, ``legacy``), :func:`paper_stu_layer` and
:func:`dlrmv3_stu_layer` (Meta's two, from their equations).
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
        t_query, t_key = (ts[:, 0], ts[:, 1]) if ts.dim() == 2 else (ts, ts)
        gap = (t_query[:, None] - t_key[None, :]).abs().clamp(min=1).double()
        bucket = torch.floor(torch.log(gap) / 0.301).clamp(0, ts_w.numel() - 1).long()
        rab_time = ts_w[bucket]
        scores = alpha * torch.einsum("ihd,jhd->hij", q[start:end], k[start:end]) + rab_pos + rab_time
        a = F.silu(scores) / max_seq_len * allowed
        outs.append(torch.einsum("hij,jhd->ihd", a, v[start:end]))
    if not outs:
        return v[:0] * 0
    return torch.cat(outs)


def stu_layer(x, offsets, timestamps, params, *, heads, qk_dim, v_dim, max_seq_len, num_targets=None, eps=1e-6):
    """The ``legacy`` STU layer: ``U, V, Q, K = split(SiLU(X W1 + b1))``; ``A V`` by :func:`attention` with
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


def _sequences(offsets, num_targets):
    """(start, n, history) of each non-empty sequence."""
    for b in range(offsets.numel() - 1):
        start, n = int(offsets[b]), int(offsets[b + 1] - offsets[b])
        if n:
            yield start, n, n - (int(num_targets[b]) if num_targets is not None else 0)


def _allowed(n, history):
    """``[n, n]``: row i sees column j (causal over the history; a candidate sees the history and itself)
    and the position ids ``min(i, history)``."""
    ids = torch.arange(n).clamp(max=history)
    return (ids[:, None] > ids[None, :]) | torch.eye(n, dtype=torch.bool), ids


def paper_stu_layer(x, offsets, timestamps, params, *, heads, qk_dim, v_dim, max_seq_len, num_targets=None,
                    next_event_time=True):
    """The 2024 paper code's STU layer in eval mode (no dropout), written from its equations, one
    sequence at a time. With ``N = max_seq_len`` (the padded width) and ``LN`` a LayerNorm without
    affine (eps 1e-6)::

        U, V, Q, K = split(SiLU(LN(X) W1))                    (no bias, no 1 / sqrt(d))
        s[i, j]    = q_i . k_j + pos_w[N - 1 + j - i] + ts_w[min(floor(ln(max(|t'_i - t_j|, 1)) / 0.301), NB)]
        A V        = sum_j (SiLU(s[i, j]) / N) v_j              over the allowed j
        Y          = (U * LN(A V)) W2 + b2 + X

    ``t'_i``: the next event's time (``next_event_time``; the last history event's next event is the
    first candidate; a candidate and a sequence's last event take their own), else ``t_i``.
    ``params``: ``w1 [D, W], w2 [H Dv, D], b2, pos_w [2 N - 1], ts_w [NB + 1]``."""
    outs = []
    n_w = max_seq_len
    for start, n, history in _sequences(offsets, num_targets):
        xs = x[start:start + n]
        h = F.silu(F.layer_norm(xs, (xs.shape[1],), eps=1e-6) @ params["w1"])
        u, v, q, k = torch.split(h, [heads * v_dim, heads * v_dim, heads * qk_dim, heads * qk_dim], dim=-1)
        allowed, ids = _allowed(n, history)
        ts = timestamps[start:start + n]
        rows = torch.arange(n)
        nxt = torch.where((rows < history) & (rows + 1 < n), rows + 1, rows) if next_event_time else rows
        gap = (ts[nxt][:, None] - ts[None, :]).abs().clamp(min=1).double()
        bucket = torch.floor(torch.log(gap) / 0.301).clamp(0, params["ts_w"].numel() - 1).long()
        pos_index = (n_w - 1 + ids[None, :] - ids[:, None]).clamp(0, 2 * n_w - 2)
        bias = params["pos_w"][pos_index] + params["ts_w"][bucket]
        s = torch.einsum("ihd,jhd->hij", q.reshape(n, heads, qk_dim), k.reshape(n, heads, qk_dim)) + bias
        a = F.silu(s) / n_w * allowed
        av = torch.einsum("hij,jhd->ihd", a, v.reshape(n, heads, v_dim)).reshape(n, heads * v_dim)
        outs.append((u * F.layer_norm(av, (heads * v_dim,), eps=1e-6)) @ params["w2"] + params["b2"] + xs)
    return torch.cat(outs)


def dlrmv3_stu_layer(x, offsets, params, *, heads, qk_dim, v_dim, n_norm, num_targets=None):
    """DLRMv3's STU layer (generative-recommenders ``modules/stu.py``) in eval mode, written from its
    equations, one sequence at a time; ``n_norm``: the batch's N (longest history + most candidates)::

        U, V, Q, K = split(LN(X; g1, b1) W1 + c1),  U = SiLU(U)     (LN eps 1e-6)
        A V        = sum_j (SiLU(q_i . k_j / sqrt(d_qk)) / N) v_j     over the allowed j; no relative bias
        Y          = [U, A V, U * LN(A V; g2, b2)] W2 + X

    ``params``: ``ln1_w, ln1_b, w1 [D, W], c1, ln2_w, ln2_b, w2 [3 H Dv, D]``."""
    outs = []
    for start, n, history in _sequences(offsets, num_targets):
        xs = x[start:start + n]
        h = F.layer_norm(xs, (xs.shape[1],), params["ln1_w"], params["ln1_b"], 1e-6) @ params["w1"] + params["c1"]
        u, v, q, k = torch.split(h, [heads * v_dim, heads * v_dim, heads * qk_dim, heads * qk_dim], dim=-1)
        u = F.silu(u)
        allowed, _ = _allowed(n, history)
        s = torch.einsum("ihd,jhd->hij", q.reshape(n, heads, qk_dim), k.reshape(n, heads, qk_dim)) / math.sqrt(qk_dim)
        a = F.silu(s) / n_norm * allowed
        av = torch.einsum("hij,jhd->ihd", a, v.reshape(n, heads, v_dim)).reshape(n, heads * v_dim)
        normed = F.layer_norm(av, (heads * v_dim,), params["ln2_w"], params["ln2_b"], 1e-6)
        outs.append(torch.cat([u, av, u * normed], dim=-1) @ params["w2"] + xs)
    return torch.cat(outs)
