"""Eager view ops: a view aliases its source's storage box with metadata computed on meta tensors,
or in Python for the common ones (``t``, ``transpose``, ``permute``, ``view``, ``select`` ...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torch_tpu.eager import fallback
from torch_tpu.runtime import tensor as tensor_mod
from torch_tpu.runtime.tensor import TpuTensor, make_alias, meta_like

Handler = Callable[[Any, tuple, dict], Any]


def view_handler(func: Any, args: tuple, kwargs: dict) -> Any:
    source = args[0]
    if type(source) is not TpuTensor:
        return fallback.run_on_cpu(func, args, kwargs)
    box = source.storage_box

    def to_meta(x: Any) -> Any:
        return meta_like(x) if isinstance(x, TpuTensor) else x

    meta_args, meta_kwargs = pytree.tree_map(to_meta, (args, kwargs))
    out = func(*meta_args, **meta_kwargs)

    def to_alias(m: Any) -> Any:
        if not isinstance(m, torch.Tensor):
            return m
        alias = make_alias(box, m.shape, m.stride(), m.storage_offset(), m.dtype)
        tensor_mod.set_math_bits(alias, m.is_conj(), m.is_neg())
        return alias

    return pytree.tree_map(to_alias, out)


def fast_view(layout: Callable[..., tuple | None]) -> Handler:
    """A view handler computing (sizes, strides, offset) in Python; meta tensors for the rest."""

    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        t = args[0]
        if type(t) is TpuTensor and not kwargs and t.math_bits is None:
            meta = layout(tuple(t.shape), t.stride(), t.storage_offset(), *args[1:])
            if meta is not None:
                return make_alias(t.storage_box, meta[0], meta[1], meta[2], t.dtype)
        return view_handler(func, args, kwargs)

    return run


def layout_t(size, stride, offset):
    if len(size) > 2:
        return None  # the meta kernel raises torch's error
    return (size[::-1], stride[::-1], offset) if len(size) == 2 else (size, stride, offset)


def _in_range(dim: int, n: int) -> bool:
    """Whether ``dim`` is a dim of an ``n``-d layout; the fast views leave any other call to the
    meta kernels, which raise torch's errors."""
    return -n <= dim < n


def layout_transpose(size, stride, offset, d0, d1):
    n = len(size)
    if not (_in_range(d0, n) and _in_range(d1, n)):
        return None
    d0, d1 = d0 % n, d1 % n
    size, stride = list(size), list(stride)
    size[d0], size[d1] = size[d1], size[d0]
    stride[d0], stride[d1] = stride[d1], stride[d0]
    return size, stride, offset


def layout_permute(size, stride, offset, dims):
    n = len(size)
    if len(dims) != n or not n or not all(_in_range(d, n) for d in dims):
        return None
    dims = [d % n for d in dims]
    if len(set(dims)) != n:
        return None
    return [size[d] for d in dims], [stride[d] for d in dims], offset


def layout_unsqueeze(size, stride, offset, dim):
    n = len(size)
    if not -n - 1 <= dim <= n:
        return None
    dim %= n + 1
    new_stride = stride[dim] * size[dim] if dim < n else 1
    return size[:dim] + (1,) + size[dim:], stride[:dim] + (new_stride,) + stride[dim:], offset


def layout_view(size, stride, offset, shape):
    if stride != tensor_mod.contiguous_strides(size):
        return None
    numel = 1
    for s in size:
        numel *= s
    shape = list(shape)
    if shape.count(-1) == 1:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        if known == 0 or numel % known:
            return None
        shape[shape.index(-1)] = numel // known
    prod = 1
    for s in shape:
        prod *= s
    if prod != numel or any(s < 0 for s in shape):
        return None
    return shape, tensor_mod.contiguous_strides(shape), offset


def layout_select(size, stride, offset, dim, index):
    n = len(size)
    if not _in_range(dim, n):
        return None
    dim %= n
    if not -size[dim] <= index < size[dim]:
        return None
    index %= size[dim]
    return size[:dim] + size[dim + 1:], stride[:dim] + stride[dim + 1:], offset + index * stride[dim]


def layout_slice(size, stride, offset, dim=0, start=None, end=None, step=1):
    n = len(size)
    if not _in_range(dim, n) or step <= 0:
        return None
    dim %= n
    start, end, _ = slice(start, end, step).indices(size[dim])
    length = max(0, -(-(end - start) // step))
    new_size, new_stride = list(size), list(stride)
    new_size[dim], new_stride[dim] = length, stride[dim] * step
    return new_size, new_stride, offset + (start * stride[dim] if length else 0)


def layout_expand(size, stride, offset, shape, implicit=False):
    """CPU's ``inferExpandGeometry``: a new leading dim of size 1 gets the stride of a contiguous
    dim above the next one (not 0), an expanded dim stride 0; a 0-d tensor strides 0 throughout."""
    lead = len(shape) - len(size)
    if lead < 0:
        return None
    if not size:
        return None if any(s < 0 for s in shape) else (list(shape), [0] * len(shape), offset)
    new_size, new_stride = [0] * len(shape), [0] * len(shape)
    for i in reversed(range(len(shape))):
        s = shape[i]
        if i < lead:
            if s < 0:
                return None
            old, old_stride = 1, new_size[i + 1] * new_stride[i + 1]
        else:
            old, old_stride = size[i - lead], stride[i - lead]
        if s == -1 or s == old:
            new_size[i], new_stride[i] = old, old_stride
        elif old == 1:
            new_size[i], new_stride[i] = s, 0
        else:
            return None
    return new_size, new_stride, offset


def same_view_handler(func: Any, args: tuple, kwargs: dict) -> Any:
    """detach / alias: same metadata over the same box."""
    t = args[0]
    if t.math_bits is not None:
        return view_handler(func, args, kwargs)
    return make_alias(t.storage_box, t.shape, t.stride(), t.storage_offset(), t.dtype)


