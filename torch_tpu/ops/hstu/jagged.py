"""HSTU jagged attention as a torch operator on the tpu device (eager and ``torch.compile``).

Jagged input: ``q, k [T, H, Dqk]`` and ``v [T, H, Dv]`` hold the events of B sequences back to
back, sequence ``b`` being rows ``offsets[b]:offsets[b + 1]``; rows before ``offsets[0]`` or past
``offsets[-1]`` (``T`` padded to a shape bucket) belong to no sequence and come out zero. Inside the
op the batch is padded to ``[B, H, L, D]`` with ``L = max_len`` rounded up to the tile size
(``max_len`` is the compiled shape's bound: a length bucket), attended by :mod:`.padded` and
gathered back to ``[T, H, Dv]``. The attention itself (``.tiles``) never forms an ``[L, L]`` score matrix.
"""

from __future__ import annotations

import numpy as np
import torch

from torch_tpu.ops.hstu.padded import KERNELS, padded_attention, padded_attention_backward
from torch_tpu.ops.pallas.op import jax_op
from torch_tpu.ops.pallas.platform import traceable
from torch_tpu.runtime._jax import jax, jnp
from torch_tpu.runtime.tensor import TpuTensor, concrete_value

MAX_BLOCK = 128
_INT32_MAX = 2**31 - 1


