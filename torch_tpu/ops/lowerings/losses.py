"""Loss lowerings (reduction: 0 none, 1 mean, 2 sum — torch's at::Reduction), with backwards."""

from __future__ import annotations

import torch

from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jnp

aten = torch.ops.aten
NONE, MEAN, SUM = 0, 1, 2


def _reduce(loss, reduction):
    if reduction == MEAN:
        return jnp.mean(loss)
    if reduction == SUM:
        return jnp.sum(loss)
    return loss


def _grad_scale(grad_output, self, reduction):
    return grad_output / self.size if reduction == MEAN else grad_output


@register_lowering(aten.binary_cross_entropy.default)
def binary_cross_entropy(self, target, weight=None, reduction=MEAN):
    # torch clamps the logs at -100 so that loss stays finite for inputs of exactly 0 or 1.
    log_x = jnp.maximum(jnp.log(self), -100)
    log_1mx = jnp.maximum(jnp.log1p(-self), -100)
    loss = (target - 1) * log_1mx - target * log_x
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


@register_lowering(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=MEAN):
    eps = 1e-12
    grad = _grad_scale(grad_output, self, reduction) * (self - target) / jnp.maximum((1 - self) * self, eps)
    if weight is not None:
        grad = grad * weight
    return grad.astype(self.dtype)


@register_lowering(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(self, target, weight=None, pos_weight=None, reduction=MEAN):
    softplus_neg = jnp.maximum(-self, 0) + jnp.log1p(jnp.exp(-jnp.abs(self)))  # log(1 + exp(-x))
    if pos_weight is not None:
        log_weight = (pos_weight - 1) * target + 1
        loss = (1 - target) * self + log_weight * softplus_neg
    else:
        loss = (1 - target) * self + softplus_neg
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


@register_lowering(aten.mse_loss.default)
def mse_loss(self, target, reduction=MEAN):
    diff = self - target
    return _reduce(diff * diff, reduction)


@register_lowering(aten.mse_loss_backward.default)
def mse_loss_backward(grad_output, self, target, reduction):
    return (2 * _grad_scale(grad_output, self, reduction) * (self - target)).astype(self.dtype)


@register_lowering(aten.l1_loss.default)
def l1_loss(self, target, reduction=MEAN):
    return _reduce(jnp.abs(self - target), reduction)


def _nll_picked(self, target, weight, ignore_index):
    batched = self.ndim == 2
    x = self if batched else self[None]
    t = target if batched else target[None]
    valid = t != ignore_index
    safe_t = jnp.where(valid, t, 0)
    w = jnp.ones((x.shape[1],), x.dtype) if weight is None else weight
    w_t = jnp.where(valid, w[safe_t], 0).astype(x.dtype)
    picked = jnp.take_along_axis(x, safe_t[:, None], axis=1)[:, 0]
    return batched, picked, w_t, safe_t, valid


@register_lowering(aten.nll_loss_forward.default)
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    batched, picked, w_t, _, _ = _nll_picked(self, target, weight, ignore_index)
    losses = -picked * w_t
    total_weight = jnp.sum(w_t)
    if reduction == NONE:
        return (losses if batched else losses[0]), jnp.zeros((), self.dtype)
    if reduction == SUM:
        return jnp.sum(losses), total_weight
    return jnp.sum(losses) / total_weight, total_weight


@register_lowering(aten.nll_loss_backward.default)
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    batched, _, w_t, safe_t, valid = _nll_picked(self, target, weight, ignore_index)
    if reduction == NONE:
        scale = (grad_output if batched else grad_output[None]) * w_t
    elif reduction == SUM:
        scale = grad_output * w_t
    else:  # ignored targets get no gradient, even when every target is ignored (total weight 0)
        scale = jnp.where(valid, grad_output * w_t / total_weight, 0)
    x = self if batched else self[None]
    grad = jnp.zeros_like(x).at[jnp.arange(x.shape[0]), safe_t].set(-scale.astype(x.dtype))
    return grad if batched else grad[0]
