"""Reduction, scan and sort lowerings."""

from __future__ import annotations

import numpy as np
import torch

from torch_tpu.ops.lowerings._common import cast, is_float, jdtype, norm_dims, opmath, wrap_dim
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax, jnp

aten = torch.ops.aten


def _accumulate_dtype(self, dtype):
    """sum/prod/cumsum: integers and bool accumulate in int64 unless a dtype is given."""
    if dtype is not None:
        return jdtype(dtype)
    if jnp.issubdtype(self.dtype, jnp.integer) or self.dtype == np.bool_:
        return jnp.int64
    return self.dtype


def _accumulated(fn, self, dtype, **kwargs):
    """sum/prod in the accumulate dtype, and the result in it too (jnp promotes a bool sum/prod)."""
    accumulate = _accumulate_dtype(self, dtype)
    return cast(opmath(fn, cast(self, accumulate), **kwargs), accumulate)


@register_lowering(aten.sum.default)
def sum_(self, *, dtype=None):
    return _accumulated(jnp.sum, self, dtype)


@register_lowering(aten.sum.dim_IntList)
def sum_dim(self, dim, keepdim=False, *, dtype=None):
    return _accumulated(jnp.sum, self, dtype, axis=norm_dims(dim, self.ndim), keepdims=keepdim)


@register_lowering(aten.prod.default)
def prod(self, *, dtype=None):
    return _accumulated(jnp.prod, self, dtype)


@register_lowering(aten.prod.dim_int)
def prod_dim(self, dim, keepdim=False, *, dtype=None):
    return _accumulated(jnp.prod, self, dtype, axis=norm_dims(dim, self.ndim), keepdims=keepdim)


def _check_mean_dtype(self, dtype):
    out = jdtype(dtype) if dtype is not None else self.dtype
    if not jnp.issubdtype(out, jnp.inexact):
        raise TypeError(f"mean(): could not infer output dtype. Input dtype must be floating point, got {out}")
    return out


@register_lowering(aten.mean.default)
def mean(self, *, dtype=None):
    return opmath(jnp.mean, cast(self, _check_mean_dtype(self, dtype)))


@register_lowering(aten.mean.dim)
def mean_dim(self, dim, keepdim=False, *, dtype=None):
    return opmath(jnp.mean, cast(self, _check_mean_dtype(self, dtype)), axis=norm_dims(dim, self.ndim),
                  keepdims=keepdim)


@register_lowering(aten.amax.default)
def amax(self, dim=(), keepdim=False):
    return jnp.max(self, axis=norm_dims(dim, self.ndim), keepdims=keepdim)


@register_lowering(aten.amin.default)
def amin(self, dim=(), keepdim=False):
    return jnp.min(self, axis=norm_dims(dim, self.ndim), keepdims=keepdim)


@register_lowering(aten.max.default)
def max_(self):
    return jnp.max(self)


@register_lowering(aten.min.default)
def min_(self):
    return jnp.min(self)


def _arg_extreme(self, dim, keepdim, largest):
    x = self if self.ndim else self.reshape(1)
    axis = wrap_dim(dim, x.ndim)
    fn = jnp.argmax if largest else jnp.argmin
    if is_float(x):  # torch returns the first NaN as the extreme
        nan = jnp.isnan(x)
        idx = jnp.where(jnp.any(nan, axis=axis), jnp.argmax(nan, axis=axis), fn(x, axis=axis))
    else:
        idx = fn(x, axis=axis)
    idx = idx.astype(jnp.int64)
    if keepdim and self.ndim:
        idx = jnp.expand_dims(idx, axis)
    return idx if self.ndim else idx.reshape(())


def _extreme_dim(self, dim, keepdim, largest):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    axis = wrap_dim(dim, self.ndim)
    idx = _arg_extreme(self, axis, True, largest)
    values = jnp.take_along_axis(self, idx, axis=axis)
    if not keepdim:
        values, idx = jnp.squeeze(values, axis), jnp.squeeze(idx, axis)
    return values, idx


@register_lowering(aten.max.dim)
def max_dim(self, dim, keepdim=False):
    return _extreme_dim(self, dim, keepdim, True)


@register_lowering(aten.min.dim)
def min_dim(self, dim, keepdim=False):
    return _extreme_dim(self, dim, keepdim, False)


