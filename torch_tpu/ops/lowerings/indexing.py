"""Gather/scatter-style lowerings: advanced indexing, index_select, gather, scatter, embedding."""

from __future__ import annotations

import warnings
import weakref
from typing import NamedTuple

import numpy as np
import torch

from torch_tpu.ops.lowerings._common import cast, is_one, wrap_dim
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import ARRAY_TYPE, jax, jnp

aten = torch.ops.aten


def _is_mask(index):
    """A boolean mask among advanced indices; torch still reads uint8 ones as masks (deprecated)."""
    return getattr(index, "dtype", None) in (np.bool_, np.uint8)


def _index_tuple(indices):
    """Advanced indices as a JAX index: None as a full slice, uint8 masks as boolean ones (eager
    dispatch gives torch's deprecation warnings, ``check_bounds``: a lowering runs once per trace)."""
    return tuple(slice(None) if i is None else i != 0 if i.dtype == np.uint8 else i for i in indices)


@register_lowering(aten.index.Tensor)
def index(self, indices):
    if not indices:  # the ValueError becomes CPU's IndexError (dispatch)
        raise ValueError("at least one index must be provided")
    # Boolean-mask indices give value-dependent shapes: fine eagerly, not under jax.jit.
    return self[_index_tuple(indices)]


def index_traced_as(self, indices, shape):
    """``aten.index.Tensor`` in a compiled graph whose output ``shape`` PyTorch resolved while tracing
    although it holds boolean masks (``index_put``'s backward indexes the gradient by the mask: as
    many rows as ``values`` had). Under jit a mask cannot select by value: it becomes that many
    coordinates of its set elements."""
    indices = _index_tuple(indices)
    if not any(_is_mask(i) for i in indices):
        return self[indices]
    probe = [jax.eval_shape(lambda s, n=n: s[_mask_coords(s, indices, n)], self).shape for n in (1, 2)]
    masked_dim = next(d for d, (a, b) in enumerate(zip(*probe)) if a != b)
    return self[_mask_coords(self, indices, shape[masked_dim])]


# JAX scatters have no bool arithmetic; on 0/1 bytes, torch's bool sum is max (or), product min (and)
_BOOL_MODES = {"set": "set", "add": "max", "multiply": "min", "max": "max", "min": "min"}


def _update(target, coords, mode, values):
    """``target.at[coords].<mode>(values)`` with torch's dtype rules, bool included."""
    if target.dtype != np.bool_ or mode == "set":
        return getattr(target.at[coords], mode)(cast(values, target.dtype))
    as_bytes = getattr(target.astype(jnp.uint8).at[coords], _BOOL_MODES[mode])(cast(values, jnp.uint8))
    return as_bytes != 0


def _mask_coords(self, indices, count):
    """``indices`` with each boolean mask as ``count`` coordinates of its set elements, padded with
    out-of-bounds ones (JAX scatters drop those updates)."""
    coords, dim = [], 0
    for i in indices:
        if _is_mask(i):
            coords.extend(jnp.nonzero(i, size=count, fill_value=self.shape[dim:dim + i.ndim]))
            dim += i.ndim
        else:
            coords.append(i)
            dim += 1
    return tuple(coords)


def _put_coords(self, indices, values):
    """index_put's coordinates with a static count for masks (under jit the number of set elements is
    unknown): the count ``values`` has along the masked dim, or the mask's size when it broadcasts there."""
    indices = _index_tuple(indices)
    if not any(_is_mask(i) for i in indices):
        return indices
    count = max(i.size for i in indices if _is_mask(i))
    # the masked dim is the one whose length follows the count
    shapes = [jax.eval_shape(lambda s, n=n: s[_mask_coords(s, indices, n)], self).shape for n in (count, count + 1)]
    masked_dim = next(d for d, (a, b) in enumerate(zip(*shapes)) if a != b) - len(shapes[0])
    if values.ndim >= -masked_dim and values.shape[masked_dim] != 1:
        count = values.shape[masked_dim]
    return _mask_coords(self, indices, count)


