"""Normalization lowerings: layer norm forward/backward."""

from __future__ import annotations

import math

import torch

from torch_tpu.ops.lowerings._common import upcast
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax, jnp

aten = torch.ops.aten


@register_lowering(aten.native_layer_norm.default)
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    x = upcast(input)
    # torch's mixed-precision layer norm (bf16/f16 input, float32 weight) keeps the stats in float32
    stats_dtype = jnp.float32 if x is not input and weight is not None and weight.dtype == jnp.float32 else input.dtype
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = jax.lax.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.astype(input.dtype), mean.astype(stats_dtype), rstd.astype(stats_dtype)


@register_lowering(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    lead = tuple(range(input.ndim - len(normalized_shape)))
    n = math.prod(input.shape[a] for a in axes)
    x, mean, rstd, w = (upcast(a) for a in (input, mean, rstd, weight))
    dy = upcast(grad_out)
    xhat = (x - mean) * rstd
    g = dy * w if weight is not None else dy
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        grad_input = rstd * (g - jnp.sum(g, axis=axes, keepdims=True) / n
                             - xhat * jnp.sum(g * xhat, axis=axes, keepdims=True) / n)
        grad_input = grad_input.astype(input.dtype)
    if output_mask[1] and weight is not None:
        grad_weight = jnp.sum(dy * xhat, axis=lead).astype(weight.dtype)
    if output_mask[2] and bias is not None:
        grad_bias = jnp.sum(dy, axis=lead).astype(bias.dtype)
    return grad_input, grad_weight, grad_bias


@register_lowering(aten.native_group_norm.default)
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    """Stats per (sample, group) over the group's channels and positions; the affine per channel."""
    x = upcast(input).reshape(N, group, C // group * HxW)  # (no -1: a batch may be empty)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(var + eps)
    out = ((x - mean) * rstd).reshape(N, C, HxW)
    if weight is not None:
        out = out * upcast(weight)[:, None]
    if bias is not None:
        out = out + upcast(bias)[:, None]
    return out.reshape(input.shape).astype(input.dtype), mean.reshape(N, group).astype(input.dtype), \
        rstd.reshape(N, group).astype(input.dtype)