def tile_size(max_len: int) -> int:
    """Tile edge for sequences padded to ``max_len``: 128, or ``max_len`` rounded up to 8 when shorter."""
    return MAX_BLOCK if max_len >= MAX_BLOCK else max(8, -(-max_len // 8) * 8)


def _pad(values: jax.Array, offsets: jax.Array, seq: int) -> tuple[jax.Array, jax.Array]:
    """``values [T, ...]`` -> ``[B, seq, ...]`` (zeros past each length) and the in-sequence mask."""
    lengths = offsets[1:] - offsets[:-1]
    positions = jnp.arange(seq, dtype=jnp.int32)
    index = jnp.clip(offsets[:-1, None] + positions[None, :], 0, values.shape[0] - 1)
    inside = positions[None, :] < lengths[:, None]
    mask = inside.reshape(inside.shape + (1,) * (values.ndim - 1))
    return jnp.where(mask, values[index], jnp.zeros((), values.dtype)), inside


def _unpad(padded: jax.Array, offsets: jax.Array, total: int) -> jax.Array:
    """``[B, seq, ...]`` -> ``[total, ...]``: row ``t`` is its sequence's position ``t - offsets[b]``;
    rows outside ``[offsets[0], offsets[-1])`` (padding to a shape bucket) are zeros."""
    rows = jnp.arange(total, dtype=jnp.int32)
    segment = jnp.minimum(jnp.searchsorted(offsets[1:], rows, side="right"), offsets.shape[0] - 2)
    out = padded[segment, jnp.clip(rows - offsets[segment], 0, padded.shape[1] - 1)]
    inside = ((rows >= offsets[0]) & (rows < offsets[-1])).reshape((total,) + (1,) * (out.ndim - 1))
    return jnp.where(inside, out, jnp.zeros((), out.dtype))


def _padded_inputs(q, k, v, offsets, timestamps, num_targets, max_len):
    """The padded batch :func:`padded_attention` takes: ``(q, k, v [B, H, L, D], lengths, history,
    ts [B, 2, L], block)`` (``ts``: the query times, then the key times), with int32 time gaps from
    the batch's first time (68 years of range)."""
    offsets = offsets.astype(jnp.int32)
    block = tile_size(max_len)
    seq = -(-max_len // block) * block
    qp, kp, vp = (jnp.swapaxes(_pad(x, offsets, seq)[0], 1, 2) for x in (q, k, v))
    times = timestamps if timestamps.ndim == 2 else jnp.stack([timestamps, timestamps], axis=1)
    gaps = jnp.minimum(times.astype(jnp.int64) - jnp.min(times), _INT32_MAX).astype(jnp.int32)
    ts = jnp.swapaxes(_pad(gaps, offsets, seq)[0], 1, 2)
    lengths = offsets[1:] - offsets[:-1]
    history = lengths - num_targets.astype(jnp.int32)
    return qp, kp, vp, lengths, history, ts, block


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
               num_targets: torch.Tensor, pos_weights: torch.Tensor, time_weights: torch.Tensor, max_len: int,
               max_seq_len: int, alpha: float, kernel: str) -> torch.Tensor:
    total = v.shape[0]
    if total == 0:
        return jnp.zeros(v.shape, v.dtype)
    qp, kp, vp, lengths, history, ts, block = _padded_inputs(q, k, v, offsets, timestamps, num_targets, max_len)
    out = padded_attention(qp, kp, vp, lengths, history, ts, pos_weights, time_weights, block, float(alpha),
                           1.0 / max_seq_len, kernel)
    out = jnp.where(jnp.max(lengths) > max_len, jnp.nan, out)  # a sequence cut to max_len: no silent result
    return _unpad(jnp.swapaxes(out, 1, 2), offsets.astype(jnp.int32), total)


def _attention_backward(q, k, v, offsets, timestamps, num_targets, pos_weights, time_weights, max_len,
                        max_seq_len, alpha, kernel, grad):
    """The padded attention's backward on the padded inputs (no forward pass), its q, k, v
    gradients gathered back to rows (the transpose of :func:`_pad` is :func:`_unpad`: both map row
    ``t`` to its sequence's position, a one-to-one map)."""
    total = v.shape[0]
    if total == 0:
        return (jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype),
                jnp.zeros(pos_weights.shape, pos_weights.dtype), jnp.zeros(time_weights.shape, time_weights.dtype))
    qp, kp, vp, lengths, history, ts, block = _padded_inputs(q, k, v, offsets, timestamps, num_targets, max_len)
    offsets = offsets.astype(jnp.int32)
    dout = jnp.swapaxes(_pad(grad.astype(v.dtype), offsets, qp.shape[2])[0], 1, 2)
    dq, dk, dv, dpos, dts = padded_attention_backward(qp, kp, vp, lengths, history, ts, pos_weights, time_weights,
                                                      dout, block, float(alpha), 1.0 / max_seq_len, kernel)
    return (*(_unpad(jnp.swapaxes(d, 1, 2), offsets, total) for d in (dq, dk, dv)), dpos, dts)


_jagged_attention = jax_op("torch_tpu_pallas::hstu_jagged_attention", _attention, backward=_attention_backward,
                           differentiable=["q", "k", "v", "pos_weights", "time_weights"])


def _unpack(vqk: jax.Array, biases: jax.Array, heads: int, qk_dim: int, pos_buckets: int):
    """``vqk [T, H * (Dv + 2 Dqk)]`` (V, Q, K columns) and ``biases`` (the position table, then the
    time-bucket table) -> ``q, k [T, H, Dqk]``, ``v [T, H, Dv]``, ``pos_weights``, ``time_weights``."""
    rows, qk = vqk.shape[0], heads * qk_dim
    hv = vqk.shape[1] - 2 * qk
    v, q, k = vqk[:, :hv], vqk[:, hv:hv + qk], vqk[:, hv + qk:]
    return (q.reshape(rows, heads, qk_dim), k.reshape(rows, heads, qk_dim), v.reshape(rows, heads, hv // heads),
            biases[:pos_buckets], biases[pos_buckets:])


def _packed_attention(vqk: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor, num_targets: torch.Tensor,
                      biases: torch.Tensor, heads: int, qk_dim: int, pos_buckets: int, max_len: int,
                      max_seq_len: int, alpha: float, kernel: str) -> torch.Tensor:
    q, k, v, pos_weights, time_weights = _unpack(vqk, biases, heads, qk_dim, pos_buckets)
    return _attention(q, k, v, offsets, timestamps, num_targets, pos_weights, time_weights, max_len, max_seq_len,
                      alpha, kernel)


def _packed_attention_backward(vqk, offsets, timestamps, num_targets, biases, heads, qk_dim, pos_buckets, max_len,
                               max_seq_len, alpha, kernel, grad):
    """:func:`_attention_backward` with the gradients packed as the inputs are: ``dvqk``, ``dbiases``."""
    q, k, v, pos_weights, time_weights = _unpack(vqk, biases, heads, qk_dim, pos_buckets)
    dq, dk, dv, dpos, dts = _attention_backward(q, k, v, offsets, timestamps, num_targets, pos_weights, time_weights,
                                                max_len, max_seq_len, alpha, kernel, grad)
    rows = vqk.shape[0]
    return jnp.concatenate([d.reshape(rows, -1) for d in (dv, dq, dk)], axis=1), jnp.concatenate([dpos, dts])


_packed_jagged_attention = jax_op("torch_tpu_pallas::hstu_packed_jagged_attention", _packed_attention,
                                  backward=_packed_attention_backward, differentiable=["vqk", "biases"])


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
           num_targets: torch.Tensor, pos_weights: torch.Tensor, time_weights: torch.Tensor, kernel: str,
           max_seq_len: int) -> None:
    name = "jagged_hstu_attention"
    if q.dim() != 3 or q.shape != k.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"{name}: q and k must be [T, H, Dqk] and v [T, H, Dv]; got q {list(q.shape)}, "
                         f"k {list(k.shape)}, v {list(v.shape)}")
    for label, t in (("q", q), ("k", k), ("v", v)):
        _check_dtype(name, label, t)
    for label, t in (("pos_weights", pos_weights), ("time_weights", time_weights)):
        if t.dim() != 1 or t.shape[0] < 1:
            raise ValueError(f"{name}: {label} must be a non-empty 1-D table, got {list(t.shape)}")
    _check_layout(name, q.shape[0], offsets, timestamps, num_targets, kernel, max_seq_len)


