"""HSTU attention of one sequence, tile by tile: the math both execution paths run.

For one sequence (all its heads at once) of padded length ``L`` (a multiple of ``block``), with
``n`` valid events of which the last ``targets`` are candidates, position ids are ``id(x) = min(x, n - targets)``
(candidates share the first candidate's id, as generative-recommenders numbers them) and row ``r``
attends to column ``c`` when both are valid and ``r == c`` or ``id(r) > id(c)`` (causal over the
history; a candidate sees the history and itself). On those pairs

    s[r, c] = alpha * <q_r, k_c> + pos_w[min(id(r) - id(c), P - 1)] + ts_w[bucket(tq_r - tk_c)]
    out[r]  = sum_c SiLU(s[r, c]) / N * v_c

with ``bucket(dt) = min(floor(ln(max(|dt|, 1)) / 0.301), NB)`` (``ts_w`` has ``NB + 1`` entries),
``tq_r`` the time row ``r`` queries at and ``tk_c`` column ``c``'s own time (the same unless the
caller passes query times: the HSTU paper's code queries at the next event's time), and ``N`` the
model's maximum sequence length (a constant, so a sample's output does not depend on the bucket it
is padded to). No softmax: each tile's contribution is added independently, so the
loops keep only one ``[block, block]`` tile of scores at a time (never ``[L, L]``) and skip tiles
above the diagonal and past ``live`` query blocks.

Scores and accumulations are float32 whatever the input dtype; ``p`` meets ``v`` in ``v``'s dtype.
"""

from __future__ import annotations

from jax import lax

from torch_tpu.runtime._jax import jax, jnp

TIME_BUCKET_DIVISOR = 0.301  # ln(dt) / 0.301: about 3.3 buckets per e-fold of the time gap


def time_buckets(dt: jax.Array, buckets: int) -> jax.Array:
    """Bucket of a time gap (any sign, integer seconds): ``min(floor(ln(max(|dt|, 1)) / 0.301), buckets)``."""
    gap = jnp.maximum(jnp.abs(dt).astype(jnp.float32), 1.0)
    return jnp.clip(jnp.floor(jnp.log(gap) / TIME_BUCKET_DIVISOR), 0, buckets).astype(jnp.int32)


