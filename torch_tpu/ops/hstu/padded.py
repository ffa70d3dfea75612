"""HSTU attention over a padded batch ``[B, H, L, D]``, with a custom VJP, on two paths.

* ``"xla"``: :mod:`.tiles`' per-sequence loops (all heads at once) vmapped over sequences: one
  XLA program on every platform; its tile loops run to the batch's longest sequence, holding
  ``[B, H, block, block]`` scores at a time.
* ``"pallas"``: the same loops as a Pallas kernel, one program per (sequence, head) (a one-head
  block), each stopping at its own sequence's length (Mosaic on TPU, interpret mode elsewhere).
  The bias tables are gathered in the kernel body; per-program bias gradients are summed outside.

Both compute float32 scores; gradients come back in the inputs' dtypes.
"""

from __future__ import annotations

import functools

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_tpu.ops.hstu.tiles import sequence_backward, sequence_forward
from torch_tpu.ops.pallas.platform import kernel_call
from torch_tpu.runtime._jax import jax, jnp

KERNELS = ("xla", "pallas")
# The xla path's backward tile edge where the forward's is a multiple of it: XLA:CPU runs the
# backward's five dots and two scatters per tile faster on 64-tiles, with fewer tiles above the
# diagonal (measured, float32 ms: 2 x 256: 3.1 vs 4.0; 16 x 256: 20 vs 28; 2 x 1024: 30 vs 34),
# while the forward is as fast or faster on 128-tiles.
_XLA_BACKWARD_BLOCK = 64
_SMEM = pl.BlockSpec(memory_space=pltpu.SMEM)


def _live_tiles(lengths: jax.Array, block: int) -> jax.Array:
    return (lengths + block - 1) // block


def _over_sequences(fn):
    """``fn`` (one sequence, all heads) over the batch: q, k, v, lengths, history, ts and any
    trailing per-sequence array batched; ``live`` and the bias tables shared."""
    return lambda *args: jax.vmap(fn, in_axes=(0, 0, 0, 0, 0, None, 0, None, None) + (0,) * (len(args) - 9))(*args)


def _xla_forward(q, k, v, lengths, history, ts, pos_w, ts_w, statics):
    live = _live_tiles(jnp.max(lengths, initial=0), statics["block"])
    fn = functools.partial(sequence_forward, **statics)
    return _over_sequences(fn)(q, k, v, lengths, history, live, ts, pos_w, ts_w)


def xla_backward_block(block: int) -> int:
    """The xla path backward's tile edge for the forward's ``block``."""
    return _XLA_BACKWARD_BLOCK if block > _XLA_BACKWARD_BLOCK and block % _XLA_BACKWARD_BLOCK == 0 else block


def _xla_backward(q, k, v, lengths, history, ts, pos_w, ts_w, dout, statics):
    statics = {**statics, "block": xla_backward_block(statics["block"])}
    live = _live_tiles(jnp.max(lengths, initial=0), statics["block"])
    fn = functools.partial(sequence_backward, **statics)
    dq, dk, dv, dpos, dts = _over_sequences(fn)(q, k, v, lengths, history, live, ts, pos_w, ts_w, dout)
    return dq, dk, dv, dpos.sum(axis=0), dts.sum(axis=0)


def _specs(q, v, ts, pos_w, ts_w):
    seq, dq, dv = q.shape[2], q.shape[3], v.shape[3]
    head = lambda d: pl.BlockSpec((None, 1, seq, d), lambda b, h: (b, h, 0, 0))  # noqa: E731
    return {
        "q": head(dq), "v": head(dv),
        "ts": pl.BlockSpec((None, 2, seq), lambda b, h: (b, 0, 0)),
        "pos": pl.BlockSpec(pos_w.shape, lambda b, h: (0,)),
        "tsw": pl.BlockSpec(ts_w.shape, lambda b, h: (0,)),
        "per_head": lambda n: pl.BlockSpec((None, None, n), lambda b, h: (b, h, 0)),
        "head": head,
    }


def _pallas_forward(q, k, v, lengths, history, ts, pos_w, ts_w, statics):
    block = statics["block"]

    def kernel(len_ref, hist_ref, q_ref, k_ref, v_ref, ts_ref, pos_ref, tsw_ref, out_ref):
        b = pl.program_id(0)
        length = len_ref[b]
        out_ref[...] = sequence_forward(q_ref[...], k_ref[...], v_ref[...], length, hist_ref[b],
                                        _live_tiles(length, block), ts_ref[...], pos_ref[...], tsw_ref[...],
                                        **statics)

    s = _specs(q, v, ts, pos_w, ts_w)
    return kernel_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
        grid=q.shape[:2],
        in_specs=[_SMEM, _SMEM, s["q"], s["q"], s["v"], s["ts"], s["pos"], s["tsw"]],
        out_specs=s["v"],
    )(lengths, history, q, k, v, ts, pos_w, ts_w)