def _check_dtype(name: str, label: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"{name}: {label} is {t.dtype}; expected torch.float32 or torch.bfloat16")


def _check_layout(name: str, rows: int, offsets: torch.Tensor, timestamps: torch.Tensor, num_targets: torch.Tensor,
                  kernel: str, max_seq_len: int) -> None:
    if offsets.dim() != 1 or offsets.shape[0] < 1:
        raise ValueError(f"{name}: offsets must be 1-D [B + 1], got {list(offsets.shape)}")
    if timestamps.shape not in ((rows,), (rows, 2)):
        raise ValueError(f"{name}: timestamps must be [T] = [{rows}] or [T, 2] = [{rows}, 2], got "
                         f"{list(timestamps.shape)}")
    if num_targets.shape != (offsets.shape[0] - 1,):
        raise ValueError(f"{name}: num_targets must be [B] = [{offsets.shape[0] - 1}], got {list(num_targets.shape)}")
    if kernel not in KERNELS:
        raise ValueError(f"{name}: kernel={kernel!r}; expected one of {list(KERNELS)}")
    if max_seq_len < 1:
        raise ValueError(f"{name}: max_seq_len={max_seq_len}; it must be >= 1")


def _host(t: torch.Tensor) -> np.ndarray:
    """A small tensor's values on the host, read once (a tpu tensor's computed value, under
    defer_and_fuse too)."""
    return np.asarray(concrete_value(t)) if type(t) is TpuTensor else t.detach().cpu().numpy()


def _check_lengths(name: str, offsets: torch.Tensor, num_targets: torch.Tensor, max_len: int, rows: int) -> None:
    """``max_len >= 1`` and (host reads of two small inputs) the offsets rise within the ``rows``
    events, every sequence fits ``max_len`` and holds its candidates. Under ``torch.compile`` the
    values are read at a graph break (the op then runs eagerly): a sequence above ``max_len`` would
    otherwise be cut to it (so ``fullgraph=True`` refuses the call: compile the code around it).
    Other traces (``train_step``) have no values: there the op's output is NaN when a sequence
    does not fit (:func:`_attention`)."""
    if max_len < 1:
        raise ValueError(f"{name}: max_len={max_len}; it must be >= 1")
    if torch.compiler.is_dynamo_compiling():
        _check_values_outside_the_graph(name, offsets, num_targets, max_len, rows)
    elif not torch.compiler.is_compiling() and not _fake(offsets):
        _check_values(name, offsets, num_targets, max_len, rows)


def _fake(t: torch.Tensor) -> bool:
    """Whether ``t`` has no values: a fake tensor of ``train_step``'s trace."""
    from torch._subclasses.fake_tensor import is_fake

    return type(t) is not TpuTensor and is_fake(t)


def _check_values(name: str, offsets: torch.Tensor, num_targets: torch.Tensor, max_len: int, rows: int) -> None:
    host_offsets = _host(offsets)
    lengths = np.diff(host_offsets)
    if lengths.size and lengths.min() < 0:
        at = int(np.argmax(lengths < 0))
        raise ValueError(f"{name}: offsets must not decrease; offsets[{at + 1}]={int(host_offsets[at + 1])} is below "
                         f"offsets[{at}]={int(host_offsets[at])}")
    if host_offsets[0] < 0 or host_offsets[-1] > rows:
        raise ValueError(f"{name}: offsets run from {int(host_offsets[0])} to {int(host_offsets[-1])}; they must lie "
                         f"in [0, {rows}] (the events' rows)")
    if lengths.size and lengths.max() > max_len:
        raise ValueError(f"{name}: a sequence has {int(lengths.max())} events, above "
                         f"max_len={max_len}; pass a larger max_len (bucket)")
    targets = _host(num_targets)
    if ((targets < 0) | (targets > lengths)).any():
        raise ValueError(f"{name}: num_targets must lie in [0, the sequence's length]")


