"""Pooling lowerings: max (with indices), average and adaptive pooling over 1-3 trailing spatial dims.

Every output's window is gathered from the flattened input plane with one ``[outputs, slots]``
index table built from static shapes (invalid padding slots masked) and reduced over its slots.
Max pooling returns the chosen slot's flat plane index, which is what torch's ``indices`` hold
(first maximum in row-major window order, the last NaN when the window holds NaNs, as CPU torch).
Backwards: max pooling scatters the gradient to ``indices``; average pooling is linear, its
backward is the VJP of the forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from torch_tpu.ops.lowerings._common import upcast
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax, jnp

aten = torch.ops.aten


class _Windows:
    """Window positions along one dim: ``index[o, j]`` (clamped into range) and ``valid[o, j]``."""

    def __init__(self, starts: np.ndarray, sizes: np.ndarray, length: int, step: int = 1) -> None:
        width = int(sizes.max()) if sizes.size else 0
        j = np.arange(width)
        positions = starts[:, None] + j[None, :] * step
        self.valid = (j[None, :] < sizes[:, None]) & (positions >= 0) & (positions < length)
        self.index = np.clip(positions, 0, max(length - 1, 0))


def _table(windows: Sequence[_Windows], sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Flat plane index and validity of every (output, window slot), both ``[outputs, slots]``,
    outputs and slots in row-major order."""
    n = len(windows)
    index = np.zeros((1,) * (2 * n), np.int64)
    valid = np.ones((1,) * (2 * n), bool)
    for d, w in enumerate(windows):
        shape = [1] * (2 * n)
        shape[d], shape[n + d] = w.index.shape
        index = index + w.index.reshape(shape) * math.prod(sizes[d + 1:])
        valid = valid & w.valid.reshape(shape)
    outputs = math.prod(w.index.shape[0] for w in windows)
    return index.reshape(outputs, -1), valid.reshape(outputs, -1)


def _gather(x: jax.Array, windows: Sequence[_Windows]):
    """``x``'s pooled dims as ``[..., outputs, slots]`` window values, with the flat index table,
    validity mask and output shape."""
    n = len(windows)
    lead, sizes = x.shape[: x.ndim - n], x.shape[x.ndim - n:]
    index, valid = _table(windows, sizes)
    flat = x.reshape(lead + (math.prod(sizes),))
    g = jnp.take(flat, jnp.asarray(index.reshape(-1)), axis=-1).reshape(lead + index.shape)
    out_shape = lead + tuple(w.index.shape[0] for w in windows)
    return g, index, valid, out_shape


def _lowest(dtype) -> object:
    return -jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).min


def _window_max(g: jax.Array, valid: np.ndarray | bool) -> tuple[jax.Array, jax.Array]:
    """Max over the last axis (window slots) and the chosen slot: the first maximum, the last NaN."""
    m = jnp.max(jnp.where(valid, g, _lowest(g.dtype)), axis=-1, keepdims=True)
    hit = valid & ((g == m) | (jnp.isnan(g) & jnp.isnan(m)))
    k_first = jnp.argmax(hit, axis=-1)
    k_last = hit.shape[-1] - 1 - jnp.argmax(jnp.flip(hit, axis=-1), axis=-1)
    return m[..., 0], jnp.where(jnp.isnan(m[..., 0]), k_last, k_first)


def _max_with_indices(x: jax.Array, windows: Sequence[_Windows]) -> tuple[jax.Array, jax.Array]:
    """Max over box windows of the last ``len(windows)`` dims, and flat indices into those dims."""
    g, index, valid, out_shape = _gather(x, windows)
    m, k = _window_max(g, valid)
    rows = jnp.arange(index.shape[0])
    flat_index = jnp.asarray(index)[rows, k]
    return m.reshape(out_shape), flat_index.reshape(out_shape)


def _sum(x: jax.Array, windows: Sequence[_Windows]) -> jax.Array:
    g, _, valid, out_shape = _gather(x, windows)
    return jnp.sum(jnp.where(valid, g, jnp.zeros((), g.dtype)), axis=-1).reshape(out_shape)


def _expand(v: Sequence[int] | int, n: int, name: str) -> list[int]:
    v = [v] if isinstance(v, int) else list(v)
    if len(v) == 1:
        v = v * n
    if len(v) != n:
        raise ValueError(f"pooling: {name} must have 1 or {n} elements, got {v}")
    return v


