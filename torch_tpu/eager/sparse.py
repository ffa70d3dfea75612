"""Sparse COO tensors on tpu: torch's own sparse tensors (layout ``sparse_coo``, dispatch key
SparsePrivateUse1) whose indices and values are tpu tensors.

``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)`` backward builds one from tpu
tensors, and SGD, SparseAdam and Adagrad update dense parameters with it. Three kinds of kernel
serve the SparsePrivateUse1 key:

* ATen's device-generic sparse kernels (:data:`_GENERIC`): they only change the sparse tensor's
  metadata and call ops on its indices and values, which dispatch to tpu as usual;
* device kernels for the training path (:data:`_DEVICE_KERNELS`): coalesce, dense += sparse,
  sparse + sparse, ``sparse_mask``, scaling by a scalar, written as tpu ops on indices and values;
* every other op with a sparse CPU kernel runs on CPU copies (the CPU fallback, counted and refused
  like any other).

An op mixing a dense tpu tensor with a sparse one reaches ``TpuTensor.__torch_dispatch__`` first
(the dense tensor's Python key): :func:`routed` sends it on to the SparsePrivateUse1 kernels,
as torch's dispatcher prefers the sparse key of mixed CPU arguments.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from torch_tpu.eager import fallback

aten = torch.ops.aten
_COO = torch.sparse_coo
_SPARSE_TPU = torch._C.DispatchKeySet(torch._C.DispatchKey.SparsePrivateUse1)
_SPARSE_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.SparseCPU)
_KEY = "SparsePrivateUse1"

# ATen's kernels of these ops are the same function for every device (their SparseCPU, SparseCUDA
# and SparseMeta registrations share it): run as registered for SparseCPU.
_GENERIC = (
    aten._indices.default, aten._values.default, aten.indices.default, aten.values.default,
    aten._nnz.default, aten.sparse_dim.default, aten.dense_dim.default, aten._dimI.default,
    aten._dimV.default, aten.is_coalesced.default, aten._coalesced_.default,
    aten._sparse_coo_tensor_with_dims.default, aten._sparse_coo_tensor_with_dims_and_tensors.default,
    aten.empty.memory_format, aten.sparse_resize_.default, aten.sparse_resize_and_clear_.default,
    aten.copy_sparse_to_sparse_.default, aten.zero_.default, aten.clone.default, aten._to_dense.default,
)


def _generic(op: torch._ops.OpOverload) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return op.redispatch(_SPARSE_CPU, *args, **kwargs)

    return kernel


def _coo(indices: torch.Tensor, values: torch.Tensor, size: Any, coalesced: bool) -> torch.Tensor:
    return aten._sparse_coo_tensor_unsafe(indices, values, size, is_coalesced=coalesced)


def _coalesce(self: torch.Tensor) -> torch.Tensor:
    """Sorted unique indices, the values of duplicates summed (in their order, as on CPU)."""
    indices, values = self._indices(), self._values()
    if self._nnz() < 2:
        return _coo(indices.clone(), values.clone(), self.shape, coalesced=True)
    sizes = self.shape[: self.sparse_dim()]
    strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
    strides_t = torch.tensor(strides, dtype=indices.dtype, device=indices.device).unsqueeze(1)
    sizes_t = torch.tensor(sizes, dtype=indices.dtype, device=indices.device).unsqueeze(1)
    keys, inverse = torch.unique((indices * strides_t).sum(0), sorted=True, return_inverse=True)
    summed = values.new_zeros((keys.numel(), *values.shape[1:])).index_add_(0, inverse, values)
    return _coo(torch.div(keys, strides_t, rounding_mode="floor") % sizes_t, summed, self.shape, coalesced=True)


def _scaled_values(sparse: torch.Tensor, alpha: Any) -> torch.Tensor:
    values = sparse._values()
    return values if alpha == 1 else values * alpha


def _check_same_size(self: torch.Tensor, other: torch.Tensor) -> None:
    if self.shape != other.shape:
        raise RuntimeError(
            f"add: expected 'self' and 'other' to have same size, but self has size {list(self.shape)} "
            f"while other has size {list(other.shape)} (FYI: dense-sparse addition does not currently "
            "support broadcasting)"
        )


def _accumulate_into(dense: torch.Tensor, sparse: torch.Tensor, alpha: Any) -> torch.Tensor:
    """``dense += alpha * sparse`` in place."""
    _check_same_size(dense, sparse)
    if sparse._nnz():
        dense.index_put_(tuple(sparse._indices()), _scaled_values(sparse, alpha).to(dense.dtype), accumulate=True)
    return dense


def _sparse_sum(self: torch.Tensor, other: torch.Tensor, alpha: Any) -> torch.Tensor:
    """Both operands' entries together; coalesced when both were (CPU merges them then)."""
    _check_same_size(self, other)
    dtype = torch.result_type(self, other)
    indices = torch.cat([self._indices(), other._indices()], 1)
    values = torch.cat([self._values().to(dtype), _scaled_values(other, alpha).to(dtype)])
    total = _coo(indices, values, self.shape, coalesced=False)
    return total.coalesce() if self.is_coalesced() and other.is_coalesced() else total


