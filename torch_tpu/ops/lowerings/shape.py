"""Shape lowerings with value semantics (graph executors); eager dispatch aliases views itself."""

from __future__ import annotations

import math

import numpy as np
import torch

from torch_tpu.ops.lowerings._common import cast, result_dtype, wrap_dim, wrap_dims
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax, jnp

aten = torch.ops.aten
lax = jax.lax


def _infer_size(size, numel):
    size = list(size)
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = numel // known if known else 0
    return tuple(size)


@register_lowering(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view(self, size):
    return self.reshape(_infer_size(size, self.size))


@register_lowering(aten.t.default)
def t(self):
    return self.T if self.ndim == 2 else self


@register_lowering(aten.transpose.int)
def transpose(self, dim0, dim1):
    dim0, dim1 = wrap_dim(dim0, self.ndim), wrap_dim(dim1, self.ndim)
    return jnp.swapaxes(self, dim0, dim1) if self.ndim else self


@register_lowering(aten.permute.default)
def permute(self, dims):
    return jnp.transpose(self, wrap_dims(dims, self.ndim)) if self.ndim else self


@register_lowering(aten.expand.default)
def expand(self, size, *, implicit=False):
    lead = len(size) - self.ndim
    shape = tuple(self.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(self, shape)


@register_lowering(aten.select.int)
def select(self, dim, index):
    return lax.index_in_dim(self, index % self.shape[dim], axis=dim, keepdims=False)


@register_lowering(aten.slice.Tensor)
def slice_(self, dim=0, start=None, end=None, step=1):
    index = [slice(None)] * self.ndim
    index[dim] = slice(start, end, step)
    return self[tuple(index)]


@register_lowering(aten.slice_scatter.default)
def slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    index = [slice(None)] * self.ndim
    index[dim % self.ndim] = slice(start, end, step)
    return self.at[tuple(index)].set(src.astype(self.dtype))


@register_lowering(aten.squeeze.default)
def squeeze(self):
    return jnp.squeeze(self)


@register_lowering(aten.squeeze.dim, aten.squeeze.dims)
def squeeze_dim(self, dim):
    dims = [dim] if isinstance(dim, int) else dim
    if not self.ndim:
        return self
    axes = tuple(d for d in wrap_dims(dims, self.ndim) if self.shape[d] == 1)
    return jnp.squeeze(self, axes) if axes else self


@register_lowering(aten.unsqueeze.default)
def unsqueeze(self, dim):
    return jnp.expand_dims(self, dim % (self.ndim + 1))


@register_lowering(aten.alias.default, aten.detach.default, aten.lift_fresh.default)
def alias(self):
    return self


@register_lowering(aten.clone.default, aten.detach_copy.default)
def clone(self, *, memory_format=None):
    return self  # arrays are immutable: sharing the value is a copy


@register_lowering(aten.as_strided.default)
def as_strided(self, size, stride, storage_offset=None):
    from torch_tpu.runtime.tensor import index_vector

    idx = index_vector(tuple(size), tuple(stride), storage_offset or 0, self.size)
    return self.reshape(-1)[idx].reshape(tuple(size))


@register_lowering(aten.unfold.default)
def unfold(self, dimension, size, step):
    if self.ndim == 0:  # torch's one window of a 0-d tensor: 1-d, size elements (0 or 1)
        return jnp.broadcast_to(self, (size,))
    d = wrap_dim(dimension, self.ndim)
    n = (self.shape[d] - size) // step + 1
    starts = np.arange(n) * step
    windows = np.asarray(starts)[:, None] + np.arange(size)[None, :]
    out = jnp.take(self, jnp.asarray(windows.reshape(-1)), axis=d)
    out = out.reshape(self.shape[:d] + (n, size) + self.shape[d + 1:])
    return jnp.moveaxis(out, d + 1, -1)


@register_lowering(aten.diagonal.default)
def diagonal(self, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(self, offset, dim1, dim2)


@register_lowering(aten.unbind.int)
def unbind(self, dim=0):
    return [lax.index_in_dim(self, i, axis=dim, keepdims=False) for i in range(self.shape[dim])]


@register_lowering(aten.split.Tensor)
def split(self, split_size, dim=0):
    n = self.shape[dim]
    sizes = [min(split_size, n - s) for s in range(0, n, split_size)] if split_size else [n]
    return split_with_sizes(self, sizes or [0], dim)


@register_lowering(aten.split_with_sizes.default)
def split_with_sizes(self, split_sizes, dim=0):
    offsets = np.cumsum([0] + list(split_sizes))
    return [lax.slice_in_dim(self, int(a), int(b), axis=dim) for a, b in zip(offsets[:-1], offsets[1:])]


@register_lowering(aten.cat.default)
def cat(tensors, dim=0):
    # torch skips legacy empty 1-D tensors when concatenating higher-rank ones.
    kept = [x for x in tensors if not (x.ndim == 1 and x.shape[0] == 0)] or list(tensors[:1])
    dt = result_dtype(*kept)
    ref = next((x for x in kept if x.ndim), kept[0])
    if ref.ndim == 0:
        raise ValueError("zero-dimensional tensor cannot be concatenated")
    return jnp.concatenate([cast(x, dt) for x in kept], axis=dim % ref.ndim)


@register_lowering(aten.stack.default)
def stack(tensors, dim=0):
    dt = result_dtype(*tensors)
    return jnp.stack([cast(x, dt) for x in tensors], axis=dim % (tensors[0].ndim + 1))


def _replication_pad_backward(n: int):
    def replication_pad_backward(grad_output, self, padding):
        """The VJP of edge padding of the last ``n`` dims (``padding``: torch's last-dim-first pairs;
        negative entries crop)."""
        def pad(x):
            low = [max(p, 0) for p in padding[0::2]][::-1]
            high = [max(p, 0) for p in padding[1::2]][::-1]
            padded = jnp.pad(x, [(0, 0)] * (x.ndim - n) + list(zip(low, high)), mode="edge")
            crop = tuple(slice(max(-lo, 0), padded.shape[x.ndim - n + i] - max(-hi, 0))
                         for i, (lo, hi) in enumerate(zip(padding[0::2][::-1], padding[1::2][::-1])))
            return padded[(Ellipsis, *crop)]

        _, pullback = jax.vjp(pad, self)
        return pullback(grad_output.astype(self.dtype))[0]

    return replication_pad_backward


for _n, _op in ((1, aten.replication_pad1d_backward.default), (2, aten.replication_pad2d_backward.default),
                (3, aten.replication_pad3d_backward.default)):
    register_lowering(_op)(_replication_pad_backward(_n))


@register_lowering(aten.constant_pad_nd.default)
def constant_pad_nd(self, pad, value=0):
    config = [(0, 0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        config[self.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(self, cast(value, self.dtype), config)


@register_lowering(aten.flip.default)
def flip(self, dims):
    dims = wrap_dims(dims, self.ndim)
    return jnp.flip(self, dims) if self.ndim else self


@register_lowering(aten.roll.default)
def roll(self, shifts, dims=()):
    if not dims:
        return jnp.roll(self.reshape(-1), shifts).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), tuple(dims))


@register_lowering(aten.repeat.default)
def repeat(self, repeats):
    lead = len(repeats) - self.ndim
    x = self.reshape((1,) * lead + self.shape)
    return jnp.tile(x, tuple(repeats))


@register_lowering(aten.tril.default)
def tril(self, diagonal=0):
    return jnp.tril(self, diagonal)


@register_lowering(aten.triu.default)
def triu(self, diagonal=0):
    return jnp.triu(self, diagonal)