def _pool_length(length: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's pooling_output_shape."""
    span = length + 2 * p - d * (k - 1) - 1
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= length + p:
        out -= 1
    return out


def _regular(x, n, kernel_size, stride, padding, dilation, ceil_mode) -> list[_Windows]:
    kernel = _expand(kernel_size, n, "kernel_size")
    stride = _expand(stride, n, "stride") if stride else kernel
    padding, dilation = _expand(padding, n, "padding"), _expand(dilation, n, "dilation")
    windows = []
    for length, k, s, p, d in zip(x.shape[-n:], kernel, stride, padding, dilation):
        if p > k // 2:
            raise ValueError(f"pad should be at most half of effective kernel size, got pad={p}, kernel={k}")
        out = _pool_length(length, k, s, p, d, ceil_mode)
        windows.append(_Windows(np.arange(out) * s - p, np.full(out, k), length, d))
    return windows


def _adaptive(x, output_size) -> list[_Windows]:
    windows = []
    for length, out in zip(x.shape[-len(output_size):], output_size):
        o = np.arange(out)
        starts = (o * length) // out
        ends = -((-(o + 1) * length) // out)
        windows.append(_Windows(starts, ends - starts, length))
    return windows


def _max_pool(n):
    def max_pool_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        return _max_with_indices(self, _regular(self, n, kernel_size, stride, padding, dilation, ceil_mode))

    return max_pool_with_indices


def _scatter_backward(grad_output, self, indices, n):
    """Gradient of a max pool over the last ``n`` dims: each output's gradient added at its index."""
    lead = self.shape[: self.ndim - n]
    rows = math.prod(lead)
    plane = math.prod(self.shape[self.ndim - n:])
    g = grad_output.reshape(rows, -1)
    ix = indices.reshape(rows, -1)
    out = jnp.zeros((rows, plane), upcast(g).dtype).at[jnp.arange(rows)[:, None], ix].add(upcast(g))
    return out.astype(grad_output.dtype).reshape(self.shape)


def _avg(x, windows, divisor):
    total = _sum(upcast(x), windows)
    if jnp.issubdtype(x.dtype, jnp.integer):
        return jax.lax.div(total, jnp.broadcast_to(jnp.asarray(divisor, total.dtype), total.shape))
    return (total / jnp.asarray(divisor, total.dtype)).astype(x.dtype)


def _avg_divisor(x, n, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """The window sizes torch divides by, as an array broadcasting over the pooled dims."""
    kernel = _expand(kernel_size, n, "kernel_size")
    stride = _expand(stride, n, "stride") if stride else kernel
    padding = _expand(padding, n, "padding")
    if divisor_override:
        return np.asarray(divisor_override)
    divisor = np.ones((), np.int64)
    for length, k, s, p in zip(x.shape[-n:], kernel, stride, padding):
        starts = np.arange(_pool_length(length, k, s, p, 1, ceil_mode)) * s - p
        if count_include_pad:
            sizes = np.minimum(starts + k, length + p) - starts
        else:
            sizes = np.minimum(starts + k, length) - np.maximum(starts, 0)
        divisor = divisor[..., None] * sizes
    return divisor


def _avg_pool(n):
    def avg_pool(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                 divisor_override=None):
        windows = _regular(self, n, kernel_size, stride, padding, 1, ceil_mode)
        divisor = _avg_divisor(self, n, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        return _avg(self, windows, divisor)

    return avg_pool


def _adaptive_avg_pool(self, output_size):
    windows = _adaptive(self, output_size)
    divisor = np.ones((), np.int64)
    for w in windows:
        divisor = divisor[..., None] * w.valid.sum(axis=1)
    return _avg(self, windows, divisor)


def _vjp(forward, grad_output, self):
    _, pullback = jax.vjp(forward, self)
    return pullback(grad_output.astype(self.dtype))[0]


for _n, _max_op, _max_bw, _avg_op, _avg_bw in (
    (2, aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default,
     aten.avg_pool2d.default, aten.avg_pool2d_backward.default),
    (3, aten.max_pool3d_with_indices.default, aten.max_pool3d_with_indices_backward.default,
     aten.avg_pool3d.default, aten.avg_pool3d_backward.default),
):
    register_lowering(_max_op)(_max_pool(_n))
    register_lowering(_avg_op)(_avg_pool(_n))

    def _max_pool_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices, n=_n):
        return _scatter_backward(grad_output, self, indices, n)

    def _avg_pool_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                           divisor_override, forward=_avg_pool(_n)):
        return _vjp(lambda x: forward(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                      divisor_override), grad_output, self)

    register_lowering(_max_bw)(_max_pool_backward)
    register_lowering(_avg_bw)(_avg_pool_backward)


def _adaptive_lowerings(n):
    def adaptive_avg_pool_backward(grad_output, self):
        return _vjp(lambda x: _adaptive_avg_pool(x, grad_output.shape[-n:]), grad_output, self)

    def adaptive_max_pool(self, output_size):
        return _max_with_indices(self, _adaptive(self, _expand(output_size, n, "output_size")))

    def adaptive_max_pool_backward(grad_output, self, indices):
        return _scatter_backward(grad_output, self, indices, n)

    return adaptive_avg_pool_backward, adaptive_max_pool, adaptive_max_pool_backward


for _n, _ops in (
    (2, (aten._adaptive_avg_pool2d_backward.default, aten.adaptive_max_pool2d.default,
         aten.adaptive_max_pool2d_backward.default)),
    (3, (aten._adaptive_avg_pool3d_backward.default, aten.adaptive_max_pool3d.default,
         aten.adaptive_max_pool3d_backward.default)),
):
    for _op, _fn in zip(_ops, _adaptive_lowerings(_n)):
        register_lowering(_op)(_fn)


@register_lowering(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool(self, output_size):
    return _adaptive_avg_pool(self, output_size)


def _fractional_starts(sample: jax.Array, length: int, out: int, k: int) -> jax.Array:
    """CPU's window starts along one dim from each plane's sample ``u`` (``[planes]``), computed in
    the input's dtype: ``int((i + u) * alpha) - int(u * alpha)``, the last window at the end."""
    alpha = jnp.asarray(length - k, sample.dtype) / jnp.asarray(max(out - 1, 1), sample.dtype)
    i = jnp.arange(out - 1, dtype=sample.dtype)
    starts = ((i + sample[:, None]) * alpha).astype(jnp.int32) - (sample[:, None] * alpha).astype(jnp.int32)
    return jnp.concatenate([starts, jnp.full((sample.shape[0], 1), length - k, jnp.int32)], axis=1)


def _fractional_max_pool(n: int, sample_order: tuple[int, ...]):
    """``sample_order[d]``: which of a plane's random samples drives spatial dim ``d``."""

    def fractional_max_pool(self, kernel_size, output_size, random_samples):
        kernel, out = _expand(kernel_size, n, "kernel_size"), _expand(output_size, n, "output_size")
        lead, sizes = self.shape[: self.ndim - n], self.shape[self.ndim - n:]
        for length, k, o in zip(sizes, kernel, out):
            if o + k - 1 > length:
                raise ValueError(f"fractional_max_pool{n}d: output size {o} with pool size {k} is too large "
                                 f"for an input of size {length}")
        planes = math.prod(lead)
        # [batch, channels, n] samples; an unbatched input reads the first batch's, as CPU does
        batch = self.shape[0] if self.ndim == n + 2 else 1
        samples = random_samples[:batch].reshape(planes, n)
        flat = jnp.zeros((planes,) + (1,) * (2 * n), jnp.int32)
        for d in range(n):  # flat plane index of (plane, output..., slot...)
            positions = _fractional_starts(samples[:, sample_order[d]], sizes[d], out[d], kernel[d])[..., None] \
                + jnp.arange(kernel[d], dtype=jnp.int32)
            shape = [planes] + [1] * (2 * n)
            shape[1 + d], shape[1 + n + d] = out[d], kernel[d]
            flat = flat + positions.reshape(shape) * math.prod(sizes[d + 1:])
        index = flat.reshape(planes, math.prod(out), math.prod(kernel))
        values = jnp.take_along_axis(self.reshape(planes, 1, -1), index, axis=-1)
        m, k = _window_max(values, True)
        chosen = jnp.take_along_axis(index, k[..., None], axis=-1)[..., 0]
        out_shape = tuple(lead) + tuple(out)
        return m.reshape(out_shape), chosen.astype(jnp.int64).reshape(out_shape)

    def fractional_max_pool_backward(grad_output, self, kernel_size, output_size, indices):
        return _scatter_backward(grad_output, self, indices, n)

    return fractional_max_pool, fractional_max_pool_backward


# each plane's samples: 2d (w, h), 3d (t, h, w), as CPU torch reads them
for _n, _order, _ops in (
    (2, (1, 0), (aten.fractional_max_pool2d.default, aten.fractional_max_pool2d_backward.default)),
    (3, (0, 1, 2), (aten.fractional_max_pool3d.default, aten.fractional_max_pool3d_backward.default)),
):
    for _op, _fn in zip(_ops, _fractional_max_pool(_n, _order)):
        register_lowering(_op)(_fn)
