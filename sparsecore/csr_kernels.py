"""The ``tpu::sparse_dense_matmul*`` ops' math on a TPU: jax-tpu-embedding's SparseCore primitives
(custom calls only libtpu executes) over one device's CSR buffers, mod sharding. Other platforms
use ``sparsecore.csr_math``; these functions still lower for the tpu platform anywhere, which is
how they are checked off TPU.

Buffers of k > 1 minibatch slots (``num_minibatches``, ``sparsecore.minibatching.op_buffers``) go
to the primitives' minibatching form, which carries k to the kernel.

jax-tpu-embedding's Adagrad has no epsilon: ``fused_update("adagrad", ...)`` drops it (the jnp
formulation adds it to sqrt(acc)); row-wise Adagrad has no SparseCore primitive of its own here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax_tpu_embedding.sparsecore.lib.core.primitives import (
    sparse_dense_matmul_csr,
    sparse_dense_matmul_grad_with_adagrad,
    sparse_dense_matmul_grad_with_adam,
    sparse_dense_matmul_grad_with_ftrl,
    sparse_dense_matmul_grad_with_sgd,
)

_PRIMITIVES = {
    "sgd": sparse_dense_matmul_grad_with_sgd.tpu_sparse_dense_matmul_grad_with_sgd_primitive,
    "adagrad": sparse_dense_matmul_grad_with_adagrad.tpu_sparse_dense_matmul_grad_with_adagrad_primitive,
    "adam": sparse_dense_matmul_grad_with_adam.tpu_sparse_dense_matmul_grad_with_adam_primitive,
    "ftrl": sparse_dense_matmul_grad_with_ftrl.tpu_sparse_dense_matmul_grad_with_ftrl_primitive,
}
_MOD = 1  # jax-tpu-embedding's sharding_strategy for mod sharding


def _minibatching(num_minibatches: int) -> tuple[jax.Array, dict[str, bool]]:
    """The primitives' minibatch count operand and the parameter that selects their form."""
    return jnp.int32(num_minibatches), {"enable_minibatching": num_minibatches > 1}


def sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, embedding_table, device_batch_size: int,
                        max_ids_per_partition: int, max_unique_ids_per_partition: int, num_minibatches: int = 1):
    count, form = _minibatching(num_minibatches)
    return sparse_dense_matmul_csr.tpu_sparse_dense_matmul_csr_primitive.bind(
        row_pointers, embedding_ids, sample_ids, gains, count, embedding_table,
        device_batch_size=device_batch_size, max_ids_per_partition=max_ids_per_partition,
        max_unique_ids_per_partition=max_unique_ids_per_partition, sharding_strategy=_MOD, **form,
    )


def fused_update(optimizer: str, csr, table, slots, activations_grad, hypers, device_batch_size: int,
                 max_ids_per_partition: int, max_unique_ids_per_partition: int, computation_name: str,
                 num_minibatches: int = 1):
    """(new table, *new slots) from jax-tpu-embedding's fused backward + update primitive."""
    if optimizer not in _PRIMITIVES:
        raise NotImplementedError(f"no SparseCore primitive for {optimizer!r} on TPU (use the jnp formulation)")
    hypers = [jnp.asarray(h, jnp.float32).reshape(()) for h in hypers]
    if optimizer == "adagrad":
        hypers = hypers[:1]  # jax-tpu-embedding's Adagrad takes no epsilon
    count, form = _minibatching(num_minibatches)
    out = _PRIMITIVES[optimizer].bind(
        *csr, count, table, *slots, activations_grad, *hypers,
        max_ids_per_partition=max_ids_per_partition, max_unique_ids_per_partition=max_unique_ids_per_partition,
        computation_name=computation_name, sharding_strategy=_MOD, **form,
    )
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return out if len(out) > 1 else out[0]
