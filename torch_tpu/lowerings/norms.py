"""Normalization lowerings: layer norm forward/backward."""

from __future__ import annotations

import math

import torch

from torch_tpu._jax import jax, jnp
from torch_tpu.registry import register_lowering

aten = torch.ops.aten


@register_lowering(aten.native_layer_norm.default)
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    x = input.astype(jnp.float32) if input.dtype in (jnp.bfloat16, jnp.float16) else input
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = jax.lax.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.astype(input.dtype), mean.astype(input.dtype), rstd.astype(input.dtype)


@register_lowering(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    lead = tuple(range(input.ndim - len(normalized_shape)))
    n = math.prod(input.shape[a] for a in axes)
    xhat = (input - mean) * rstd
    g = grad_out * weight if weight is not None else grad_out
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        grad_input = rstd * (g - jnp.sum(g, axis=axes, keepdims=True) / n
                             - xhat * jnp.sum(g * xhat, axis=axes, keepdims=True) / n)
        grad_input = grad_input.astype(input.dtype)
    if output_mask[1] and weight is not None:
        grad_weight = jnp.sum(grad_out * xhat, axis=lead).astype(weight.dtype)
    if output_mask[2] and bias is not None:
        grad_bias = jnp.sum(grad_out, axis=lead).astype(bias.dtype)
    return grad_input, grad_weight, grad_bias
