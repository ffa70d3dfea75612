"""Fused optimizer updates in JAX, applied to the gathered touched rows of a stacked table.

Formulas as jax-tpu-embedding's SparseCore kernels (see ``sparsecore.optimizers``); ``grad`` is
the gradient of each touched row already summed over all its occurrences in the batch.
"""

from __future__ import annotations

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
        b1, b2 = jnp.float32(spec.beta_1), jnp.float32(spec.beta_2)
        t = step.astype(jnp.float32)
        c2 = jnp.sqrt(1.0 - b2**t)
        alpha = lr * c2 / (1.0 - b1**t)
        m = b1 * slots["momentum"] + (1.0 - b1) * grad
        v = b2 * slots["velocity"] + (1.0 - b2) * grad * grad
        return rows - alpha * m / (jnp.sqrt(v) + spec.epsilon * c2), {"momentum": m, "velocity": v}
    if isinstance(spec, opt.FTRL):
        return _ftrl(spec, rows, slots, grad, lr)
    if isinstance(spec, opt.SGD):
        return rows - lr * grad, {}
    raise ValueError(f"the xla backend has no update rule for {type(spec).__name__}")


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
