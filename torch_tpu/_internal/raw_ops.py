"""TorchTPU 0.2.0's raw ``tpu::`` ops (its schemas, read from its glue library) over torch ops.

Each op is a ``CompositeImplicitAutograd`` kernel: it decomposes into ATen ops before dispatch,
so it runs on CPU and on tpu (eager, where the project lowers those ops, and inside
``torch.compile(backend="tpu")`` graphs, which AOTAutograd decomposes) and is differentiable where
its parts are. These are XLA formulations of what TorchTPU runs as TPU kernels: same results,
not the same kernels (docs/TORCHTPU_API.md lists them):

* ``_max_pool{1,2,3}d`` / ``_backward``: max pooling without an index output (the backward
  finds the maxima again from the input);
* ``_ragged_dot`` / ``.out`` / ``_ragged_dot_weight_grad``: grouped matmuls, one masked matmul
  per group (a TPU runs one grouped kernel);
* ``_optimization_barrier``: identity copies (a TPU compiler keeps computations from moving
  across it);
* ``_sparse_gather`` / ``_backward`` / ``_sparse_iota``: gather and scatter-add over CSR rows
  (SparseCore kernels on TPU);
* ``_sparse_dense_matmul_activation_unstack`` / ``_gradient_stack``: a stacked table's lookup
  split per feature and its inverse;
* ``_dynamic_*``, ``_pad_real_to_static``, ``_set_dimension_logical_size``: TorchTPU's bounded
  dynamic shapes, here on the static (padded) shape;
* ``_sparse_map_row``: runs an MLIR body on SparseCore; it has no other implementation and raises.

The collectives (``_all_gather_dim`` ...) are ``raw_collectives``; the SparseCore lookups
``_sparse_dense_matmul*`` and the per-table preprocessing are ``raw_sparsecore``; ``torch_tpu._internal``
defines them all (once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

_POOL_ARGS = "int[] kernel_size, int[] stride, int[] padding, int[] dilation, bool ceil_mode"
SCHEMAS = {
    **{f"_max_pool{n}d": f"(Tensor self, {_POOL_ARGS}) -> Tensor" for n in (1, 2, 3)},
    **{f"_max_pool{n}d_backward": f"(Tensor grad_output, Tensor self, {_POOL_ARGS}) -> Tensor" for n in (1, 2, 3)},
    "_optimization_barrier": "(Tensor[] inputs) -> Tensor[]",
    "_ragged_dot": "(Tensor lhs, Tensor rhs, Tensor group_sizes) -> Tensor",
    "_ragged_dot.out": "(Tensor lhs, Tensor rhs, Tensor group_sizes, *, Tensor(a!) out) -> Tensor(a!)",
    "_ragged_dot_weight_grad": "(Tensor lhs, Tensor grad_output, Tensor group_sizes) -> Tensor",
    "_sparse_gather": "(Tensor row_pointers, Tensor indices, Tensor operand, int max_non_zeroes_per_row) -> Tensor",
    "_sparse_gather_backward": "(Tensor grad_output, Tensor indices, Tensor grad_operand) -> Tensor",
    "_sparse_iota": "(Tensor row_pointers, int max_non_zeroes, int max_non_zeroes_per_row) -> Tensor",
    "_sparse_map_row": "(Tensor[] csr_tensors, int[] csr_lengths, Tensor[] dense_args, str body_mlir, "
                       "Tensor[] dummy_outputs, int max_non_zeroes_per_row, int pad_value, int max_pad_per_row, "
                       "float wait_threshold, int result_row_pointer_op_index) -> Tensor[]",
    "_sparse_dense_matmul_activation_unstack":
        "(Tensor stacked_activations, int[] per_feature_batch_sizes, int[] per_feature_dims) -> Tensor[]",
    "_sparse_dense_matmul_gradient_stack":
        "(Tensor[] unstacked_gradients, int stacked_batch_size, int stacked_feature_dim) -> Tensor",
    "_dynamic_arange": "(Tensor start, Tensor end, Tensor step, int max_length, ScalarType dtype) -> Tensor",
    "_dynamic_broadcast": "(Tensor input, Tensor[] shape, int[] broadcast_dims, int[] static_shape, "
                          "bool[] is_dynamic) -> Tensor",
    "_dynamic_reshape": "(Tensor input, Tensor[] shape, int[] static_shape, bool[] is_dynamic) -> Tensor",
    "_dynamic_slice": "(Tensor input, Tensor[] start_indices, int[] slice_sizes) -> Tensor",
    "_pad_real_to_static": "(Tensor input, Tensor[] runtime_shape, int[] static_shape, bool[] is_dynamic) -> Tensor",
    "_set_dimension_logical_size": "(Tensor input, int dim, Tensor size) -> Tensor",
}


# --- max pooling without indices ------------------------------------------------------------------------


def _pool(n: int):
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[n - 1]

    def forward(x, kernel_size, stride, padding, dilation, ceil_mode):
        _check_pool_args(f"_max_pool{n}d", n, kernel_size, stride, padding, dilation)
        return pool(x, kernel_size, stride, padding, dilation, ceil_mode)

    return forward


def _pool_backward(n: int):
    name = f"_max_pool{n}d_backward"

    def backward(grad_output, x, kernel_size, stride, padding, dilation, ceil_mode):
        _check_pool_args(name, n, kernel_size, stride, padding, dilation)
        # the gradient of max pooling, the maxima found again from the input (no index tensor kept)
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            out = _pool(n)(leaf, kernel_size, stride, padding, dilation, ceil_mode)
            (grad,) = torch.autograd.grad(out, leaf, grad_output)
        return grad

    return backward


def _check_pool_args(name: str, n: int, *sequences: Sequence[int]) -> None:
    for label, seq in zip(("kernel_size", "stride", "padding", "dilation"), sequences):
        if len(seq) != n:
            raise ValueError(f"tpu::{name}: {label} needs one value per spatial dim ({n}), got {list(seq)}")


# --- ragged dot -------------------------------------------------------------------------------------------


def _row_groups(rows: int, group_sizes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The group of each row (groups take consecutive rows); rows past the groups' sum get
    ``len(group_sizes)``, no group."""
    ends = torch.cumsum(group_sizes.to(torch.int64), 0)
    row = torch.arange(rows, device=device)
    return (row[:, None] >= ends[None, :]).sum(1)