def _pallas_backward(q, k, v, lengths, history, ts, pos_w, ts_w, dout, statics):
    block = statics["block"]

    def kernel(len_ref, hist_ref, q_ref, k_ref, v_ref, ts_ref, pos_ref, tsw_ref, do_ref,
               dq_ref, dk_ref, dv_ref, dpos_ref, dts_ref):
        b = pl.program_id(0)
        length = len_ref[b]
        grads = sequence_backward(q_ref[...], k_ref[...], v_ref[...], length, hist_ref[b],
                                  _live_tiles(length, block), ts_ref[...], pos_ref[...], tsw_ref[...],
                                  do_ref[...], **statics)
        for ref, grad in zip((dq_ref, dk_ref, dv_ref, dpos_ref, dts_ref), grads):
            ref[...] = grad

    s = _specs(q, v, ts, pos_w, ts_w)
    batch, heads = q.shape[:2]
    f32 = jnp.float32
    dq, dk, dv, dpos, dts = kernel_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(q.shape, f32), jax.ShapeDtypeStruct(k.shape, f32),
                   jax.ShapeDtypeStruct(v.shape, f32),
                   jax.ShapeDtypeStruct((batch, heads, pos_w.shape[0]), f32),
                   jax.ShapeDtypeStruct((batch, heads, ts_w.shape[0]), f32)),
        grid=(batch, heads),
        in_specs=[_SMEM, _SMEM, s["q"], s["q"], s["v"], s["ts"], s["pos"], s["tsw"], s["v"]],
        out_specs=(s["q"], s["q"], s["v"], s["per_head"](pos_w.shape[0]), s["per_head"](ts_w.shape[0])),
    )(lengths, history, q, k, v, ts, pos_w, ts_w, dout)
    return dq, dk, dv, dpos.sum(axis=(0, 1)), dts.sum(axis=(0, 1))


_PATHS = {"xla": (_xla_forward, _xla_backward), "pallas": (_pallas_forward, _pallas_backward)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def padded_attention(q, k, v, lengths, history, ts, pos_w, ts_w, block: int, alpha: float, inv_n: float,
                     kernel: str) -> jax.Array:
    """HSTU attention (``tiles``' math) of ``q, k [B, H, L, Dqk]``, ``v [B, H, L, Dv]`` with int32
    ``lengths [B]``, ``history [B]`` (length minus candidates), ``ts [B, 2, L]`` (query times, key
    times) and bias tables
    ``pos_w [P]``, ``ts_w [NB + 1]``; ``L`` is a multiple of ``block``."""
    return _PATHS[kernel][0](q, k, v, lengths, history, ts, pos_w, ts_w,
                             {"block": block, "alpha": alpha, "inv_n": inv_n})


def _fwd(q, k, v, lengths, history, ts, pos_w, ts_w, block, alpha, inv_n, kernel):
    out = padded_attention(q, k, v, lengths, history, ts, pos_w, ts_w, block, alpha, inv_n, kernel)
    return out, (q, k, v, lengths, history, ts, pos_w, ts_w)


def padded_attention_backward(q, k, v, lengths, history, ts, pos_w, ts_w, dout, block: int, alpha: float,
                              inv_n: float, kernel: str) -> tuple[jax.Array, ...]:
    """Gradients ``(dq, dk, dv, dpos_w, dts_w)`` of :func:`padded_attention` for the output gradient
    ``dout``, in the inputs' dtypes (the custom VJP's backward, callable without a forward pass)."""
    grads = _PATHS[kernel][1](q, k, v, lengths, history, ts, pos_w, ts_w, dout,
                              {"block": block, "alpha": alpha, "inv_n": inv_n})
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v, pos_w, ts_w)))


def _bwd(block, alpha, inv_n, kernel, residuals, dout):
    q, k, v, lengths, history, ts, pos_w, ts_w = residuals
    dq, dk, dv, dpos, dts = padded_attention_backward(q, k, v, lengths, history, ts, pos_w, ts_w, dout, block,
                                                      alpha, inv_n, kernel)
    return dq, dk, dv, None, None, None, dpos, dts


padded_attention.defvjp(_fwd, _bwd)