def _position_tiles(pos_w, seq, block):
    """``[ceil(seq / block), block, block]`` float32: tile ``d`` holds ``pos_w[clip(d * block + r - c, 0, P - 1)]``,
    the position bias of a history row ``r`` of query tile ``i`` against key tile ``i - d``. It
    depends on ``i - j`` only, so the tile loops slice it instead of gathering per tile (XLA:CPU
    gathers element by element). ``seq * block`` entries: linear in the length."""
    d = jnp.arange(-(-seq // block), dtype=jnp.int32)[:, None, None] * block
    offset = jnp.arange(block, dtype=jnp.int32)[:, None] - jnp.arange(block, dtype=jnp.int32)[None, :]
    return pos_w[jnp.clip(d + offset, 0, pos_w.shape[0] - 1)].astype(jnp.float32)


def _tile_bias(i, j, block, length, history, ts, pos_w, position_tiles, ts_w):
    """Validity, float32 bias and bias indices of query tile ``i`` against key tile ``j`` (one
    sequence: the same for every head; ``ts [2, L]``: the query times, then the key times).
    History rows take their position bias from ``position_tiles`` (:func:`_position_tiles`);
    candidate rows (id ``history``) from ``pos_w`` by column."""
    rows = i * block + jnp.arange(block, dtype=jnp.int32)
    cols = j * block + jnp.arange(block, dtype=jnp.int32)
    rel = jnp.minimum(rows, history)[:, None] - jnp.minimum(cols, history)[None, :]
    valid = ((rows[:, None] < length) & (cols[None, :] < length)
             & ((rel > 0) | (rows[:, None] == cols[None, :])))
    pidx = jnp.clip(rel, 0, pos_w.shape[0] - 1)
    ts_rows = lax.dynamic_slice_in_dim(ts[0], i * block, block)
    ts_cols = lax.dynamic_slice_in_dim(ts[1], j * block, block)
    tidx = time_buckets(ts_rows[:, None] - ts_cols[None, :], ts_w.shape[0] - 1)
    # always true (tidx is clipped at 0); its second use makes XLA:CPU compute the buckets in a
    # vectorized loop of their own instead of inside the gather's per-element loop (~3x faster)
    valid = valid & (tidx >= 0)
    candidate_rows = pos_w[jnp.clip(history - jnp.minimum(cols, history), 0, pos_w.shape[0] - 1)]
    position_bias = jnp.where((rows < history)[:, None], position_tiles[i - j],
                              candidate_rows[None, :].astype(jnp.float32))
    bias = position_bias + ts_w[tidx].astype(jnp.float32)
    return valid, bias, pidx, tidx


def _scores(qi, kj, bias, alpha):
    """``[H, block, block]`` float32 scores of per-head tiles ``qi``, ``kj`` (``[H, block, D]``)."""
    return alpha * jnp.einsum("hrd,hcd->hrc", qi, kj, preferred_element_type=jnp.float32) + bias[None]


def _slice(x, i, block):
    """Tile ``i`` of the positions (axis 1 of ``[H, L, D]``, axis 0 of ``[L]``)."""
    return lax.dynamic_slice_in_dim(x, i * block, block, axis=min(1, x.ndim - 1))


def _update(x, tile, i, block):
    return lax.dynamic_update_slice_in_dim(x, tile, i * block, axis=1)


def sequence_forward(q, k, v, length, history, live, ts, pos_w, ts_w, *, block: int, alpha: float,
                     inv_n: float) -> jax.Array:
    """``out [H, L, Dv]`` of one sequence's heads (``q, k [H, L, Dqk]``, ``v [H, L, Dv]``; module
    docstring); ``live`` >= the number of query tiles holding a valid row."""
    heads, seq, dv = v.shape
    position_tiles = _position_tiles(pos_w, seq, block)

    def query_tile(i, out):
        qi = _slice(q, i, block)

        def key_tile(j, acc):
            valid, bias, _, _ = _tile_bias(i, j, block, length, history, ts, pos_w, position_tiles, ts_w)
            s = _scores(qi, _slice(k, j, block), bias, alpha)
            p = jnp.where(valid[None], jax.nn.silu(s) * inv_n, 0.0)
            return acc + jnp.einsum("hrc,hcd->hrd", p.astype(v.dtype), _slice(v, j, block),
                                    preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, i + 1, key_tile, jnp.zeros((heads, block, dv), jnp.float32))
        return _update(out, acc.astype(out.dtype), i, block)

    return lax.fori_loop(0, live, query_tile, jnp.zeros((heads, seq, dv), v.dtype))


def sequence_backward(q, k, v, length, history, live, ts, pos_w, ts_w, dout, *, block: int, alpha: float,
                      inv_n: float) -> tuple[jax.Array, ...]:
    """Gradients ``(dq, dk, dv, dpos_w, dts_w)`` of :func:`sequence_forward` for output gradient
    ``dout``: key tiles outside, the query tiles at or below the diagonal inside (float32). The
    bias gradients are summed over heads before they are scattered into the tables."""
    f32 = jnp.float32
    dout = dout.astype(f32)
    position_tiles = _position_tiles(pos_w, q.shape[1], block)

    def key_tile(j, carry):
        dq, dk, dv, dpos, dts = carry
        kj = _slice(k, j, block)
        vj = _slice(v, j, block).astype(f32)

        def query_tile(i, c):
            dq, dkj, dvj, dpos, dts = c
            qi = _slice(q, i, block)
            valid, bias, pidx, tidx = _tile_bias(i, j, block, length, history, ts, pos_w, position_tiles, ts_w)
            s = _scores(qi, kj, bias, alpha)
            sig = jax.nn.sigmoid(s)
            p = jnp.where(valid[None], s * sig * inv_n, 0.0)
            doi = _slice(dout, i, block)
            dvj = dvj + jnp.einsum("hrc,hrd->hcd", p, doi)
            dp = jnp.einsum("hrd,hcd->hrc", doi, vj)
            ds = jnp.where(valid[None], dp * inv_n * sig * (1.0 + s * (1.0 - sig)), 0.0)
            dq = _update(dq, _slice(dq, i, block) + alpha * jnp.einsum("hrc,hcd->hrd", ds, kj.astype(f32)), i, block)
            dkj = dkj + alpha * jnp.einsum("hrc,hrd->hcd", ds, qi.astype(f32))
            ds_heads = ds.sum(axis=0)
            dpos = dpos.at[pidx].add(ds_heads)
            dts = dts.at[tidx].add(ds_heads)
            return dq, dkj, dvj, dpos, dts

        zeros_k = jnp.zeros(kj.shape, f32)
        zeros_v = jnp.zeros(vj.shape, f32)
        dq, dkj, dvj, dpos, dts = lax.fori_loop(j, live, query_tile, (dq, zeros_k, zeros_v, dpos, dts))
        return dq, _update(dk, dkj, j, block), _update(dv, dvj, j, block), dpos, dts

    init = (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32),
            jnp.zeros(pos_w.shape, f32), jnp.zeros(ts_w.shape, f32))
    return lax.fori_loop(0, live, key_tile, init)
