"""``torch.tpu.ops``: TorchTPU's Python op namespace, over this project's ``torch.ops.tpu`` ops.

Libraries written for TorchTPU call these (TorchRec 1.9's ``torchrec.experimental.torch_tpu``
does): the SparseCore lookup and fused optimizer updates take one stacked table's CSR-wrapped COO
buffers (``sparsecore.csr_format``) and run ``torch.ops.tpu.sparse_dense_matmul*``
(``torch_tpu.ops.sparsecore``, the math); ``sparse_dense_matmul_activation_unstack`` splits a
stacked lookup's activations into per-feature tensors. Hyperparameters may be Python floats or
tensors, as TorchTPU's Python API takes them. ``import torch_tpu`` installs this module as
``torch.tpu.ops``.

Several devices: as a SparseCore reaches every device's table over the interconnect, with
torch.distributed initialized over W > 1 ranks (one device each) the ops span the world: each rank
passes its local ``Shard(0)`` block of the table (and slots) and its own device's buffers, built
for W devices, and gets its own samples' activations / its new local blocks (the ops' DTensor rules,
``torch_tpu.ops.sparsecore_dtensor``, run the collectives).
"""

from __future__ import annotations

import functools
import numbers

import torch
import torch.distributed as dist

from torch_tpu._internal import tpu_namespace_ops
from torch_tpu._internal.jagged import align_jagged_to_multiple, strip_jagged_padding
from torch_tpu._internal.tpu_namespace_ops import *  # noqa: F403  (torch.tpu.ops' other functions)
from torch_tpu.runtime.dynamo_hooks import constant_result
from tpu_facts import knobs

# SparseCores per device of a device without any (XLA:CPU): v6e's and TPU7x's count, and what
# TorchRec's SparseCore modules assume by default (num_sc_per_device=2)
EMULATED_SPARSECORES_PER_DEVICE = 2

__all__ = [
    "align_jagged_to_multiple",
    "sparse_dense_matmul",
    "sparse_dense_matmul_activation_unstack",
    "sparse_dense_matmul_grad_with_adagrad",
    "sparse_dense_matmul_grad_with_adam",
    "sparse_dense_matmul_grad_with_sgd",
    "sparse_dense_matmul_gradient_stack",
    "sparsecores_per_device",
    "strip_jagged_padding",
    *tpu_namespace_ops.__all__,
]


@functools.cache
def _world_mesh(group: dist.ProcessGroup) -> dist.device_mesh.DeviceMesh:
    return dist.device_mesh.DeviceMesh.from_group(group, "tpu")


def _spanning(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The local table blocks as ``Shard(0)`` DTensors over the world's devices (unchanged in a
    single process or when already DTensors)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensors
    from torch.distributed.tensor import DTensor, Shard  # (imports torch._dynamo: only when spanning)

    mesh = _world_mesh(dist.group.WORLD)
    return tuple(t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
                 for t in tensors)


def _local(out: torch.Tensor | tuple[torch.Tensor, ...], given: torch.Tensor) -> torch.Tensor | tuple:
    """``out`` as the caller gave the table: local blocks for local blocks."""
    if not hasattr(out if not isinstance(out, tuple) else out[0], "to_local") or hasattr(given, "to_local"):
        return out  # no DTensor came back, or the caller passed DTensors
    return tuple(o.to_local() for o in out) if isinstance(out, tuple) else out.to_local()


def _limits(op: str, device_batch_size: int, max_ids_per_partition: int,
            max_unique_ids_per_partition: int) -> tuple[int, int, int]:
    """The three static sizes as ints; ValueError naming ``op``, the argument and the value for one
    that is not a positive integer (``0``, ``1.5``, ``True``), before the op's schema sees it."""
    given = {"device_batch_size": device_batch_size, "max_ids_per_partition": max_ids_per_partition,
             "max_unique_ids_per_partition": max_unique_ids_per_partition}
    for name, value in given.items():
        if isinstance(value, torch.SymInt):  # traced: the compiled program's guards check it
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"torch.tpu.ops.{op}: {name} must be a positive integer, got {value!r}")
    return tuple(v if isinstance(v, torch.SymInt) else int(v) for v in given.values())  # type: ignore[return-value]


def _hyper(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A hyperparameter as the 0-d float32 tensor on ``like``'s device the ops take."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(float(value), dtype=torch.float32, device=like.device)


def sparse_dense_matmul(row_pointers: torch.Tensor, embedding_ids: torch.Tensor, sample_ids: torch.Tensor,
                        gains: torch.Tensor, embedding_table: torch.Tensor, device_batch_size: int,
                        max_ids_per_partition: int, max_unique_ids_per_partition: int) -> torch.Tensor:
    """The pooled lookup ``[device_batch_size, dim]`` of one device's buffers (differentiable in
    ``embedding_table``)."""
    limits = _limits("sparse_dense_matmul", device_batch_size, max_ids_per_partition, max_unique_ids_per_partition)
    (table,) = _spanning((embedding_table,))
    return torch.ops.tpu._sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, table, *limits)


