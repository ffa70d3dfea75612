"""HSTU attention of one sequence, tile by tile: the math both execution paths run.

For one (sequence, head) of padded length ``L`` (a multiple of ``block``), with ``n`` valid events
of which the last ``targets`` are candidates, position ids are ``id(x) = min(x, n - targets)``
(candidates share the first candidate's id, as generative-recommenders numbers them) and row ``r``
attends to column ``c`` when both are valid and ``r == c`` or ``id(r) > id(c)`` (causal over the
history; a candidate sees the history and itself). On those pairs

    s[r, c] = alpha * <q_r, k_c> + pos_w[min(id(r) - id(c), P - 1)] + ts_w[bucket(ts_r - ts_c)]
    out[r]  = sum_c SiLU(s[r, c]) / N * v_c

with ``bucket(dt) = min(floor(ln(max(|dt|, 1)) / 0.301), NB)`` (``ts_w`` has ``NB + 1`` entries)
and ``N`` the model's maximum sequence length (a constant, so a sample's output does not depend on
the bucket it is padded to). No softmax: each tile's contribution is added independently, so the
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


def _tile(qi, kj, i, j, block, length, history, ts, pos_w, ts_w, alpha):
    """Scores, validity and bias indices of query tile ``i`` against key tile ``j``."""
    rows = i * block + jnp.arange(block, dtype=jnp.int32)
    cols = j * block + jnp.arange(block, dtype=jnp.int32)
    rel = jnp.minimum(rows, history)[:, None] - jnp.minimum(cols, history)[None, :]
    valid = ((rows[:, None] < length) & (cols[None, :] < length)
             & ((rel > 0) | (rows[:, None] == cols[None, :])))
    pidx = jnp.clip(rel, 0, pos_w.shape[0] - 1)
    ts_rows = lax.dynamic_slice_in_dim(ts, i * block, block)
    ts_cols = lax.dynamic_slice_in_dim(ts, j * block, block)
    tidx = time_buckets(ts_rows[:, None] - ts_cols[None, :], ts_w.shape[0] - 1)
    scores = alpha * jnp.dot(qi, kj.T, preferred_element_type=jnp.float32)
    scores = scores + pos_w[pidx].astype(jnp.float32) + ts_w[tidx].astype(jnp.float32)
    return scores, valid, pidx, tidx


def _slice(x, i, block):
    return lax.dynamic_slice_in_dim(x, i * block, block)


def sequence_forward(q, k, v, length, history, live, ts, pos_w, ts_w, *, block: int, alpha: float,
                     inv_n: float) -> jax.Array:
    """``out [L, Dv]`` of one sequence and head (module docstring); ``live`` >= the number of
    query tiles holding a valid row."""
    seq, dv = v.shape

    def query_tile(i, out):
        qi = _slice(q, i, block)

        def key_tile(j, acc):
            s, valid, _, _ = _tile(qi, _slice(k, j, block), i, j, block, length, history, ts, pos_w, ts_w, alpha)
            p = jnp.where(valid, jax.nn.silu(s) * inv_n, 0.0)
            return acc + jnp.dot(p.astype(v.dtype), _slice(v, j, block), preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, i + 1, key_tile, jnp.zeros((block, dv), jnp.float32))
        return lax.dynamic_update_slice_in_dim(out, acc.astype(out.dtype), i * block, 0)

    return lax.fori_loop(0, live, query_tile, jnp.zeros((seq, dv), v.dtype))


def sequence_backward(q, k, v, length, history, live, ts, pos_w, ts_w, dout, *, block: int, alpha: float,
                      inv_n: float) -> tuple[jax.Array, ...]:
    """Gradients ``(dq, dk, dv, dpos_w, dts_w)`` of :func:`sequence_forward` for output gradient
    ``dout``: key tiles outside, the query tiles at or below the diagonal inside (float32)."""
    f32 = jnp.float32
    dout = dout.astype(f32)

    def key_tile(j, carry):
        dq, dk, dv, dpos, dts = carry
        kj = _slice(k, j, block)
        vj = _slice(v, j, block).astype(f32)

        def query_tile(i, c):
            dq, dkj, dvj, dpos, dts = c
            qi = _slice(q, i, block)
            s, valid, pidx, tidx = _tile(qi, kj, i, j, block, length, history, ts, pos_w, ts_w, alpha)
            sig = jax.nn.sigmoid(s)
            p = jnp.where(valid, s * sig * inv_n, 0.0)
            doi = _slice(dout, i, block)
            dvj = dvj + jnp.dot(p.T, doi)
            ds = jnp.where(valid, jnp.dot(doi, vj.T) * inv_n * sig * (1.0 + s * (1.0 - sig)), 0.0)
            dq_i = _slice(dq, i, block) + alpha * jnp.dot(ds, kj.astype(f32))
            dq = lax.dynamic_update_slice_in_dim(dq, dq_i, i * block, 0)
            dkj = dkj + alpha * jnp.dot(ds.T, qi.astype(f32))
            dpos = dpos.at[pidx].add(ds)
            dts = dts.at[tidx].add(ds)
            return dq, dkj, dvj, dpos, dts

        zeros_k = jnp.zeros((block, k.shape[1]), f32)
        zeros_v = jnp.zeros((block, v.shape[1]), f32)
        dq, dkj, dvj, dpos, dts = lax.fori_loop(j, live, query_tile, (dq, zeros_k, zeros_v, dpos, dts))
        dk = lax.dynamic_update_slice_in_dim(dk, dkj, j * block, 0)
        dv = lax.dynamic_update_slice_in_dim(dv, dvj, j * block, 0)
        return dq, dk, dv, dpos, dts

    init = (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32),
            jnp.zeros(pos_w.shape, f32), jnp.zeros(ts_w.shape, f32))
    return lax.fori_loop(0, live, key_tile, init)
