"""Batch norm lowerings: forward (train/eval, running-stat updates) and backward.

The per-channel statistics reduce over every dim but dim 1. In training the batch mean and
biased variance normalize the input and the running stats become
``(1 - momentum) * running + momentum * batch`` with the *unbiased* variance, as CPU torch does
(``momentum=None`` reaches the op as the cumulative-average factor the module computes).
``native_batch_norm`` updates ``running_mean``/``running_var`` without a schema annotation;
its lowering declares them with ``writes=`` so eager dispatch updates the tpu tensors.
"""

from __future__ import annotations

import torch

from torch_tpu.ops.lowerings._common import upcast
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax, jnp

aten = torch.ops.aten
_WRITES = ("running_mean", "running_var")


def _per_channel(v: jax.Array, ndim: int) -> jax.Array:
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _stats_dtype(input: jax.Array, *params: jax.Array | None):
    """torch keeps statistics in the parameters' dtype (float32 for a mixed bf16/f32 call)."""
    return next((p.dtype for p in params if p is not None), input.dtype)


def _forward(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """(out, save_mean, save_invstd, new_running_mean, new_running_var); new stats None when unchanged."""
    if not training and (running_mean is None or running_var is None):
        raise ValueError("running_mean and running_var must be defined in evaluation mode")
    axes = (0,) + tuple(range(2, input.ndim))
    stats_dtype = _stats_dtype(input, weight, bias, running_mean, running_var)
    x = upcast(input)
    new_mean = new_var = None
    if training:
        mean = jnp.mean(x, axis=axes)
        var = jnp.mean(jnp.square(x - _per_channel(mean, x.ndim)), axis=axes)
        invstd = jax.lax.rsqrt(var + eps)
        n = x.size // max(x.shape[1], 1)
        if running_mean is not None:
            new_mean = ((1 - momentum) * upcast(running_mean) + momentum * mean).astype(running_mean.dtype)
        if running_var is not None:
            unbiased = var * (n / (n - 1)) if n > 1 else var * jnp.nan  # CPU: 0 / 0
            new_var = ((1 - momentum) * upcast(running_var) + momentum * unbiased).astype(running_var.dtype)
        save_mean, save_invstd = mean.astype(stats_dtype), invstd.astype(stats_dtype)
    else:
        mean = upcast(running_mean)
        invstd = jax.lax.rsqrt(upcast(running_var) + eps)
        # like CUDA and the meta kernels compiled graphs are traced with (CPU returns empty tensors)
        save_mean, save_invstd = mean.astype(stats_dtype), invstd.astype(stats_dtype)
    scale = invstd if weight is None else invstd * upcast(weight)
    shift = -mean * scale if bias is None else upcast(bias) - mean * scale
    out = x * _per_channel(scale, x.ndim) + _per_channel(shift, x.ndim)
    return out.astype(input.dtype), save_mean, save_invstd, new_mean, new_var


@register_lowering(aten.native_batch_norm.default, aten._native_batch_norm_legit.default, writes=_WRITES)
def native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return _forward(input, weight, bias, running_mean, running_var, training, momentum, eps)


@register_lowering(aten._native_batch_norm_legit.no_stats)
def native_batch_norm_no_stats(input, weight, bias, training, momentum, eps):
    return _forward(input, weight, bias, None, None, training, momentum, eps)[:3]


@register_lowering(aten._native_batch_norm_legit_functional.default)
def native_batch_norm_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    out, save_mean, save_invstd, new_mean, new_var = _forward(
        input, weight, bias, running_mean, running_var, training, momentum, eps)
    return (out, save_mean, save_invstd,
            running_mean if new_mean is None else new_mean, running_var if new_var is None else new_var)


@register_lowering(aten._native_batch_norm_legit_no_training.default)
def native_batch_norm_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    return _forward(input, weight, bias, running_mean, running_var, False, momentum, eps)[:3]


@register_lowering(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
                               train, eps, output_mask):
    axes = (0,) + tuple(range(2, input.ndim))
    x, dy = upcast(input), upcast(grad_out)
    if train:
        mean, invstd = upcast(save_mean), upcast(save_invstd)
    else:
        mean, invstd = upcast(running_mean), jax.lax.rsqrt(upcast(running_var) + eps)
    w = jnp.ones_like(invstd) if weight is None else upcast(weight)
    centered = x - _per_channel(mean, x.ndim)
    sum_dy = jnp.sum(dy, axis=axes)
    dot = jnp.sum(dy * centered, axis=axes)
    stats_dtype = _stats_dtype(input, weight, running_mean, save_mean)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if train:
            n = x.size // max(x.shape[1], 1)
            proj = centered * _per_channel(dot * invstd * invstd / n, x.ndim)
            grad_input = (dy - proj - _per_channel(sum_dy / n, x.ndim)) * _per_channel(invstd * w, x.ndim)
        else:
            grad_input = dy * _per_channel(invstd * w, x.ndim)
        grad_input = grad_input.astype(input.dtype)
    if output_mask[1] and weight is not None:
        grad_weight = (dot * invstd).astype(weight.dtype)
    if output_mask[2]:
        grad_bias = sum_dy.astype(stats_dtype)
    return grad_input, grad_weight, grad_bias


# The export-IR batch norm ops (torch.export, pre-dispatch graphs): the same math, plus an empty
# ``reserve`` tensor (cuDNN's workspace elsewhere).
def _reserve():
    return jnp.zeros((0,), jnp.uint8)


@register_lowering(aten._batch_norm_with_update.default, writes=_WRITES)
def batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    out, save_mean, save_invstd, new_mean, new_var = _forward(
        input, weight, bias, running_mean, running_var, True, momentum, eps)
    return out, save_mean, save_invstd, _reserve(), new_mean, new_var


@register_lowering(aten._batch_norm_with_update_functional.default)
def batch_norm_with_update_functional(input, weight, bias, running_mean, running_var, momentum, eps):
    out, save_mean, save_invstd, new_mean, new_var = _forward(
        input, weight, bias, running_mean, running_var, True, momentum, eps)
    return out, save_mean, save_invstd, _reserve(), new_mean, new_var


@register_lowering(aten._batch_norm_no_update.default)
def batch_norm_no_update(input, weight, bias, running_mean, running_var, momentum, eps):
    out, save_mean, save_invstd, _, _ = _forward(input, weight, bias, running_mean, running_var, False, momentum, eps)
    return out, save_mean, save_invstd, _reserve()


@register_lowering(aten.batch_norm_backward.default)
def batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var, update, eps,
                        output_mask, reserve):
    return native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var,
                                      update, eps, output_mask)