@register_lowering(aten.index_put.default, aten._index_put_impl.default)
def index_put(self, indices, values, accumulate=False, unsafe=False):
    if len(indices) == 1 and getattr(indices[0], "dtype", None) == np.uint8 and values.ndim == 0 and not accumulate:
        raise ValueError("index_put_ of a 0-d value by one mask runs masked_fill_, which refuses uint8 masks (CPU)")
    return _update(self, _put_coords(self, indices, values), "add" if accumulate else "set", values)


@register_lowering(aten.index_select.default)
def index_select(self, dim, index):
    if self.ndim == 0:
        return self
    return jnp.take(self, index.reshape(-1), axis=dim)


def _check_index_shape(self, dim, index, src=None):
    """CPU's shape checks of gather / scatter (a ValueError: eager dispatch raises CPU's exception)."""
    if index.size == 0 or self.ndim == 0 or index.ndim == 0:
        return
    if index.ndim != self.ndim:
        raise ValueError(f"index of {index.ndim} dims for a tensor of {self.ndim}: they must have the same number")
    for d, n in enumerate(index.shape):
        if (d != dim and n > self.shape[d]) or (getattr(src, "ndim", 0) and n > src.shape[d]):
            raise ValueError(f"index of shape {index.shape} is larger than self {self.shape} (apart from dim {dim}) "
                             f"or than src")


def _grids(index, dim):
    """Full coordinates for gather/scatter: the index itself along ``dim``, iota elsewhere."""
    coords = list(jnp.indices(index.shape, sparse=True))
    coords[dim] = index
    return tuple(coords)


@register_lowering(aten.gather.default)
def gather(self, dim, index, *, sparse_grad=False):
    # torch treats 0-d operands as 1-d, and an empty index needs no dims to match
    if index.size == 0:
        return jnp.zeros(index.shape, self.dtype)
    source = self.reshape(1) if self.ndim == 0 else self
    coords = index.reshape(1) if index.ndim == 0 else index
    dim = wrap_dim(dim, source.ndim)
    _check_index_shape(self, dim, index)
    return source[_grids(coords, dim)].reshape(index.shape)


def _scatter(self, dim, index, src, mode):
    if index.size == 0:
        return self
    target = self.reshape(1) if self.ndim == 0 else self
    dim = wrap_dim(dim, target.ndim)
    _check_index_shape(self, dim, index, src)
    index = index.reshape(1) if index.ndim == 0 else index
    if hasattr(src, "ndim") and src.ndim:
        src = src[tuple(slice(0, s) for s in index.shape)]
    return _update(target, _grids(index, dim), mode, src).reshape(self.shape)


@register_lowering(aten.scatter.src, aten.scatter.value)
def scatter(self, dim, index, src):
    return _scatter(self, dim, index, src, "set")


@register_lowering(aten.scatter_add.default)
def scatter_add(self, dim, index, src):
    return _scatter(self, dim, index, src, "add")


_REDUCE_MODES = {"sum": "add", "prod": "multiply", "amax": "max", "amin": "min"}


