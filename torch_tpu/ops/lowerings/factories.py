"""Factory, fill and random lowerings (random ones take ``key=``, see torch_tpu.ops.registry)."""

from __future__ import annotations

import math

import numpy as np
import torch

from torch_tpu.ops.lowerings._common import cast, jdtype
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax, jnp

aten = torch.ops.aten


def _fill_dtype(value, dtype):
    if dtype is not None:
        return jdtype(dtype)
    if isinstance(value, bool):
        return jnp.bool_
    if isinstance(value, int):
        return jnp.int64
    if isinstance(value, complex):
        return jnp.complex128 if torch.get_default_dtype() == torch.float64 else jnp.complex64
    return jdtype(None)


@register_lowering(aten.zeros_like.default, aten.empty_like.default)
def zeros_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(self.shape, jdtype(dtype, self.dtype))


@register_lowering(aten.ones_like.default)
def ones_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.ones(self.shape, jdtype(dtype, self.dtype))


@register_lowering(aten.full_like.default)
def full_like(self, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.full(self.shape, fill_value, jdtype(dtype, self.dtype))


@register_lowering(aten.fill.Scalar, aten.fill.Tensor)
def fill(self, value):
    return jnp.broadcast_to(cast(value, self.dtype), self.shape)


@register_lowering(aten.zero.default)
def zero(self):
    return jnp.zeros(self.shape, self.dtype)


@register_lowering(aten.new_zeros.default, aten.new_empty.default)
def new_zeros(self, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), jdtype(dtype, self.dtype))


# graphs only: arrays have no strides; eager keeps the requested strides (torch_tpu.ops.kernels)
@register_lowering(aten.new_empty_strided.default, graph_only=True)
def new_empty_strided(self, size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return new_zeros(self, size, dtype=dtype)


@register_lowering(aten.empty_strided.default, graph_only=True)
def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), jdtype(dtype))


@register_lowering(aten.new_ones.default)
def new_ones(self, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), jdtype(dtype, self.dtype))


@register_lowering(aten.new_full.default)
def new_full(self, size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value, jdtype(dtype, self.dtype))


@register_lowering(aten.zeros.default, aten.empty.memory_format, aten._efficientzerotensor.default)
def zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(tuple(size), jdtype(dtype))


@register_lowering(aten.empty_permuted.default)
def empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None):
    return zeros(size, dtype=dtype)  # arrays have no strides: the layout is moot


@register_lowering(aten.ones.default)
def ones(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), jdtype(dtype))


@register_lowering(aten.full.default)
def full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value, _fill_dtype(fill_value, dtype))


@register_lowering(aten.scalar_tensor.default)
def scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s, jdtype(dtype))


