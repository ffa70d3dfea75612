"""TorchTPU 0.2.0's spellings of the SparseCore ops, ``tpu::_sparse_dense_matmul*`` (with the
underscore, its raw ops), and the per-table host preprocessing.

* ``tpu::_sparse_dense_matmul`` / ``_grad_with_{sgd,adagrad,adam}``: aliases, under TorchTPU's
  exact schemas (every argument positional, ``computation_name`` without a default, Adagrad's and
  Adam's ``epsilon`` a float), of the ops ``tpu::sparse_dense_matmul*``, each defined once in
  ``torch_tpu.ops.sparsecore`` (the math, checks, DTensor rules). Adagrad takes a row-wise (1-D
  ``[rows]``) accumulator too: that call is ``tpu::sparse_dense_matmul_grad_with_rowwise_adagrad``.
* ``tpu::preprocess_sparse_dense_matmul_input``: one table's ragged ids (int32 indices and
  offsets) as the CSR-wrapped COO buffers of ``sparsecore.csr_format``, a dict of
  ``row_pointers``, ``embedding_ids``, ``sample_ids``, ``gains`` and the int32 stats
  ``dropped_count``, ``observed_max_ids``, ``observed_max_unique_ids``
  (``sparsecore.metadata_backend``, as for TorchRec's stacked tables).
* ``tpu::compute_sparse_dense_matmul_stats``: the most ids and unique ids one SparseCore's share
  of the batch sends to one partition (``id % N`` of N = devices x SparseCores), to size
  ``max_ids_per_partition`` / ``max_unique_ids_per_partition``.

They are ``CompositeImplicitAutograd`` kernels: the lookup stays differentiable in the table through
``tpu::sparse_dense_matmul``'s own autograd. With a ``DTensor`` table an alias's DTensor rule runs
its kernel, whose inner op's rule does the sharded work (a CompositeImplicitAutograd op still
reaches DTensor's dispatch undecomposed where autograd is not on the dispatch path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torch_tpu.runtime.after_import import call_after_import

_CSR = "Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, Tensor gains, Tensor embedding_table"
_LIMITS = "int device_batch_size, int max_ids_per_partition, int max_unique_ids_per_partition"
SCHEMAS = {
    "_sparse_dense_matmul": f"({_CSR}, {_LIMITS}) -> Tensor",
    "_sparse_dense_matmul_grad_with_sgd":
        f"({_CSR}, Tensor activations_grad, Tensor learning_rate, {_LIMITS}, str computation_name) -> Tensor",
    "_sparse_dense_matmul_grad_with_adagrad":
        f"({_CSR}, Tensor accumulator, Tensor activations_grad, Tensor learning_rate, float epsilon, {_LIMITS}, "
        "str computation_name) -> (Tensor, Tensor)",
    "_sparse_dense_matmul_grad_with_adam":
        f"({_CSR}, Tensor momentum, Tensor velocity, Tensor activations_grad, Tensor alpha_t, float beta_1, "
        f"float beta_2, float epsilon, {_LIMITS}, str computation_name) -> (Tensor, Tensor, Tensor)",
    "preprocess_sparse_dense_matmul_input":
        "(Tensor input_indices, Tensor input_offsets, int max_ids_per_partition, int max_unique_ids_per_partition, "
        "int suggested_coo_buffer_size, int batch_size, str combiner, int local_device_count, "
        "int global_device_count, int num_sc_per_device, bool allow_id_dropping, str table_name) -> Dict(str, Tensor)",
    "compute_sparse_dense_matmul_stats":
        "(Tensor input_indices, Tensor input_offsets, int global_device_count, int num_sc_per_device) -> (int, int)",
}


def _lookup(row_pointers, embedding_ids, sample_ids, gains, table, device_batch_size, max_ids, max_unique):
    return torch.ops.tpu.sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, table,
                                             device_batch_size, max_ids, max_unique)


def _sgd(row_pointers, embedding_ids, sample_ids, gains, table, grad, learning_rate, device_batch_size, max_ids,
         max_unique, computation_name):
    return torch.ops.tpu.sparse_dense_matmul_grad_with_sgd(
        row_pointers, embedding_ids, sample_ids, gains, table, grad, learning_rate, device_batch_size, max_ids,
        max_unique, computation_name)


def _epsilon(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def _adagrad(row_pointers, embedding_ids, sample_ids, gains, table, accumulator, grad, learning_rate, epsilon,
             device_batch_size, max_ids, max_unique, computation_name):
    op = (torch.ops.tpu.sparse_dense_matmul_grad_with_rowwise_adagrad if accumulator.dim() == 1
          else torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad)
    return op(row_pointers, embedding_ids, sample_ids, gains, table, accumulator, grad, learning_rate,
              _epsilon(epsilon, learning_rate), device_batch_size, max_ids, max_unique, computation_name)


def _adam(row_pointers, embedding_ids, sample_ids, gains, table, momentum, velocity, grad, alpha_t, beta_1, beta_2,
          epsilon, device_batch_size, max_ids, max_unique, computation_name):
    return torch.ops.tpu.sparse_dense_matmul_grad_with_adam(
        row_pointers, embedding_ids, sample_ids, gains, table, momentum, velocity, grad, alpha_t, beta_1, beta_2,
        epsilon, device_batch_size, max_ids, max_unique, computation_name)


def _preprocess(input_indices, input_offsets, max_ids_per_partition, max_unique_ids_per_partition,
                suggested_coo_buffer_size, batch_size, combiner, local_device_count, global_device_count,
                num_sc_per_device, allow_id_dropping, table_name):
    from sparsecore.metadata_backend import SparseCorePreprocessorBackend

    table = {"name": table_name, "max_ids_per_partition": max_ids_per_partition,
             "max_unique_ids_per_partition": max_unique_ids_per_partition,
             "suggested_coo_buffer_size_per_device": suggested_coo_buffer_size,
             "features": [{"name": table_name, "row_offset": 0, "col_offset": 0, "col_shift": 0,
                           "batch_size": batch_size, "combiner": combiner}]}
    backend = SparseCorePreprocessorBackend([table], batch_size, local_device_count, global_device_count,
                                            num_sc_per_device, allow_id_dropping)
    return backend.preprocess({table_name: [input_indices.cpu()]}, {table_name: [input_offsets.cpu()]})[table_name]


def partition_stats(ids: np.ndarray, lengths: np.ndarray, partitions: int, chunks: int) -> tuple[int, int]:
    """(most ids, most unique ids) any one of ``chunks`` equal shares of the samples sends to any
    one of ``partitions`` partitions (``id % partitions``)."""
    samples = lengths.size
    if samples % chunks:
        raise ValueError(f"compute_sparse_dense_matmul_stats: the batch of {samples} samples does not split over "
                         f"{chunks} SparseCores")
    chunk = np.repeat(np.arange(samples) // (samples // chunks), lengths)
    if ids.size == 0:
        return 0, 0
    keys = chunk * partitions + ids % partitions
    most = int(np.bincount(keys).max())
    pairs = np.unique(np.stack([keys, ids]), axis=1)
    return most, int(np.bincount(pairs[0]).max())


def _stats(input_indices, input_offsets, global_device_count, num_sc_per_device):
    for value, what in ((global_device_count, "global_device_count"), (num_sc_per_device, "num_sc_per_device")):
        if value < 1:
            raise ValueError(f"compute_sparse_dense_matmul_stats: {what} must be positive, got {value}")
    offsets = input_offsets.cpu().numpy().astype(np.int64)
    if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or (np.diff(offsets) < 0).any():
        raise ValueError("compute_sparse_dense_matmul_stats: input_offsets must be 1-D, start at 0 and not decrease")
    ids = input_indices.cpu().numpy().astype(np.int64)[: offsets[-1]]
    return partition_stats(ids, np.diff(offsets), global_device_count * num_sc_per_device, num_sc_per_device)


def kernels() -> dict[str, Callable[..., Any]]:
    """Each op's CompositeImplicitAutograd kernel, by its :data:`SCHEMAS` name."""
    return {"_sparse_dense_matmul": _lookup, "_sparse_dense_matmul_grad_with_sgd": _sgd,
            "_sparse_dense_matmul_grad_with_adagrad": _adagrad, "_sparse_dense_matmul_grad_with_adam": _adam,
            "preprocess_sparse_dense_matmul_input": _preprocess, "compute_sparse_dense_matmul_stats": _stats}


def register_dtensor_rules(lib: torch.library.Library) -> None:
    """The aliases' DTensor rules (their kernels), once ``torch.distributed.tensor`` is imported."""
    if dist.is_available():
        call_after_import("torch.distributed.tensor", "DTensor", lambda: _register_dtensor_rules(lib))


def _register_dtensor_rules(lib: torch.library.Library) -> None:
    from torch.distributed.tensor import DTensor

    for name, kernel in kernels().items():
        if not name.startswith("_sparse_dense_matmul"):
            continue
        def rule(cls: type, func: Any, types: Any, args: tuple, kwargs: dict | None, kernel=kernel) -> Any:
            return kernel(*args, **(kwargs or {}))

        torch.library.register_torch_dispatch(f"tpu::{name}", DTensor, rule, lib=lib)