@register_lowering(aten.scatter_reduce.two)
def scatter_reduce(self, dim, index, src, reduce, *, include_self=True):
    if reduce == "mean":
        ones = jnp.ones(index.shape, self.dtype)
        base = self if include_self else jnp.zeros_like(self)
        counts = _scatter(jnp.full(self.shape, 1 if include_self else 0, self.dtype), dim, index, ones, "add")
        total = _scatter(base, dim, index, src, "add")
        inexact = jnp.issubdtype(self.dtype, jnp.inexact)
        mean = total / jnp.maximum(counts, 1) if inexact else total // jnp.maximum(counts, 1)
        return jnp.where(counts > 0, mean, self).astype(self.dtype)
    mode = _REDUCE_MODES[reduce]
    if include_self:
        return _scatter(self, dim, index, src, mode)
    identity = {"add": 0, "multiply": 1, "max": -np.inf, "min": np.inf}[mode]
    if self.dtype == np.bool_:
        identity = mode in ("multiply", "min")
    elif not jnp.issubdtype(self.dtype, jnp.inexact) and mode in ("max", "min"):
        info = jnp.iinfo(self.dtype)
        identity = info.min if mode == "max" else info.max
    touched = _scatter(jnp.zeros(self.shape, jnp.bool_), dim, index, jnp.ones(index.shape, jnp.bool_), "set")
    reduced = _scatter(jnp.full(self.shape, identity, self.dtype), dim, index, src, mode)
    return jnp.where(touched, reduced, self)


@register_lowering(aten.index_add.default)
def index_add(self, dim, index, source, *, alpha=1):
    src = source if is_one(alpha) else source * cast(alpha, source.dtype)
    if self.ndim == 0:
        return self + cast(jnp.sum(src), self.dtype)
    dim = wrap_dim(dim, self.ndim)
    if index.ndim > 1 or (src.ndim and index.size != src.shape[dim]):
        raise ValueError(f"index_add_: {index.size} indices for a source of {src.shape[dim]} along dim {dim}")
    coords = [slice(None)] * self.ndim
    coords[dim] = index
    return _update(self, tuple(coords), "add", src)


@register_lowering(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@register_lowering(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat_idx = indices.reshape(-1)
    grad = grad_output.reshape(flat_idx.size, -1)
    keep = flat_idx != padding_idx
    grad = jnp.where(keep[:, None], grad, 0)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), grad.dtype).at[flat_idx].add(1)
        grad = grad / counts[flat_idx][:, None]
    return jnp.zeros((num_weights, grad.shape[1]), grad.dtype).at[flat_idx].add(grad)


@register_lowering(aten.nonzero.default, static_shape=False)
def nonzero(self):
    return jnp.stack(jnp.nonzero(self), axis=-1).astype(jnp.int64) if self.ndim else (
        jnp.zeros((1 if bool(self) else 0, 0), jnp.int64))


@register_lowering(aten.masked_select.default, static_shape=False)
def masked_select(self, mask):
    x, m = jnp.broadcast_arrays(self, mask)
    return x[m]


@register_lowering(aten._unique2.default, static_shape=False)
def unique2(self, sorted=True, return_inverse=False, return_counts=False):
    values, inverse, counts = jnp.unique(self.reshape(-1), return_inverse=True, return_counts=True)
    inverse = inverse.reshape(self.shape).astype(jnp.int64) if return_inverse else jnp.zeros((0,), jnp.int64)
    counts = counts.astype(jnp.int64) if return_counts else jnp.zeros((0,), jnp.int64)
    return values, inverse, counts


# --- bounds checks (eager) -------------------------------------------------------------------------
# JAX gathers clamp (or fill) out-of-range indices and its scatters drop them, silently. Eager
# dispatch therefore checks index values on the host before running these ops, in every mode,
# raising the exception type CPU torch raises for the op. Compiled graphs do not
# (docs/architecture/torch_tpu_device.md).


class _IndexBounds(NamedTuple):
    data: int  # position of the indexed tensor
    index: int  # position of the index tensor (of the index list for index / index_put)
    dim: int | None  # position of the dim argument; None: the list's own dims (index), or dim 0
    negative: bool  # whether -size <= index < 0 counts from the end
    error: type[Exception]
    words: str = "index {bad} is out of bounds for dimension {dim} with size {size}"  # CPU's message
    vector: tuple[type[Exception], str] | None = None  # CPU's (error, message) when the data is 0-/1-D


_OUT_OF_SELF = "index out of range in self (index {bad} is out of bounds for dimension {dim} with size {size})"
_BAG = ("embedding_bag: Expected idx >= 0 && idx < num_embeddings but found idx to be {bad} (a value of input "
        "not in the valid range [0, {size}))")


