"""Activation, softmax and dropout lowerings, forward and backward."""

from __future__ import annotations

import functools
import math

import torch

from torch_tpu.ops.lowerings._common import cast, opmath, promoted, result_dtype
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax, jnp
from torch_tpu.runtime.dtypes import to_jax_dtype

aten = torch.ops.aten


@register_lowering(aten.relu.default)
def relu(self):
    return jnp.maximum(self, 0)


@register_lowering(aten.threshold.default)
def threshold(self, threshold, value):
    return jnp.where(self <= threshold, cast(value, self.dtype), self)


@register_lowering(aten.threshold_backward.default)
def threshold_backward(grad_output, self, threshold):
    return jnp.where(self <= threshold, 0, grad_output)


@register_lowering(aten.sigmoid_backward.default)
def sigmoid_backward(grad_output, output):
    return grad_output * (1 - output) * output


@register_lowering(aten.tanh_backward.default)
def tanh_backward(grad_output, output):
    return grad_output * (1 - output * output)


def _gelu_cdf(x, approximate):
    if approximate == "tanh":
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
        return 0.5 * (1 + jnp.tanh(inner))
    return 0.5 * (1 + jax.scipy.special.erf(x / math.sqrt(2)))


@register_lowering(aten.gelu.default)
def gelu(self, *, approximate="none"):
    return self * _gelu_cdf(self, approximate)


@register_lowering(aten.gelu_backward.default)
def gelu_backward(grad_output, self, *, approximate="none"):
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        inner = k * (self + 0.044715 * self**3)
        t = jnp.tanh(inner)
        d_inner = k * (1 + 3 * 0.044715 * self * self)
        return grad_output * (0.5 * (1 + t) + 0.5 * self * (1 - t * t) * d_inner)
    pdf = jnp.exp(-0.5 * self * self) / math.sqrt(2 * math.pi)
    return grad_output * (_gelu_cdf(self, approximate) + self * pdf)


@register_lowering(aten.silu.default)
def silu(self):
    return self * jax.nn.sigmoid(self)


@register_lowering(aten.silu_backward.default)
def silu_backward(grad_output, self):
    s = jax.nn.sigmoid(self)
    return grad_output * s * (1 + self * (1 - s))


@register_lowering(aten.leaky_relu.default)
def leaky_relu(self, negative_slope=0.01):
    return jnp.where(self > 0, self, self * cast(negative_slope, self.dtype))


@register_lowering(aten.leaky_relu_backward.default)
def leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    return jnp.where(self > 0, grad_output, grad_output * cast(negative_slope, grad_output.dtype))


@register_lowering(aten.hardtanh.default)
def hardtanh(self, min_val=-1, max_val=1):
    return jnp.clip(self, cast(min_val, self.dtype), cast(max_val, self.dtype))


@register_lowering(aten.hardtanh_backward.default)
def hardtanh_backward(grad_output, self, min_val, max_val):
    inside = (self > min_val) & (self < max_val)
    return jnp.where(inside, grad_output, jnp.zeros((), grad_output.dtype))


@register_lowering(aten.elu.default)
def elu(self, alpha=1, scale=1, input_scale=1):
    neg = alpha * jnp.expm1(self * input_scale)
    return scale * jnp.where(self > 0, self, neg.astype(self.dtype))


@register_lowering(aten.softplus.default)
def softplus(self, beta=1, threshold=20):
    scaled = self * beta
    return jnp.where(scaled > threshold, self, jnp.log1p(jnp.exp(scaled)) / beta)


@register_lowering(aten.softplus_backward.default)
def softplus_backward(grad_output, self, beta, threshold):
    scaled = self * beta
    return jnp.where(scaled > threshold, grad_output, grad_output * jax.nn.sigmoid(scaled))


@register_lowering(aten.hardsigmoid.default)
def hardsigmoid(self):
    return jnp.clip(self / 6 + 0.5, 0, 1).astype(self.dtype)


@register_lowering(aten.hardswish.default)
def hardswish(self):
    return self * hardsigmoid(self)


@register_lowering(aten._softmax.default)
def softmax(self, dim, half_to_float):
    x = self.astype(jnp.float32) if half_to_float else self
    return opmath(functools.partial(jax.nn.softmax, axis=dim), x) if self.ndim else jnp.ones_like(x)


@register_lowering(aten._log_softmax.default)
def log_softmax(self, dim, half_to_float):
    x = self.astype(jnp.float32) if half_to_float else self
    return opmath(functools.partial(jax.nn.log_softmax, axis=dim), x) if self.ndim else jnp.zeros_like(x)


def _softmax_grad(grad_output, output, dim):
    return output * (grad_output - jnp.sum(grad_output * output, axis=dim, keepdims=True))


def _log_softmax_grad(grad_output, output, dim):
    return grad_output - jnp.exp(output) * jnp.sum(grad_output, axis=dim, keepdims=True)


@register_lowering(aten._softmax_backward_data.default)
def softmax_backward(grad_output, output, dim, input_dtype):
    g = opmath(_softmax_grad, *promoted(grad_output, output), dim=dim if output.ndim else None)
    return g.astype(to_jax_dtype(input_dtype))


@register_lowering(aten._log_softmax_backward_data.default)
def log_softmax_backward(grad_output, output, dim, input_dtype):
    g = opmath(_log_softmax_grad, *promoted(grad_output, output), dim=dim if output.ndim else None)
    return g.astype(to_jax_dtype(input_dtype))


@register_lowering(aten.native_dropout.default, needs_key=True)
def native_dropout(input, p, train, *, key):
    if train is False or p == 0:
        return input, jnp.ones(input.shape, jnp.bool_)
    if p == 1:
        return jnp.zeros_like(input), jnp.zeros(input.shape, jnp.bool_)
    keep = jax.random.bernoulli(key, 1 - p, input.shape)
    return jnp.where(keep, input / (1 - p), jnp.zeros((), input.dtype)).astype(input.dtype), keep


@register_lowering(aten.native_dropout_backward.default)
def native_dropout_backward(grad_output, mask, scale):
    return (grad_output * mask * scale).astype(result_dtype(grad_output, scale))