def _check_ragged(name: str, lhs: torch.Tensor, rhs_or_grad: torch.Tensor, group_sizes: torch.Tensor,
                  weight: bool) -> None:
    if lhs.dim() != 2 or group_sizes.dim() != 1:
        raise ValueError(f"tpu::{name}: lhs must be 2-D (m, k) and group_sizes 1-D, got shapes {tuple(lhs.shape)} "
                         f"and {tuple(group_sizes.shape)}")
    if weight:
        if rhs_or_grad.dim() != 2 or rhs_or_grad.shape[0] != lhs.shape[0]:
            raise ValueError(f"tpu::{name}: grad_output must be 2-D with lhs's {lhs.shape[0]} rows, got shape "
                             f"{tuple(rhs_or_grad.shape)}")
    elif rhs_or_grad.dim() != 3 or rhs_or_grad.shape[1] != lhs.shape[1] or rhs_or_grad.shape[0] != group_sizes.shape[0]:
        raise ValueError(f"tpu::{name}: rhs must be (g, k, n) with g = len(group_sizes) = {group_sizes.shape[0]} and "
                         f"k = lhs's {lhs.shape[1]} columns, got shape {tuple(rhs_or_grad.shape)}")


def ragged_dot(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``out[rows of group i] = lhs[rows of group i] @ rhs[i]``; rows past the groups are 0. Each
    group's operands and product are masked to its rows, so that a NaN or inf of one group reaches
    no other group's output or gradient (``0 * inf`` is NaN: masking the product alone would not do)."""
    _check_ragged("_ragged_dot", lhs, rhs, group_sizes, weight=False)
    groups = _row_groups(lhs.shape[0], group_sizes, lhs.device)
    out = lhs.new_zeros((lhs.shape[0], rhs.shape[2]))
    for g in range(rhs.shape[0]):
        rows = (groups == g)[:, None]
        out = out + torch.where(rows, torch.where(rows, lhs, 0) @ rhs[g], 0)
    return out


def _ragged_dot_out(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *,
                    out: torch.Tensor) -> torch.Tensor:
    return out.copy_(ragged_dot(lhs, rhs, group_sizes))


def ragged_dot_weight_grad(lhs: torch.Tensor, grad_output: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``result[i] = lhs[rows of group i].T @ grad_output[rows of group i]``, shape (g, k, n); both
    operands masked to the group's rows (a NaN or inf of another group's rows stays there)."""
    _check_ragged("_ragged_dot_weight_grad", lhs, grad_output, group_sizes, weight=True)
    groups = _row_groups(lhs.shape[0], group_sizes, lhs.device)
    masks = [(groups == g)[:, None] for g in range(group_sizes.shape[0])]
    return torch.stack([torch.where(rows, lhs, 0).T @ torch.where(rows, grad_output, 0) for rows in masks])


# --- barrier, SparseCore gathers ----------------------------------------------------------------------------


def _optimization_barrier(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in inputs]


def _sparse_gather(row_pointers: torch.Tensor, indices: torch.Tensor, operand: torch.Tensor,
                   max_non_zeroes_per_row: int) -> torch.Tensor:
    if indices.dim() != 1 or indices.numel() != row_pointers.numel() * max_non_zeroes_per_row:
        raise ValueError(f"tpu::_sparse_gather: indices must be 1-D of len(row_pointers) * max_non_zeroes_per_row "
                         f"= {row_pointers.numel()} * {max_non_zeroes_per_row}, got shape {tuple(indices.shape)}")
    if operand.dim() != 2:
        raise ValueError(f"tpu::_sparse_gather: operand must be 2-D, got shape {tuple(operand.shape)}")
    return operand.index_select(0, indices.to(torch.int64))


def _sparse_gather_backward(grad_output: torch.Tensor, indices: torch.Tensor,
                            grad_operand: torch.Tensor) -> torch.Tensor:
    return grad_operand.index_add(0, indices.to(torch.int64), grad_output.to(grad_operand.dtype))


def _sparse_iota(row_pointers: torch.Tensor, max_non_zeroes: int, max_non_zeroes_per_row: int) -> torch.Tensor:
    """Each non-zero's position in its CSR row (``row_pointers``: each row's start, then the end);
    0 past the last non-zero."""
    if row_pointers.dim() != 1 or row_pointers.numel() < 1:
        raise ValueError(f"tpu::_sparse_iota: row_pointers must be 1-D and non-empty, got shape "
                         f"{tuple(row_pointers.shape)}")
    k = torch.arange(max_non_zeroes, device=row_pointers.device, dtype=row_pointers.dtype)
    starts = row_pointers[:-1] if row_pointers.numel() > 1 else row_pointers[:1]
    row = (k[:, None] >= starts[None, 1:]).sum(1)  # the last row starting at or before k
    position = k - starts.index_select(0, row.to(torch.int64))
    return torch.where(k < row_pointers[-1], position, 0)


def _sparse_map_row(*args: object) -> list[torch.Tensor]:
    raise NotImplementedError(
        "tpu::_sparse_map_row (torch.tpu.ops.sparse_map_row) runs its MLIR body on a TPU's SparseCores; it needs "
        "a TPU with SparseCores and TorchTPU's SparseCore compiler, and has no XLA:CPU or CPU implementation")


# --- stacked activations --------------------------------------------------------------------------------------


def _sparsecores() -> int:
    from torch_tpu._internal.tpu_namespace import sparsecores_per_device

    return sparsecores_per_device()


def check_unstack(name: str, rows: int, width: int, batch_sizes: Sequence[int], dims: Sequence[int], s: int) -> None:
    if not batch_sizes or len(batch_sizes) != len(dims):
        raise ValueError(f"{name}: per_feature_batch_sizes ({len(batch_sizes)}) and per_feature_dims ({len(dims)}) "
                         "must name the same, at least one, features")
    for i, (b, d) in enumerate(zip(batch_sizes, dims)):
        if b < 1 or d < 1:
            raise ValueError(f"{name}: feature {i} has batch size {b} and dim {d}; both must be positive")
    if len(set(batch_sizes)) != 1 or batch_sizes[0] % s:
        raise ValueError(f"{name}: per_feature_batch_sizes {list(batch_sizes)} must be equal and divisible by the "
                         f"{s} SparseCores per device")
    if sum(batch_sizes) != rows or max(dims) > width:
        raise ValueError(f"{name}: the stacked tensor ({rows}, {width}) does not hold {sum(batch_sizes)} rows of "
                         f"width >= {max(dims)}")


def unstack(stacked: torch.Tensor, batch_sizes: Sequence[int], dims: Sequence[int], s: int) -> list[torch.Tensor]:
    """A stacked lookup's SparseCore-major rows split into one ``[batch, dim_i]`` tensor per feature."""
    if stacked.dim() != 2:
        raise ValueError(f"sparse_dense_matmul_activation_unstack: stacked_activations must be 2-D, got shape "
                         f"{tuple(stacked.shape)}")
    check_unstack("sparse_dense_matmul_activation_unstack", *stacked.shape, batch_sizes, dims, s)
    batch, features = batch_sizes[0], len(dims)
    rows = (stacked.reshape(s, features, batch // s, stacked.shape[1])
            .transpose(0, 1).reshape(features, batch, stacked.shape[1]))
    return [rows[i, :, :dim] for i, dim in enumerate(dims)]


def _unstack_op(stacked: torch.Tensor, batch_sizes: list[int], dims: list[int]) -> list[torch.Tensor]:
    return unstack(stacked, batch_sizes, dims, _sparsecores())


def _gradient_stack(grads: list[torch.Tensor], stacked_batch_size: int, stacked_feature_dim: int) -> torch.Tensor:
    """The inverse of the unstack: each feature's gradient padded to the stack's width, rows put
    back SparseCore-major."""
    s = _sparsecores()
    name = "sparse_dense_matmul_gradient_stack"
    if any(g.dim() != 2 for g in grads):
        raise ValueError(f"{name}: every unstacked gradient must be 2-D, got {[tuple(g.shape) for g in grads]}")
    check_unstack(name, stacked_batch_size, stacked_feature_dim, [g.shape[0] for g in grads],
                  [g.shape[1] for g in grads], s)
    batch = grads[0].shape[0]
    padded = torch.stack([F.pad(g, (0, stacked_feature_dim - g.shape[1])) for g in grads])
    return (padded.reshape(len(grads), s, batch // s, stacked_feature_dim).transpose(0, 1)
            .reshape(stacked_batch_size, stacked_feature_dim))


# --- bounded dynamic shapes, on the static shape -----------------------------------------------------------------


def _dynamic_arange(start, end, step, max_length, dtype):
    """``start + i * step`` for the ``max_length`` positions of the static shape (the first
    ``ceil((end - start) / step)`` are the logical values)."""
    return (start + torch.arange(max_length, device=start.device) * step).to(dtype)


def _dynamic_broadcast(x, shape, broadcast_dims, static_shape, is_dynamic):
    if len(broadcast_dims) != x.dim():
        raise ValueError(f"tpu::_dynamic_broadcast: broadcast_dims {list(broadcast_dims)} must name one output dim "
                         f"per input dim ({x.dim()})")
    view = [1] * len(static_shape)
    for d, out_d in enumerate(broadcast_dims):
        view[out_d] = x.shape[d]
    return x.reshape(view).expand(list(static_shape)).clone()


def _dynamic_reshape(x, shape, static_shape, is_dynamic):
    return x.reshape(list(static_shape)).clone()


def _dynamic_slice(x, start_indices, slice_sizes):
    """``lax.dynamic_slice``: each start clamped so the slice fits, then ``slice_sizes`` elements."""
    if len(start_indices) != x.dim() or len(slice_sizes) != x.dim():
        raise ValueError(f"tpu::_dynamic_slice: needs one start index and one slice size per dim ({x.dim()}), got "
                         f"{len(start_indices)} and {len(slice_sizes)}")
    out = x
    for d, (start, size) in enumerate(zip(start_indices, slice_sizes)):
        first = torch.clamp(start.reshape(()).to(torch.int64), 0, x.shape[d] - size)
        out = out.index_select(d, first + torch.arange(size, device=x.device))
    return out


def _pad_real_to_static(x, runtime_shape, static_shape, is_dynamic):
    """``x`` zero-padded to ``static_shape``, positions past the runtime size of a dynamic dim zeroed."""
    pad = []
    for d in reversed(range(x.dim())):
        pad += [0, static_shape[d] - x.shape[d]]
    out = F.pad(x, pad)
    for d, (size, dynamic) in enumerate(zip(runtime_shape, is_dynamic)):
        if dynamic:
            keep = torch.arange(static_shape[d], device=x.device) < size.reshape(())
            out = out * keep.reshape([-1 if i == d else 1 for i in range(out.dim())]).to(out.dtype)
    return out


def _set_dimension_logical_size(x, dim, size):
    return x.clone()


def kernels() -> dict[str, Callable[..., Any]]:
    """Each op's CompositeImplicitAutograd kernel, by its :data:`SCHEMAS` name."""
    return {
        **{f"_max_pool{n}d": _pool(n) for n in (1, 2, 3)},
        **{f"_max_pool{n}d_backward": _pool_backward(n) for n in (1, 2, 3)},
        "_optimization_barrier": _optimization_barrier,
        "_ragged_dot": ragged_dot,
        "_ragged_dot.out": _ragged_dot_out,
        "_ragged_dot_weight_grad": ragged_dot_weight_grad,
        "_sparse_gather": _sparse_gather,
        "_sparse_gather_backward": _sparse_gather_backward,
        "_sparse_iota": _sparse_iota,
        "_sparse_map_row": _sparse_map_row,
        "_sparse_dense_matmul_activation_unstack": _unstack_op,
        "_sparse_dense_matmul_gradient_stack": _gradient_stack,
        "_dynamic_arange": _dynamic_arange,
        "_dynamic_broadcast": _dynamic_broadcast,
        "_dynamic_reshape": _dynamic_reshape,
        "_dynamic_slice": _dynamic_slice,
        "_pad_real_to_static": _pad_real_to_static,
        "_set_dimension_logical_size": _set_dimension_logical_size,
    }