def _arg_reduction(largest: bool):
    def lowering(self, dim=None, keepdim=False):
        if dim is None:
            out = _arg_extreme(self.reshape(-1), 0, False, largest)
            return out.reshape((1,) * self.ndim) if keepdim else out
        return _arg_extreme(self, dim, keepdim, largest)

    return lowering


register_lowering(aten.argmax.default)(_arg_reduction(True))
register_lowering(aten.argmin.default)(_arg_reduction(False))


def _bool_reduction(jfn):
    def whole(self):
        return jfn(self)

    def over_dims(self, dim=None, keepdim=False):
        return jfn(self, axis=norm_dims(dim, self.ndim), keepdims=keepdim)

    return whole, over_dims


for _name, _fn in [("all", jnp.all), ("any", jnp.any)]:
    _whole, _over = _bool_reduction(_fn)
    _packet = getattr(aten, _name)
    register_lowering(_packet.default)(_whole)
    register_lowering(_packet.dim, _packet.dims)(_over)


@register_lowering(aten.var.correction)
def var(self, dim=None, *, correction=None, keepdim=False):
    ddof = 1 if correction is None else correction
    return opmath(jnp.var, self, axis=norm_dims(dim, self.ndim), ddof=ddof, keepdims=keepdim)


@register_lowering(aten.std.correction)
def std(self, dim=None, *, correction=None, keepdim=False):
    ddof = 1 if correction is None else correction
    return opmath(jnp.std, self, axis=norm_dims(dim, self.ndim), ddof=ddof, keepdims=keepdim)


@register_lowering(aten.var_mean.correction)
def var_mean(self, dim=None, *, correction=None, keepdim=False):
    axis = norm_dims(dim, self.ndim)
    return (var(self, dim, correction=correction, keepdim=keepdim),
            opmath(jnp.mean, self, axis=axis, keepdims=keepdim))


@register_lowering(aten.logsumexp.default)
def logsumexp(self, dim, keepdim=False):
    x = self if is_float(self) else self.astype(jnp.float32)
    return opmath(jax.nn.logsumexp, x, axis=norm_dims(dim, self.ndim), keepdims=keepdim)


@register_lowering(aten.linalg_vector_norm.default)
def linalg_vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    x = self.astype(jdtype(dtype)) if dtype is not None else self
    return opmath(_vector_norm, x, ord=ord, axis=norm_dims(dim, self.ndim), keepdim=keepdim)


def _vector_norm(x, ord, axis, keepdim):
    a = jnp.abs(x)
    if ord == float("inf"):
        return jnp.max(a, axis=axis, keepdims=keepdim)
    if ord == float("-inf"):
        return jnp.min(a, axis=axis, keepdims=keepdim)
    if ord == 0:
        return jnp.sum(a != 0, axis=axis, keepdims=keepdim).astype(x.dtype)
    if ord == 1:
        return jnp.sum(a, axis=axis, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axis, keepdims=keepdim))
    return jnp.sum(a**ord, axis=axis, keepdims=keepdim) ** (1.0 / ord)


@register_lowering(aten.cumsum.default)
def cumsum(self, dim, *, dtype=None):
    if self.ndim == 0:
        return self.astype(_accumulate_dtype(self, dtype))
    return opmath(jnp.cumsum, cast(self, _accumulate_dtype(self, dtype)), axis=dim)


@register_lowering(aten.cumprod.default)
def cumprod(self, dim, *, dtype=None):
    if self.ndim == 0:
        return self.astype(_accumulate_dtype(self, dtype))
    return opmath(jnp.cumprod, cast(self, _accumulate_dtype(self, dtype)), axis=dim)


def _sort(self, dim, descending):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    idx = jnp.argsort(self, axis=dim, stable=True, descending=descending)
    return jnp.take_along_axis(self, idx, axis=dim), idx.astype(jnp.int64)


@register_lowering(aten.sort.default)
def sort(self, dim=-1, descending=False):
    return _sort(self, dim, descending)


@register_lowering(aten.sort.stable)
def sort_stable(self, *, stable=None, dim=-1, descending=False):
    return _sort(self, dim, descending)


@register_lowering(aten.topk.default)
def topk(self, k, dim=-1, largest=True, sorted=True):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    values, idx = _sort(self, dim, largest)
    return jax.lax.slice_in_dim(values, 0, k, axis=dim), jax.lax.slice_in_dim(idx, 0, k, axis=dim)
