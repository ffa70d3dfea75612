"""Eager handlers of ops that change a tpu tensor's metadata in place, without computing values.

``squeeze_``, ``unsqueeze_``, ``t_``, ``transpose_``, ``swapdims_``, ``as_strided_`` (every in-place
op whose functional sibling is a view) give the tensor the layout the view would have;
``resize_`` / ``resize_as_`` / ``_resize_output_`` change its shape (growing the storage);
``set_`` re-points it at another tensor's storage (``TpuTensor.set_`` maps the storage and layout
forms onto ``set_(tensor)`` + ``as_strided_``). The tensor stays the same Python object, as
on CPU. (Running the value-semantics view lowering and writing the result back would keep the
old shape: silently wrong.)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._prims_common import suggest_memory_format

from torch_tpu.runtime._jax import jnp
from torch_tpu.runtime.dtypes import to_jax_dtype
from torch_tpu.runtime.tensor import StorageBox, TpuTensor, meta_like, resize, set_layout

aten = torch.ops.aten
Handler = Callable[[Any, tuple, dict], Any]


def _meta(x: Any) -> Any:
    return meta_like(x) if isinstance(x, TpuTensor) else x


def inplace_view_handler(view_op: Any) -> Handler:
    """Handler of an in-place op whose functional sibling ``view_op`` is a view (``squeeze_`` ...)."""

    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        t = args[0]
        view = view_op(*[_meta(a) for a in args], **kwargs)
        set_layout(t, view.shape, view.stride(), view.storage_offset())
        return t

    return run


def _resize_(func: Any, args: tuple, kwargs: dict) -> Any:
    t, size = args[0], args[1]
    resize(t, size, args[2] if len(args) > 2 else kwargs.get("memory_format"))
    return t


def _resize_as_(func: Any, args: tuple, kwargs: dict) -> Any:
    t, template = args[0], args[1]
    memory_format = args[2] if len(args) > 2 else kwargs.get("memory_format")
    if memory_format is torch.preserve_format:  # the template's layout, as CPU's resize_as_
        memory_format = suggest_memory_format(template)
    resize(t, template.shape, memory_format)
    return t


def resize_output(t: TpuTensor, shape: tuple[int, ...]) -> None:
    """Resize an out= tensor to the result's shape, warning as CPU torch does when it had elements."""
    if tuple(t.shape) == tuple(shape):
        return
    if t.numel():
        warnings.warn(
            f"An output with one or more elements was resized since it had shape {list(t.shape)}, which does "
            f"not match the required output shape {list(shape)}. This behavior is deprecated, and in a future "
            "PyTorch release outputs will not be resized unless they have zero elements. You can explicitly "
            "reuse an out tensor t by resizing it, inplace, to zero elements with t.resize_(0).",
            UserWarning,
            stacklevel=3,
        )
    resize(t, shape)


def _resize_output_(func: Any, args: tuple, kwargs: dict) -> Any:
    resize_output(args[0], tuple(args[1]))
    return args[0]


def _set_source_tensor(func: Any, args: tuple, kwargs: dict) -> Any:
    """``t.set_(other)``: view ``other``'s storage with ``other``'s layout."""
    t, source = args[0], args[1]
    if not isinstance(source, TpuTensor):
        raise RuntimeError(
            f"set_: expected the source tensor on device {t.device}, got a tensor on {source.device}"
        )
    if source.dtype != t.dtype:
        raise RuntimeError(
            f"Could not set tensor of type {source.dtype} to a tensor of type {t.dtype}"
        )
    set_layout(t, source.shape, source.stride(), source.storage_offset(), box=source.storage_box)
    return t


def _set_storage(func: Any, args: tuple, kwargs: dict) -> Any:
    raise RuntimeError(
        f"{func}: a tpu tensor cannot be set to a torch storage object; use t.set_(t2.untyped_storage(), ...) "
        "with a tpu tensor's untyped_storage(), or t.set_(t2) / t.as_strided_(...)"
    )


def _set_empty(func: Any, args: tuple, kwargs: dict) -> Any:
    """``t.set_()``: a new empty storage, shape (0,)."""
    t = args[0]
    set_layout(t, (0,), (1,), 0, box=StorageBox(jnp.zeros((0,), to_jax_dtype(t.dtype))))
    return t


HANDLERS: dict[Any, Handler] = {
    aten.resize_.default: _resize_,
    aten.resize_as_.default: _resize_as_,
    aten._resize_output_.default: _resize_output_,
    aten.set_.source_Tensor: _set_source_tensor,
    aten.set_.source_Storage: _set_storage,
    aten.set_.source_Storage_storage_offset: _set_storage,
    aten.set_.default: _set_empty,
}
