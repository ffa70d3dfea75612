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


def dlrmv4_forward(model, kjt):
    """MLPerf's DLRMv4 model (DLRMv3's ``DlrmHSTU`` on Yambda) in eval mode, written from its
    equations one user at a time in float64, with ``model``'s parameters (read by name, not run):
    ``[B]`` listen_plus logits. Its pieces, each from generative-recommenders: the contextual
    linears, the content/additional/action MLPs (``Linear, x * sigmoid(LN(x)), Linear, LN``), the
    ActionEncoder's bits, ``x sqrt(D) + pos + time`` with position ``C + L - j`` (contextual k: k;
    the candidate: C) and time bucket ``floor(sqrt(max(q - t, 1e-6) / 60))``, the STU stack
    (:func:`dlrmv3_stu_layer`, N the longest sequence), LN, and ``predict(user * item_mlp(...))``."""
    c = model.config
    p = {k: v.detach().double() for k, v in model.named_parameters()}
    f = kjt.to_dict()
    tables = {t.name: t.num_embeddings for t in model.embeddings.embedding_configs()}
    table_of = {"item_candidate_id": "item_id", "item_candidate_artist_id": "artist_id",
                "item_candidate_album_id": "album_id"}

    def emb(feature, ids):
        table = table_of.get(feature, feature)
        return p[f"embeddings.embeddings.{table}.weight"][ids % tables[table]]

    def ln(x, name):
        return F.layer_norm(x, (x.shape[-1],), p[name + ".weight"], p[name + ".bias"], 1e-5)

    def tower(x, name):
        h = x @ p[f"{name}.0.weight"].T + p[f"{name}.0.bias"]
        h = h * torch.sigmoid(ln(h, f"{name}.1.norm"))
        return ln(h @ p[f"{name}.2.weight"].T + p[f"{name}.2.bias"], f"{name}.3")

    contextual = ("uid", "user_x_artist", "user_x_album", "user_x_hour", "item_x_hour", "artist_x_hour",
                  "user_x_is_organic", "user_x_artist_x_hour")
    rows, width = [], 0
    lengths = f["item_id"].lengths().tolist()
    offsets = [0]
    for b, n in enumerate(lengths):
        start = sum(lengths[:b])
        hist = {k: f[k].values()[start:start + n] for k in ("item_id", "artist_id", "album_id", "action_weight",
                                                            "action_timestamp")}
        cand = {k: f[k].values()[b] for k in ("item_candidate_id", "item_candidate_artist_id",
                                              "item_candidate_album_id", "item_query_time")}
        ctx = torch.stack([emb(k, f[k].values()[b]) @ p["contextual_weight"][i] + p["contextual_bias"][i]
                           for i, k in enumerate(contextual)])
        bits = torch.stack([(hist["action_weight"] & w) > 0 for w in (1, 2, 4)], 1).double()
        actions = (bits[:, :, None] * p["action_table"][None]).reshape(n, p["action_table"].numel())

        def token(item, artist, album, action):
            return (tower(item, "content_mlp") + tower(torch.cat([artist, album], -1), "additional_mlp")
                    + tower(action, "action_mlp"))

        history = token(emb("item_id", hist["item_id"]), emb("artist_id", hist["artist_id"]),
                        emb("album_id", hist["album_id"]), actions)
        candidate = token(emb("item_candidate_id", cand["item_candidate_id"])[None],
                          emb("item_candidate_artist_id", cand["item_candidate_artist_id"])[None],
                          emb("item_candidate_album_id", cand["item_candidate_album_id"])[None],
                          p["target_action"][None])
        x = torch.cat([ctx, history, candidate])
        k = len(contextual)
        position = torch.tensor(list(range(k)) + [k + n - j for j in range(n)] + [k]).clamp(max=c.position_buckets - 1)
        times = torch.cat([torch.zeros(k, dtype=torch.long), hist["action_timestamp"], cand["item_query_time"][None]])
        gap = (cand["item_query_time"] - times).double().clamp(min=1e-6) / 60
        bucket = torch.sqrt(gap).floor().clamp(0, c.time_buckets).long()
        rows.append(x * math.sqrt(c.dim) + p["position"][position] + p["time"][bucket])
        offsets.append(offsets[-1] + x.shape[0])
        width = max(width, x.shape[0])
    x = torch.cat(rows)
    offsets_t = torch.tensor(offsets)
    for i in range(c.layers):
        layer = f"stack.layers.{i}."
        params = {"ln1_w": p[layer + "input_norm.weight"], "ln1_b": p[layer + "input_norm.bias"],
                  "w1": p[layer + "uvqk_weight"], "c1": p[layer + "uvqk_bias"],
                  "ln2_w": p[layer + "output_norm.weight"], "ln2_b": p[layer + "output_norm.bias"],
                  "w2": p[layer + "output_weight"]}
        x = dlrmv3_stu_layer(x, offsets_t, params, heads=c.heads, qk_dim=c.qk_dim, v_dim=c.v_dim, n_norm=width,
                             num_targets=torch.ones(len(lengths), dtype=torch.long))
    user = ln(x[offsets_t[1:] - 1], "output_norm")
    item = tower(torch.cat([emb("item_candidate_id", f["item_candidate_id"].values()),
                            emb("item_candidate_artist_id", f["item_candidate_artist_id"].values()),
                            emb("item_candidate_album_id", f["item_candidate_album_id"].values())], -1), "item_mlp")
    h = (user * item) @ p["predict.0.weight"].T + p["predict.0.bias"]
    h = h * torch.sigmoid(ln(h, "predict.1.norm"))
    return (h @ p["predict.2.weight"].T + p["predict.2.bias"]).squeeze(-1)
