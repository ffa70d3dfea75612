"""Fused optimizer updates in JAX, applied to the gathered touched rows of a stacked table.

Formulas as jax-tpu-embedding's SparseCore kernels (see ``sparsecore.optimizers``); ``grad`` is
the gradient of each touched row already summed over all its occurrences in the batch.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from sparsecore import optimizers as opt


def apply_update(
    spec: opt.OptimizerSpec,
    rows: jnp.ndarray,
    slots: dict[str, jnp.ndarray],
    grad: jnp.ndarray,
    step: jnp.ndarray,
    row_dims: jnp.ndarray,
) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """New (rows, slots) for the touched rows. ``step`` counts updates from 1; ``row_dims`` is
    each row's logical dim (row-wise Adagrad averages g^2 over it, not over the padded dim)."""
    lr = jnp.float32(spec.learning_rate)
    if isinstance(spec, opt.RowWiseAdagrad):
        acc = slots["accumulator"] + jnp.sum(grad * grad, axis=1) / jnp.maximum(row_dims, 1)
        return rows - lr * grad / (jnp.sqrt(acc)[:, None] + spec.eps), {"accumulator": acc}
    if isinstance(spec, opt.Adagrad):
        acc = slots["accumulator"] + grad * grad
        return rows - lr * grad / (jnp.sqrt(acc) + spec.eps), {"accumulator": acc}
    if isinstance(spec, opt.Adam):
        return _adam(spec, rows, slots, grad, step, lr)
    if isinstance(spec, opt.FTRL):
        return _ftrl(spec, rows, slots, grad, lr)
    if isinstance(spec, opt.SGD):
        return rows - lr * grad, {}
    raise ValueError(f"the xla backend has no update rule for {type(spec).__name__}")


def _adam(spec: opt.Adam, rows, slots, grad, step, lr):
    """torch.optim.Adam's arithmetic: 1 - beta and the bias corrections 1 - beta**t come from the
    double betas (``beta**t`` as ``expm1(t log beta)``, the log taken in double), never from betas
    rounded to float32 first (0.99999 -> 1 - beta 1.4e-3 off)."""
    t = step.astype(jnp.float32)
    m, v = slots["momentum"], slots["velocity"]
    m = m + jnp.float32(1.0 - spec.beta_1) * (grad - m)
    v = v * jnp.float32(spec.beta_2) + jnp.float32(1.0 - spec.beta_2) * (grad * grad)
    correction_1 = -jnp.expm1(t * jnp.float32(math.log(spec.beta_1))) if spec.beta_1 else jnp.float32(1.0)
    correction_2 = -jnp.expm1(t * jnp.float32(math.log(spec.beta_2))) if spec.beta_2 else jnp.float32(1.0)
    denom = jnp.sqrt(v) / jnp.sqrt(correction_2) + jnp.float32(spec.epsilon)
    return rows - (lr / correction_1) * (m / denom), {"momentum": m, "velocity": v}


def _ftrl(spec: opt.FTRL, rows, slots, grad, lr):
    acc_old = slots["accumulator"]
    acc = acc_old + grad * grad
    k = -jnp.float32(spec.learning_rate_power)
    p_new = acc**k
    linear = slots["linear"] + grad - (p_new - acc_old**k) / lr * rows
    l1, l2 = jnp.float32(spec.l1_regularization_strength), jnp.float32(spec.l2_regularization_strength)
    numerator = -linear if spec.l1_regularization_strength == 0 else jnp.clip(linear, -l1, l1) - linear
    new_rows = numerator / ((p_new + spec.beta) / lr + 2.0 * l2)
    return new_rows, {"accumulator": acc, "linear": linear}