def _add(self: torch.Tensor, other: torch.Tensor, *, alpha: Any = 1) -> torch.Tensor:
    if self.is_sparse and other.is_sparse:
        return _sparse_sum(self, other, alpha)
    if not self.is_sparse and other.is_sparse:
        return _accumulate_into(self.to(torch.result_type(self, other), copy=True), other, alpha)
    return fallback.run_on_cpu(aten.add.Tensor, (self, other), {"alpha": alpha})


def _add_(self: torch.Tensor, other: torch.Tensor, *, alpha: Any = 1) -> torch.Tensor:
    if not self.is_sparse and other.is_sparse:
        return _accumulate_into(self, other, alpha)
    if self.is_sparse and other.is_sparse:
        return aten.copy_sparse_to_sparse_(self, _sparse_sum(self, other, alpha))
    return fallback.run_on_cpu(aten.add_.Tensor, (self, other), {"alpha": alpha})


def _is_scalar(x: Any) -> bool:
    return not isinstance(x, torch.Tensor) or (x.dim() == 0 and not x.is_sparse)


def _mul(self: torch.Tensor, other: Any) -> torch.Tensor:
    if self.is_sparse and _is_scalar(other):
        return _coo(self._indices().clone(), self._values() * other, self.shape, self.is_coalesced())
    return fallback.run_on_cpu(aten.mul.Tensor, (self, other), {})


def _mul_(self: torch.Tensor, other: Any) -> torch.Tensor:
    if self.is_sparse and _is_scalar(other):
        self._values().mul_(other)
        return self._coalesced_(False)  # as CPU's in-place scaling leaves it
    return fallback.run_on_cpu(aten.mul_.Tensor, (self, other), {})


def _sparse_mask(self: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``self``'s entries at ``mask``'s indices (duplicates and their order kept, as on CPU)."""
    if self.is_sparse or self.shape != mask.shape:
        return fallback.run_on_cpu(aten.sparse_mask.default, (self, mask), {})
    indices = mask._indices()
    return _coo(indices.clone(), self[tuple(indices)], self.shape, mask.is_coalesced())


_DEVICE_KERNELS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten._coalesce.default: _coalesce,
    aten.add.Tensor: _add,
    aten.add_.Tensor: _add_,
    aten.mul.Tensor: _mul,
    aten.mul_.Tensor: _mul_,
    aten.sparse_mask.default: _sparse_mask,
}


def _cpu_fallback(op: torch._ops.OpOverload) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return fallback.run_on_cpu(op, args, kwargs)

    return kernel


def _ops_with_cpu_sparse_kernels() -> list[torch._ops.OpOverload]:
    ops = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "SparseCPU"):
            name, _, overload = qualified.removeprefix("aten::").partition(".")
            ops.append(getattr(getattr(aten, name), overload or "default"))
    return ops


def _is_sparse_call(args: tuple, kwargs: dict) -> bool:
    if kwargs and kwargs.get("layout") is _COO:
        return True
    for a in args:
        if type(a) is torch.Tensor and a.layout is _COO:
            return True
        if type(a) is list or type(a) is tuple:
            if any(type(e) is torch.Tensor and e.layout is _COO for e in a):
                return True
    return False


Handler = Callable[[Any, tuple, dict], Any]


def _embedding_bag_backward(handler: Handler) -> Handler:
    """``sparse=True`` runs ATen's composite sparse backward on the tpu tensors (the lowering
    computes the dense gradient)."""
    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        grad, indices, offsets, offset2bag, bag_size, _, num_weights, by_freq, mode, is_sparse, *rest = args
        if not is_sparse:
            return handler(func, args, kwargs)
        return aten._embedding_bag_sparse_backward(grad, indices, offsets, offset2bag, bag_size, num_weights,
                                                   by_freq, mode, *rest, **kwargs)

    return run


def routed(func: torch._ops.OpOverload, handler: Handler) -> Handler:
    """``handler`` for dense tpu calls of ``func``; a call with a sparse argument (or creating a sparse
    tensor) goes on to the SparsePrivateUse1 kernels. Ops without sparse kernels keep ``handler``."""
    if func is aten._embedding_bag_backward.default:
        return _embedding_bag_backward(handler)
    if not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "SparseCPU"):
        return handler

    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        if _is_sparse_call(args, kwargs):
            return func.redispatch(_SPARSE_TPU, *args, **kwargs)
        return handler(func, args, kwargs)

    return run


_LIBRARIES: list[torch.library.Library] = []  # registrations live as long as their Library


def register() -> None:
    """Register the SparsePrivateUse1 kernels and the CPU fallback (idempotent)."""
    if _LIBRARIES:
        return
    kernels = torch.library.Library("aten", "IMPL")
    for op in _GENERIC:
        kernels.impl(op, _generic(op), _KEY)
    for op, kernel in _DEVICE_KERNELS.items():
        kernels.impl(op, kernel, _KEY)
    # per op, not a backend fallback: torch's Python fallback asserts for ops that have Python
    # kernels at other keys (torch_tpu's autocast policies)
    for op in _ops_with_cpu_sparse_kernels():
        if op not in _DEVICE_KERNELS and op not in _GENERIC:
            kernels.impl(op, _cpu_fallback(op), _KEY)
    _LIBRARIES.append(kernels)