_INDEX_BOUNDS = {
    "aten::index": _IndexBounds(0, 1, None, True, IndexError),
    "aten::index_put": _IndexBounds(0, 1, None, True, IndexError),
    "aten::_index_put_impl": _IndexBounds(0, 1, None, True, IndexError),
    "aten::index_select": _IndexBounds(0, 2, 1, False, IndexError, _OUT_OF_SELF),
    "aten::embedding": _IndexBounds(0, 1, None, False, IndexError, _OUT_OF_SELF),
    "aten::_embedding_bag": _IndexBounds(0, 1, None, False, RuntimeError, _BAG),
    "aten::_embedding_bag_forward_only": _IndexBounds(0, 1, None, False, RuntimeError, _BAG),
    "aten::gather": _IndexBounds(0, 2, 1, False, RuntimeError),
    "aten::scatter": _IndexBounds(0, 2, 1, False, RuntimeError),
    "aten::scatter_add": _IndexBounds(0, 2, 1, False, RuntimeError),
    "aten::scatter_reduce": _IndexBounds(0, 2, 1, False, RuntimeError),
    "aten::index_add": _IndexBounds(0, 2, 1, False, RuntimeError, vector=(IndexError, _OUT_OF_SELF)),
}


def has_bounds_check(op) -> bool:
    return op._schema.name in _INDEX_BOUNDS


def _indexed_dims(spec, args):
    """(dim of the indexed tensor, index array) pairs of a call."""
    data, index = args[spec.data], args[spec.index]
    if spec.dim is not None:
        return [(wrap_dim(args[spec.dim], data.ndim), index)]
    if not isinstance(index, (list, tuple)):
        return [(0, index)]
    pairs, dim = [], 0
    for i in index:
        if i is not None and not _is_mask(i):
            pairs.append((dim, i))
        dim += i.ndim if _is_mask(i) else 1
    return [(d, i) for d, i in pairs if d < max(data.ndim, 1)]  # too many indices: the lowering says so


def _check_offsets(args) -> None:
    """CPU's checks of ``embedding_bag``: the ranks of its tensors, then the offsets (1-D indices):
    they start at 0, never decrease and end within the indices (without them the segments silently take other rows)."""
    weight, indices, offsets = args[0], args[1], args[2]
    # CPU checks the ranks before any index value (ahead of the bounds check)
    if indices.ndim not in (1, 2):
        raise RuntimeError(f"input has to be a 1D or 2D Tensor, but got Tensor of dimension {indices.ndim}")
    if offsets.ndim != 1:
        raise RuntimeError(f"offsets has to be a 1D Tensor, but got Tensor of dimension {offsets.ndim}")
    if weight.ndim != 2:
        raise RuntimeError(f"weight has to be a 2D Tensor, but got Tensor of dimension {weight.ndim}")
    if indices.ndim != 1 or offsets.ndim != 1 or not offsets.size:
        return
    first, last, falls = jax.device_get((offsets[0], offsets[-1], jnp.any(offsets[1:] < offsets[:-1])))
    if first != 0:
        raise RuntimeError(f"offsets[0] has to be 0, i.e., the first sequence in the mini-batch has to start from "
                           f"position 0. However, got {int(first)}")
    if last > indices.shape[0]:
        raise RuntimeError(f"offsets[-1] can not be greater than input's length {indices.shape[0]} but got "
                           f"offsets[-1] of {int(last)}")
    if falls:
        raise RuntimeError("embedding_bag: offsets must be non-decreasing (CPU torch rejects them)")


