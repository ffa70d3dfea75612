"""The SparseCore lookup and its fused updates as pure ``jax.numpy`` functions of one device's
CSR-wrapped COO buffers (``sparsecore.csr_format``): the XLA formulation of what the SparseCores
compute, used by the ``tpu::sparse_dense_matmul*`` torch ops (``torch_tpu.ops.sparsecore``) off TPU.

One device, mod sharding: with S SparseCores on the device (here also the number of partitions
N), source SparseCore k's region of ``embedding_ids`` / ``sample_ids`` / ``gains`` holds its N
partitions, partition p being ``[round_up(end[p-1], 8), end[p])`` with ``end = row_pointers[k *
R : k * R + N]`` (R = ``len(row_pointers) / S``); every other position is padding. An entry of
partition p of source k reads physical table row ``p * shard_rows + embedding_id`` and adds
``gain * row`` to activation row ``k * (batch / S) + sample_id``.

The sums run in the order the entries sit in the buffers, which for every activation row (and
every table row) is the order the ``xla`` backend sums in (by physical row, then source SparseCore,
then sample): the lookup is bit-identical to ``XlaBackend.stack_activations``.

The updates are jax-tpu-embedding's SparseCore update rules (``sparse_dense_matmul_grad_with_*``),
applied to the rows the batch touches; untouched rows (and their slots) stay as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpu_facts import ALIGNMENT


def sparsecores_per_device(row_pointers_size: int) -> int:
    """S from the row-pointer buffer of one device: S regions of max(S, 8) pointers."""
    for s in range(1, row_pointers_size + 1):
        if s * max(s, ALIGNMENT) == row_pointers_size:
            return s
    raise ValueError(
        f"row_pointers has {row_pointers_size} entries; one device's buffer holds S * max(S, {ALIGNMENT}) "
        "(S SparseCores per device)"
    )


def decode(row_pointers, embedding_ids, sample_ids, gains, table_rows: int, batch_size: int):
    """(physical row, activation row, gain, valid) of every buffer position, each [S, region].
    Padding positions get row ``table_rows`` and activation row ``batch_size`` (out of range: a
    segment sum drops them) and gain 0."""
    s = sparsecores_per_device(row_pointers.shape[0])
    n = s
    if embedding_ids.shape[0] % s or batch_size % s or table_rows % n:
        raise ValueError(
            f"CSR buffers of {embedding_ids.shape[0]} entries, batch {batch_size} and a table of {table_rows} rows "
            f"must each divide among the {s} SparseCores of the device"
        )
    region = embedding_ids.shape[0] // s
    ends = row_pointers.reshape(s, -1)[:, :n].astype(jnp.int32)
    aligned = (ends[:, :-1] + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT
    starts = jnp.concatenate([jnp.zeros((s, 1), jnp.int32), aligned], axis=1)
    position = jnp.arange(region, dtype=jnp.int32)
    partition = jnp.sum(starts[:, None, :] <= position[None, :, None], axis=-1) - 1  # [S, region]
    partition = jnp.clip(partition, 0, n - 1)
    valid = position[None, :] < jnp.take_along_axis(ends, partition, axis=1)
    ids = embedding_ids.reshape(s, region).astype(jnp.int32)
    samples = sample_ids.reshape(s, region).astype(jnp.int32)
    source = jnp.arange(s, dtype=jnp.int32)[:, None]
    phys = jnp.where(valid, partition * (table_rows // n) + ids, table_rows)
    activation_row = jnp.where(valid, source * (batch_size // s) + samples, batch_size)
    gain = jnp.where(valid, gains.reshape(s, region), jnp.float32(0))
    return phys.reshape(-1), activation_row.reshape(-1), gain.reshape(-1), valid.reshape(-1)


def sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, embedding_table, batch_size: int):
    """Activations [batch_size, dim]: per activation row, the sum of gain * table row."""
    phys, rows, gain, _ = decode(row_pointers, embedding_ids, sample_ids, gains, embedding_table.shape[0], batch_size)
    values = embedding_table.at[phys].get(mode="fill", fill_value=0.0)
    return jax.ops.segment_sum(gain[:, None] * values, rows, num_segments=batch_size).astype(embedding_table.dtype)


def table_grad(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad):
    """(gradient of the table [V, dim], touched [V] bool): per table row, the sum of gain *
    activation gradient over its entries."""
    batch_size = activations_grad.shape[0]
    phys, rows, gain, valid = decode(row_pointers, embedding_ids, sample_ids, gains, embedding_table.shape[0],
                                     batch_size)
    values = activations_grad.astype(jnp.float32).at[rows].get(mode="fill", fill_value=0.0)
    vocab = embedding_table.shape[0]
    grad = jax.ops.segment_sum(gain[:, None] * values, phys, num_segments=vocab)
    touched = jax.ops.segment_sum(valid.astype(jnp.int32), phys, num_segments=vocab) > 0
    return grad, touched


def _keep_untouched(touched, new, old):
    mask = touched.reshape((-1,) + (1,) * (old.ndim - 1))
    return jnp.where(mask, new, old).astype(old.dtype)


def sgd(table, grad, touched, learning_rate):
    return _keep_untouched(touched, table - learning_rate * grad, table)


def adagrad(table, accumulator, grad, touched, learning_rate, epsilon):
    acc = accumulator + grad * grad
    new = table - learning_rate * grad / (jnp.sqrt(acc) + epsilon)
    return _keep_untouched(touched, new, table), _keep_untouched(touched, acc, accumulator)


def rowwise_adagrad(table, accumulator, grad, touched, learning_rate, epsilon):
    """``accumulator`` [V]: acc += mean over the row of g^2."""
    acc = accumulator + jnp.sum(grad * grad, axis=1) / grad.shape[1]
    new = table - learning_rate * grad / (jnp.sqrt(acc)[:, None] + epsilon)
    return _keep_untouched(touched, new, table), _keep_untouched(touched, acc, accumulator)


def adam(table, momentum, velocity, grad, touched, alpha_t, beta_1, beta_2, epsilon):
    """jax-tpu-embedding's form: m += (1 - b1)(g - m); v += (1 - b2)(g^2 - v);
    w -= alpha_t m / (sqrt(v) + epsilon). ``velocity`` [V] is row-wise (mean over the row).
    1 - b is taken in double, then rounded (as torch.optim.Adam's python-float betas are)."""
    c1, c2 = jnp.float32(1.0 - float(beta_1)), jnp.float32(1.0 - float(beta_2))
    m = momentum + c1 * (grad - momentum)
    if velocity.ndim == 1:
        v_full = velocity[:, None] + c2 * (grad * grad - velocity[:, None])
        v = jnp.sum(v_full / grad.shape[1], axis=1)
        denom = jnp.sqrt(v)[:, None] + jnp.float32(epsilon)
    else:
        v = velocity + c2 * (grad * grad - velocity)
        denom = jnp.sqrt(v) + jnp.float32(epsilon)
    new = table - alpha_t * m / denom
    return (_keep_untouched(touched, new, table), _keep_untouched(touched, m, momentum),
            _keep_untouched(touched, v, velocity))


def ftrl(table, accumulator, linear, grad, touched, learning_rate, learning_rate_power, l1, l2, beta):
    """FTRL-proximal as ``sparsecore.optimizers.FTRL`` (the ``xla`` backend's rule)."""
    k = -jnp.float32(learning_rate_power)
    acc = accumulator + grad * grad
    p_new = acc**k
    lin = linear + grad - (p_new - accumulator**k) / learning_rate * table
    l1, l2 = jnp.float32(l1), jnp.float32(l2)
    numerator = jnp.clip(lin, -l1, l1) - lin
    new = numerator / ((p_new + jnp.float32(beta)) / learning_rate + 2.0 * l2)
    return (_keep_untouched(touched, new, table), _keep_untouched(touched, acc, accumulator),
            _keep_untouched(touched, lin, linear))