@register_lowering(aten.arange.start_step)
def arange(start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    floating = any(isinstance(v, float) for v in (start, end, step))
    out = jdtype(dtype) if dtype is not None else (jdtype(None) if floating else jnp.int64)
    n = max(0, math.ceil((end - start) / step))
    if jnp.issubdtype(out, jnp.integer):
        return jnp.asarray(start + np.arange(n, dtype=np.int64) * step, out)
    return jnp.asarray(start + np.arange(n, dtype=np.float64) * step, out)


@register_lowering(aten.arange.default)
def arange_end(end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return arange(0, end, 1, dtype=dtype)


@register_lowering(aten.arange.start)
def arange_start(start, end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return arange(start, end, 1, dtype=dtype)


@register_lowering(aten.eye.default)
def eye(n, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, dtype=jdtype(dtype))


@register_lowering(aten.eye.m)
def eye_m(n, m, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, m, dtype=jdtype(dtype))


def _tri_indices(pick, row, col, offset, dtype):
    return jnp.asarray(np.stack(pick(row, offset, col)).reshape(2, -1), jdtype(dtype, jnp.int64))


@register_lowering(aten.triu_indices.default)
def triu_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _tri_indices(np.triu_indices, row, col, offset, dtype)


@register_lowering(aten.tril_indices.default)
def tril_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _tri_indices(np.tril_indices, row, col, offset, dtype)


def _two_sum(a, b):
    """``a + b`` rounded and its exact rounding error (Knuth's TwoSum: additions only)."""
    total = a + b
    b_part = total - a
    return total, (a - (total - b_part)) + (b - b_part)


def _sum_rounded_to_odd(a, b):
    """``a + b`` rounded to odd: an inexact sum takes the neighbour whose last mantissa bit is 1."""
    total, error = _two_sum(a, b)
    bits = jax.lax.bitcast_convert_type(total, jnp.int64)
    nudge = (error != 0) & ((bits & 1) == 0)
    return jnp.where(nudge, jnp.nextafter(total, jnp.where(error > 0, jnp.inf, -jnp.inf)), total)


def _fma_index(a, index, c, dtype):
    """``a * index + c`` rounded once to ``dtype`` (float32 or float64), as one fused multiply-add;
    ``a`` and ``c`` are scalars, ``index`` whole numbers (below 2**26 for float64). JAX reaches no FMA
    instruction, and XLA contracts a product and a sum inside a program only sometimes, so this
    never rounds a product: float64 splits ``a`` into 26 and 27 significant bits whose products with
    ``index`` are exact, adds them exactly (TwoSum), then adds ``c`` as Boldo and Melquiond's
    emulated FMA does (exact sum, low parts added rounded to odd, one rounding to nearest);
    float32's product is exact in float64, ``c`` is added rounded to odd, then rounded to float32."""
    # constant inputs would be folded at compile time, where XLA's evaluator loses TwoSum's error term
    a, index, c = jax.lax.optimization_barrier((a, index.astype(jnp.float64), c))
    if dtype == jnp.float32:
        return _sum_rounded_to_odd(a.astype(jnp.float64) * index, c.astype(jnp.float64)).astype(dtype)
    high = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(a, jnp.int64) & jnp.int64(~((1 << 27) - 1)), jnp.float64)
    product, product_low = _two_sum(high * index, (a - high) * index)
    total, total_low = _two_sum(c, product)
    fused = total + _sum_rounded_to_odd(total_low, product_low)
    return jnp.where(jnp.isfinite(fused), fused, a * index + c)  # inf/nan endpoints: no split


def _divisor(value, dtype):
    """``value`` to divide by as CPU does: XLA rewrites a division by a constant into a multiplication
    by its rounded reciprocal (49 steps: x * 0.0204081628 instead of x / 49), which the barrier
    stops."""
    return jax.lax.optimization_barrier(jnp.asarray(value, dtype))


@register_lowering(aten.linspace.default)
def linspace(start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=None):
    """CPU's kernel (ATen's linspace_kernel) step by step, so integer results are CPU's exactly:
    ``start`` and ``end`` are first cast to the result dtype (an integer one truncates 4.3 to 4), the
    step is ``(end - start) / (steps - 1)`` in that dtype (float64 for integer dtypes), the first half
    of the elements count up from ``start`` and the rest down from ``end``, and each element is cast
    to the dtype (truncating toward zero). ``jnp.linspace`` interpolates before casting: 4.3 -> -3
    in 50 int64 steps differed from CPU in 7 elements.

    ``start + step * i`` is one fused multiply-add in CPU builds with FMA (ATen's AVX2/AVX512 kernels
    and aarch64): 81 -> -47 in 7 int64 steps is 16 at index 3 there (16.999999999999996 before the
    cast) but 17 under ATEN_CPU_CAPABILITY=default. The lowering follows the FMA builds. bfloat16 and
    float16 round every operation to the dtype, as c10's BFloat16/Half arithmetic does."""
    out = jdtype(dtype)
    if jnp.issubdtype(out, jnp.complexfloating):
        return jnp.linspace(start, end, steps, dtype=out)
    first, last = jnp.asarray(start).astype(out), jnp.asarray(end).astype(out)
    if steps <= 1:
        return jnp.full((steps,), first, out)
    index = jnp.arange(steps)
    up, down = index, steps - 1 - index
    if out in (jnp.bfloat16, jnp.float16):
        exponent, mantissa = (8, 7) if out == jnp.bfloat16 else (5, 10)

        def rounded(x):
            return jax.lax.reduce_precision(x, exponent_bits=exponent, mantissa_bits=mantissa)

        first, last = first.astype(jnp.float32), last.astype(jnp.float32)
        step = rounded(rounded(last - first) / _divisor(rounded(jnp.float32(steps - 1)), jnp.float32))
        values = jnp.where(index < steps // 2,
                           rounded(first + rounded(step * rounded(up.astype(jnp.float32)))),
                           rounded(last - rounded(step * rounded(down.astype(jnp.float32)))))
        return values.astype(out)
    step_dtype = jnp.float64 if jnp.issubdtype(out, jnp.integer) else out
    first, last = first.astype(step_dtype), last.astype(step_dtype)
    step = (last - first) / _divisor(steps - 1, step_dtype)
    # the index as the kernel converts it (float32 rounds indices past 2**24)
    up, down = up.astype(step_dtype), down.astype(step_dtype)
    values = jnp.where(index < steps // 2, _fma_index(step, up, first, step_dtype),
                       _fma_index(-step, down, last, step_dtype))
    return values.astype(out)


@register_lowering(aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar, aten.linspace.Scalar_Tensor)
def linspace_tensor_bounds(start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=None):
    """0-d tensor bounds, as CPU reads them (``item()``) into ``linspace.default``; PyTorch's
    decomposition of these overloads interpolates in floating point (integer results off by one)."""
    for name, bound in (("start", start), ("end", end)):
        if getattr(bound, "ndim", 0) != 0:
            raise RuntimeError(f"linspace only supports 0-dimensional start and end tensors, but got {name} "
                               f"with {bound.ndim} dimension(s).")
    return linspace(start, end, steps, dtype=dtype)


# --- random ----------------------------------------------------------------------------------


def _float_like(self):
    return self.dtype if jnp.issubdtype(self.dtype, jnp.floating) else jnp.float32


@register_lowering(aten.normal_functional.default, needs_key=True)
def normal(self, mean=0.0, std=1.0, *, generator=None, key):
    draw = jax.random.normal(key, self.shape, _float_like(self))
    return (draw * std + mean).astype(self.dtype)


@register_lowering(aten.rand.default, needs_key=True)
def rand(size, *, dtype=None, layout=None, device=None, pin_memory=None, key):
    return jax.random.uniform(key, tuple(size), jdtype(dtype))


@register_lowering(aten.uniform.default, needs_key=True)
def uniform(self, from_=0.0, to=1.0, *, generator=None, key):
    return jax.random.uniform(key, self.shape, _float_like(self), from_, to).astype(self.dtype)


@register_lowering(aten.bernoulli.p, needs_key=True)
def bernoulli_p(self, p=0.5, *, generator=None, key):
    return jax.random.bernoulli(key, p, self.shape).astype(self.dtype)


@register_lowering(aten.bernoulli.default, needs_key=True)
def bernoulli(self, *, generator=None, key):
    return jax.random.bernoulli(key, self, self.shape).astype(self.dtype)


@register_lowering(aten.exponential.default, needs_key=True)
def exponential(self, lambd=1.0, *, generator=None, key):
    return (jax.random.exponential(key, self.shape, _float_like(self)) / lambd).astype(self.dtype)


@register_lowering(getattr(aten.random, "from"), needs_key=True)
def random_from(self, from_, to=None, *, generator=None, key):
    if to is None:
        to = int(jnp.iinfo(self.dtype).max) + 1 if jnp.issubdtype(self.dtype, jnp.integer) else 2**24 + 1
    return jax.random.randint(key, self.shape, from_, to, jnp.int64).astype(self.dtype)


@register_lowering(aten.random.to, needs_key=True)
def random_to(self, to, *, generator=None, key):
    return random_from(self, 0, to, key=key)


@register_lowering(aten.random.default, needs_key=True)
def random_default(self, *, generator=None, key):
    if self.dtype == jnp.bool_:
        return random_from(self, 0, 2, key=key)
    if jnp.issubdtype(self.dtype, jnp.floating):  # integers in [0, 2^mantissa] (torch's rule)
        return random_from(self, 0, 2 ** (jnp.finfo(self.dtype).nmant + 1) + 1, key=key)
    return random_from(self, 0, int(jnp.iinfo(self.dtype).max) + 1, key=key)


@register_lowering(aten.randperm.default, aten.randperm.generator, needs_key=True)
def randperm(n, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, key):
    """Without a lowering, randperm's backend-agnostic kernel calls ``randperm.out``, whose functional
    sibling is randperm again: the device recursed."""
    if n < 0:
        raise ValueError(f"n must be non-negative, got{n}")
    return jax.random.permutation(key, int(n)).astype(jdtype(dtype or torch.int64))