def _check_put_values(args) -> None:
    """CPU's check that ``index_put``'s values broadcast to the indexed shape, which a boolean mask
    makes depend on its count of set elements (the lowering takes the count from the values: a
    wrong count wrote a prefix or nothing)."""
    data, indices, values = args[0], args[1], args[2]
    if values.ndim == 0 or not any(_is_mask(i) for i in indices if i is not None):
        return  # a 0-d value broadcasts anywhere; without masks torch's meta kernel checks
    coords, slots = [], []
    for i in indices:
        if i is None:
            slots.append(None)
        elif _is_mask(i):
            count = int(jax.device_get(i.astype(bool).sum()))
            coords.extend(jax.ShapeDtypeStruct((count,), np.int64) for _ in range(i.ndim))
            slots.extend("coord" for _ in range(i.ndim))
        else:
            coords.append(jax.ShapeDtypeStruct(i.shape, i.dtype))
            slots.append("coord")

    def indexed(x, *c):
        found = iter(c)
        return x[tuple(slice(None) if slot is None else next(found) for slot in slots)]

    shape = tuple(jax.eval_shape(indexed, jax.ShapeDtypeStruct(data.shape, data.dtype), *coords).shape)
    try:
        fits = np.broadcast_shapes(tuple(values.shape), shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to "
                           f"indexing result of shape {list(shape)}")


def _check_embedding_weight(args) -> None:
    """CPU checks the weight's rank before the index values (``jnp.take`` accepts any rank)."""
    if args[0].ndim != 2:
        raise RuntimeError(f"'weight' must be 2-D, got a weight of shape {list(args[0].shape)}")


_VALUE_CHECKS = {
    "aten::embedding": _check_embedding_weight,
    "aten::_embedding_bag": _check_offsets, "aten::_embedding_bag_forward_only": _check_offsets,
    "aten::index_put": _check_put_values, "aten::_index_put_impl": _check_put_values,
}


_MASKED = frozenset({"aten::index", "aten::index_put", "aten::_index_put_impl"})


# (min, max) of index arrays read before, by id: a JAX array never changes, and an index reused
# every call (a module's permutation buffer) would otherwise cost a device-to-host read per call
_EXTREMES: dict[int, tuple[int, int]] = {}


def _extremes(index) -> tuple[int, int]:
    """``index``'s smallest and largest value (read once per concrete array)."""
    key = id(index)
    found = _EXTREMES.get(key)
    if found is not None:
        return found
    found = tuple(jax.device_get((index.min(), index.max())))  # methods: defer_and_fuse arrays too
    if type(index) is ARRAY_TYPE:
        _EXTREMES[key] = found
        weakref.finalize(index, _EXTREMES.pop, key, None)
    return found


def check_bounds(op, args) -> None:
    """Raise the exception CPU torch raises for ``op`` when one of its index arguments (JAX
    arrays, as a lowering gets them) is out of range for the dim it indexes."""
    if op._schema.name in _MASKED and len(args) > 1:  # CPU warns once per uint8 mask, every call
        for _ in range(sum(getattr(i, "dtype", None) == np.uint8 for i in args[1])):
            warnings.warn("indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool instead.",
                          UserWarning, stacklevel=2)
    values = _VALUE_CHECKS.get(op._schema.name)
    if values is not None and len(args) > 1:
        values(args)
    spec = _INDEX_BOUNDS.get(op._schema.name)
    if spec is None or len(args) <= spec.index:
        return
    pairs = [(d, i) for d, i in _indexed_dims(spec, args) if i.size]
    if not pairs:
        return
    extremes = [_extremes(i) for _, i in pairs]
    shape = args[spec.data].shape or (1,)
    for (dim, _), (lo, hi) in zip(pairs, extremes):
        size = shape[dim]
        low = -size if spec.negative else 0
        if lo < low or hi >= size:
            bad = int(lo if lo < low else hi)
            if not size:  # CPU's words for an empty dim
                raise spec.error(f"{op}: index is out of bounds for dimension with size 0")
            error, words = spec.vector if spec.vector and args[spec.data].ndim <= 1 else (spec.error, spec.words)
            raise error(f"{op}: " + words.format(bad=bad, dim=dim, size=size))