_check_values_outside_the_graph = torch.compiler.disable(_check_values)


@traceable
def jagged_hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                          timestamps: torch.Tensor, pos_weights: torch.Tensor, time_weights: torch.Tensor, *,
                          max_len: int, max_seq_len: int, alpha: float, num_targets: torch.Tensor | None = None,
                          kernel: str = "xla") -> torch.Tensor:
    """HSTU attention of jagged tpu tensors (``tiles``' equations): ``[T, H, Dv]``.

    ``offsets [B + 1]`` delimit the sequences; ``timestamps`` (integer seconds) give the time-gap
    biases: ``[T]``, each event's time, or ``[T, 2]``, the time each event queries at (row ``r``'s
    gap to column ``c`` is ``timestamps[r, 0] - timestamps[c, 1]``; the HSTU paper's code queries
    at the next event's time) then its own; ``num_targets [B]`` (default none) counts each
    sequence's trailing candidates, which attend to the history and themselves only. ``max_len``
    bounds every length (the compiled shape: pass a bucket); ``max_seq_len`` is the normalizer N;
    ``alpha`` scales ``q k``.
    ``kernel``: ``"xla"`` (every platform) or ``"pallas"`` (interpret mode off TPU).
    Differentiable in q, k, v and both bias tables."""
    if num_targets is None:
        num_targets = torch.zeros(offsets.shape[0] - 1, dtype=torch.int32, device=offsets.device)
    _check(q, k, v, offsets, timestamps, num_targets, pos_weights, time_weights, kernel, max_seq_len)
    _check_lengths("jagged_hstu_attention", offsets, num_targets, max_len, q.shape[0])
    return _jagged_attention(q, k, v, offsets, timestamps, num_targets, pos_weights, time_weights, max_len,
                             max_seq_len, float(alpha), kernel)


@traceable
def packed_jagged_hstu_attention(vqk: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
                                 pos_weights_and_time_weights: torch.Tensor, *, heads: int, qk_dim: int,
                                 pos_buckets: int, max_len: int, max_seq_len: int, alpha: float,
                                 num_targets: torch.Tensor, kernel: str = "xla") -> torch.Tensor:
    """:func:`jagged_hstu_attention` of packed inputs, for a stack off the tpu device that sends them
    over (one copy each way instead of five): ``vqk [T, H * (Dv + 2 Dqk)]`` holds V, Q then K
    (the STU layer's columns), ``pos_weights_and_time_weights`` the position table (its first
    ``pos_buckets`` entries) then the time-bucket table. Returns ``[T, H, Dv]``; the gradients come
    packed the same way. Not part of the TorchTPU API."""
    name = "packed_jagged_hstu_attention"
    width = vqk.shape[-1] - 2 * heads * qk_dim if vqk.dim() == 2 else -1
    if vqk.dim() != 2 or heads < 1 or qk_dim < 1 or width < heads or width % heads:
        raise ValueError(f"{name}: vqk must be [T, heads * (v_dim + 2 * qk_dim)] with heads={heads}, "
                         f"qk_dim={qk_dim}; got {list(vqk.shape)}")
    _check_dtype(name, "vqk", vqk)
    biases = pos_weights_and_time_weights
    if biases.dim() != 1 or not 0 < pos_buckets < biases.shape[0]:
        raise ValueError(f"{name}: pos_weights_and_time_weights must be 1-D, longer than pos_buckets={pos_buckets}; "
                         f"got {list(biases.shape)}")
    _check_layout(name, vqk.shape[0], offsets, timestamps, num_targets, kernel, max_seq_len)
    _check_lengths(name, offsets, num_targets, max_len, vqk.shape[0])
    return _packed_jagged_attention(vqk, offsets, timestamps, num_targets, biases, heads, qk_dim, pos_buckets,
                                    max_len, max_seq_len, float(alpha), kernel)