def sparse_dense_matmul_grad_with_sgd(
        row_pointers: torch.Tensor, embedding_ids: torch.Tensor, sample_ids: torch.Tensor, gains: torch.Tensor,
        embedding_table: torch.Tensor, activations_grad: torch.Tensor, learning_rate: float | torch.Tensor,
        device_batch_size: int, max_ids_per_partition: int, max_unique_ids_per_partition: int,
        computation_name: str) -> torch.Tensor:
    """The table after one SGD step on the rows the buffers touch."""
    limits = _limits("sparse_dense_matmul_grad_with_sgd", device_batch_size, max_ids_per_partition,
                     max_unique_ids_per_partition)
    (table,) = _spanning((embedding_table,))
    return _local(torch.ops.tpu._sparse_dense_matmul_grad_with_sgd(
        row_pointers, embedding_ids, sample_ids, gains, table, activations_grad,
        _hyper(learning_rate, embedding_table), *limits, computation_name), embedding_table)


def sparse_dense_matmul_grad_with_adagrad(
        row_pointers: torch.Tensor, embedding_ids: torch.Tensor, sample_ids: torch.Tensor, gains: torch.Tensor,
        embedding_table: torch.Tensor, accumulator: torch.Tensor, activations_grad: torch.Tensor,
        learning_rate: float | torch.Tensor, epsilon: float, device_batch_size: int, max_ids_per_partition: int,
        max_unique_ids_per_partition: int, computation_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The table and accumulator after one Adagrad step on the touched rows; the accumulator is
    the table's shape or row-wise (``[rows]``: one value per row, the mean of its squared gradients)."""
    limits = _limits("sparse_dense_matmul_grad_with_adagrad", device_batch_size, max_ids_per_partition,
                     max_unique_ids_per_partition)
    table, acc = _spanning((embedding_table, accumulator))
    return _local(torch.ops.tpu._sparse_dense_matmul_grad_with_adagrad(
        row_pointers, embedding_ids, sample_ids, gains, table, acc, activations_grad,
        _hyper(learning_rate, embedding_table), float(epsilon), *limits, computation_name), embedding_table)


def sparse_dense_matmul_grad_with_adam(
        row_pointers: torch.Tensor, embedding_ids: torch.Tensor, sample_ids: torch.Tensor, gains: torch.Tensor,
        embedding_table: torch.Tensor, momentum: torch.Tensor, velocity: torch.Tensor,
        activations_grad: torch.Tensor, alpha_t: float | torch.Tensor, beta_1: float, beta_2: float,
        epsilon: float, device_batch_size: int, max_ids_per_partition: int, max_unique_ids_per_partition: int,
        computation_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The table, momentum and velocity after one lazy Adam step on the touched rows: ``alpha_t``
    is the step size as given (the caller folds in any bias correction)."""
    limits = _limits("sparse_dense_matmul_grad_with_adam", device_batch_size, max_ids_per_partition,
                     max_unique_ids_per_partition)
    table, m, v = _spanning((embedding_table, momentum, velocity))
    return _local(torch.ops.tpu._sparse_dense_matmul_grad_with_adam(
        row_pointers, embedding_ids, sample_ids, gains, table, m, v, activations_grad,
        _hyper(alpha_t, embedding_table), float(beta_1), float(beta_2), float(epsilon), *limits,
        computation_name), embedding_table)


@constant_result  # a fact of the device: a compiled graph holds it as a constant
def sparsecores_per_device() -> int:
    """SparseCores per device of this process's tpu device; on a device without any (XLA:CPU),
    ``$TORCH_TPU_SPARSECORES_PER_DEVICE`` or 2."""
    from torch_tpu.runtime.device import get_device_properties

    own = get_device_properties().sparsecores_per_device
    if own:
        return own
    if not knobs.SPARSECORES_PER_DEVICE.text():
        return EMULATED_SPARSECORES_PER_DEVICE
    return knobs.SPARSECORES_PER_DEVICE.integer()


def sparse_dense_matmul_activation_unstack(stacked_activations: torch.Tensor, per_feature_batch_sizes: list[int],
                                           per_feature_dims: list[int]) -> list[torch.Tensor]:
    """Split a stacked table's lookup ``[sum(batch sizes), padded dim]`` into one
    ``[batch_size_i, dim_i]`` tensor per feature. The rows are SparseCore-major (each of the
    device's S SparseCores holds its share of every feature's samples, feature after feature), S
    being :func:`sparsecores_per_device`. Differentiable (its backward is
    :func:`sparse_dense_matmul_gradient_stack`)."""
    return torch.ops.tpu._sparse_dense_matmul_activation_unstack(stacked_activations, per_feature_batch_sizes,
                                                                 per_feature_dims)


def sparse_dense_matmul_gradient_stack(unstacked_gradients: list[torch.Tensor], stacked_batch_size: int,
                                       stacked_feature_dim: int) -> torch.Tensor:
    """The per-feature gradients stacked back into the ``[stacked_batch_size, stacked_feature_dim]``
    SparseCore-major layout (the inverse of :func:`sparse_dense_matmul_activation_unstack`)."""
    return torch.ops.tpu._sparse_dense_matmul_gradient_stack(unstacked_gradients, stacked_batch_size,
                                                             stacked_feature_dim)
