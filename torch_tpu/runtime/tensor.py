"""The tensor model: a torch wrapper tensor over a shared, mutable storage box holding a JAX array.

Every storage is one :class:`StorageBox` whose ``array`` is a contiguous JAX array with the
storage's elements. A :class:`TpuTensor` is a view over a box: torch's own sizes / strides /
storage offset (set on the wrapper) describe which elements it sees. Views share the box, so
writes through any view are seen by all of them, exactly like CPU storage. JAX arrays are
immutable, so a write replaces ``box.array`` with an updated array.

Reads of the common "whole storage, contiguous" tensor return ``box.array`` itself (no copy, no
dispatch); other views gather from the flat array with cached index vectors.
"""

from __future__ import annotations

import collections
import copy
import math
import weakref
from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any

import numpy as np
import torch

from torch_tpu.runtime import backward_errors, dtype_views
from torch_tpu.runtime._jax import ARRAY_TYPE, jax, jnp
from torch_tpu.runtime.dtypes import FLOAT8_NUMPY, to_jax_dtype, to_torch_dtype

DEVICE_NAME = "tpu"
# One device per process; index 0 is required (index -1 breaks backward, >= 1 asserts).
DEVICE = torch.device(DEVICE_NAME, 0) if torch._C._get_privateuse1_backend_name() == DEVICE_NAME else None

_ARRAY = ARRAY_TYPE

# Set by torch_tpu.eager.register() (import torch_tpu): eager dispatch, a room this one does not import.
dispatch_target: Callable[..., Any] | None = None

_PTR_ALIGN = 1 << 12
_next_ptr = [_PTR_ALIGN]


def _allocate_ptr(nbytes: int) -> int:
    """A stable, nonzero, unique fake address for a storage (what data_ptr() compares)."""
    start = _next_ptr[0]
    _next_ptr[0] += (nbytes // _PTR_ALIGN + 2) * _PTR_ALIGN  # room to grow, gaps between boxes
    return start


class StorageBox:
    """One storage: a mutable slot holding a contiguous JAX array, plus a stable fake address.

    ``array`` has the storage's elements in order; its shape is whatever the last whole-storage
    write left (usually the shape of the tensor using it), so that tensor reads it without reshape.
    """

    __slots__ = ("array", "_ptr", "_storage", "__weakref__")

    def __init__(self, array: jax.Array) -> None:
        self.array = array
        self._ptr = 0
        self._storage: weakref.ref | None = None

    def storage(self) -> TpuUntypedStorage:
        """The box's storage object, the same one while anything holds it: ``torch.save`` tells
        storages apart by their C++ storage, so views saved together load as views of one storage."""
        found = self._storage() if self._storage is not None else None
        if found is None:
            found = TpuUntypedStorage(self)
            self._storage = weakref.ref(found)
        return found

    @property
    def ptr(self) -> int:
        """Assigned on first use (most boxes never need an address)."""
        if not self._ptr:
            self._ptr = _allocate_ptr(self.array.nbytes)
        return self._ptr

    @property
    def numel(self) -> int:
        return self.array.size

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def __deepcopy__(self, memo: dict) -> StorageBox:
        return StorageBox(self.array)  # jax arrays are immutable: sharing the value is a copy


class TpuUntypedStorage(torch.UntypedStorage):
    """What ``TpuTensor.untyped_storage()`` returns: byte-sized view of a box (FSDP2 resizes it).

    A ``torch.UntypedStorage`` (so ``tensor.storage()``'s TypedStorage can wrap it) whose C++ part
    is a data-less meta storage: sizes, device, address and contents come from the box.
    """

    def __new__(cls, box: StorageBox) -> TpuUntypedStorage:
        return super().__new__(cls, box.nbytes, device="meta")

    def __init__(self, box: StorageBox) -> None:
        self.storage_box = box

    @property
    def device(self) -> torch.device:
        return DEVICE

    def size(self) -> int:
        return self.storage_box.nbytes

    def nbytes(self) -> int:
        return self.storage_box.nbytes

    def data_ptr(self) -> int:
        return self.storage_box.ptr

    def cpu(self) -> torch.UntypedStorage:
        """A CPU copy of the storage's bytes."""
        return array_to_cpu(self.storage_box.array.reshape(-1)).untyped_storage()

    def _write_file(self, *args: Any) -> None:
        """The bytes into a legacy-format file (``pickle`` of a tpu tensor goes through it)."""
        self.cpu()._write_file(*args)

    def clone(self) -> TpuUntypedStorage:
        return TpuUntypedStorage(StorageBox(self.storage_box.array))  # jax arrays are immutable

    def __deepcopy__(self, memo: dict) -> TpuUntypedStorage:
        return self.clone()

    def __getitem__(self, index: Any) -> Any:  # bytes, as torch.UntypedStorage's
        return self.cpu()[index]

    def tolist(self) -> list[int]:
        return self.cpu().tolist()

    def __reduce__(self) -> tuple:
        from torch_tpu.runtime.storage import to_tpu  # torch_tpu.runtime.storage imports this module

        return to_tpu, (self.cpu(),)

    def resize_(self, nbytes: int) -> TpuUntypedStorage:
        """Free (``resize_(0)``) or (re)allocate the storage; contents are zeroed on growth."""
        itemsize = self.storage_box.array.dtype.itemsize
        if nbytes % itemsize:
            raise RuntimeError(
                f"storage resize_ to {nbytes} bytes is not a multiple of the element size {itemsize}"
            )
        numel = nbytes // itemsize
        old = self.storage_box.array.reshape(-1)
        if numel == old.size:
            return self
        if numel < old.size:
            self.storage_box.array = old[:numel]
        else:
            self.storage_box.array = jnp.concatenate([old, jnp.zeros((numel - old.size,), old.dtype)])
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TpuUntypedStorage) and other.storage_box is self.storage_box

    def __hash__(self) -> int:
        return hash(self.storage_box.ptr)


class TpuTensor(torch.Tensor):
    """A torch tensor on device "tpu" whose elements live in a JAX array (see module docstring)."""

    # The layout flags below are read by the other rooms and set only here (make_alias, set_layout,
    # set_math_bits, share_storage, wrap_owned; tests/test_layering.py holds it).
    storage_box: StorageBox
    # contiguous, offset 0, covering the whole storage, storage's dtype: reads box.array directly
    whole_storage: bool
    dtype_view = False  # dtype differs from the storage's (a ``view(dtype)``): see dtype_views
    # torch's lazy conjugate / negative bits (``x.conj()``, ``x.conj().imag``): the tensor's value is
    # its storage elements conjugated / negated; the one function doing both (None: neither)
    math_bits: Callable[[jax.Array], jax.Array] | None = None

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if types != _ONLY_TPU and any(not issubclass(t, TpuTensor) for t in types):
            # another tensor subclass among the arguments (DTensor's AsyncCollectiveTensor ...):
            # it unwraps itself and dispatches again, with TpuTensors only
            return NotImplemented
        try:
            return dispatch_target(func, args, kwargs or {})
        except BaseException as error:
            deferred = backward_errors.defer(func, error)
            if deferred is None:
                raise
            return deferred

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        body = repr(self.detach().cpu())
        suffix = f", device='{self.device}'"
        return body[:-1] + suffix + ")" if body.endswith(")") else body + suffix

    @property
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        # C++ set_data swaps the TensorImpl's metadata but not this object's box: follow it.
        torch.Tensor.data.__set__(self, new)
        if isinstance(new, TpuTensor):
            share_storage(self, new)

    def register_hook(self, hook: Callable[..., Any]) -> Any:
        """As ``torch.Tensor.register_hook``; an exception in the hook reaches ``backward()``
        (see torch_tpu.runtime.backward_errors)."""
        return super().register_hook(backward_errors.guard_hook(hook))

    def register_post_accumulate_grad_hook(self, hook: Callable[..., Any]) -> Any:
        return super().register_post_accumulate_grad_hook(backward_errors.guard_hook(hook))

    def untyped_storage(self) -> TpuUntypedStorage:  # type: ignore[override]
        return self.storage_box.storage()

    def set_(self, source: Any = None, storage_offset: int = 0, size: Any = None, stride: Any = None) -> TpuTensor:  # type: ignore[override]
        """``torch.Tensor.set_``, also from a tpu storage (``t.untyped_storage()``) and with a layout:
        ``set_(tensor)`` then ``as_strided_`` (both dispatched, so autograd sees them)."""
        if isinstance(source, torch.TypedStorage):  # ``t.storage()``
            source = source._untyped_storage
        if callable(getattr(source, "tpu_storage", None)):  # torch.load(map_location="tpu"): serialization.py
            source = source.tpu_storage(self.dtype)
        if isinstance(source, TpuUntypedStorage):
            n = source.nbytes() // self.element_size()
            source = make_alias(source.storage_box, (n,), (1,), 0, self.dtype)
            size = (n,) if size is None else size
        if source is None:
            return torch.Tensor.set_(self)
        torch.Tensor.set_(self, source)
        if size is None:
            return self
        return self.as_strided_(size, stride or contiguous_strides(size), storage_offset)

    def data_ptr(self) -> int:
        return self.storage_box.ptr + self.storage_offset() * self.element_size()

    def __format__(self, format_spec: str) -> str:
        # torch formats only plain-Tensor scalars as numbers (printing a sparse tpu tensor needs it)
        if self.dim() == 0:
            return self.item().__format__(format_spec)
        return super().__format__(format_spec)

    def tolist(self) -> Any:  # torch refuses tolist() on wrapper subclasses; torchrec's KJT needs it
        return to_cpu(self.detach()).tolist()

    def numpy(self, *, force: bool = False) -> np.ndarray:  # type: ignore[override]
        raise TypeError(
            "can't convert tpu tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def __deepcopy__(self, memo: dict) -> TpuTensor:
        if not self.is_leaf:
            raise RuntimeError("Only Tensors created explicitly by the user support the deepcopy protocol")
        box = copy.deepcopy(self.storage_box, memo)  # views of one storage stay views of one new storage
        new = make_alias(box, self.shape, self.stride(), self.storage_offset(), self.dtype)
        new.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            new._is_param = True
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol: int):
        if self.__dict__.get("_is_param"):  # an nn.Parameter: loads as one, as torch saves a CPU Parameter
            return (torch._utils._rebuild_parameter, (self.detach(), self.requires_grad, collections.OrderedDict()))
        # as torch saves a CPU tensor: its storage (written once however many tensors view it, its
        # location tag "tpu:0" honouring torch.load's map_location) and the view's layout
        storage = torch.storage.TypedStorage(wrap_storage=self.untyped_storage(), dtype=self.dtype, _internal=True)
        return (torch._utils._rebuild_tensor_v2,
                (storage, self.storage_offset(), tuple(self.size()), self.stride(), self.requires_grad,
                 collections.OrderedDict()))

    def __coerce_same_metadata_as_tangent__(self, expected_metadata: Any, expected_type: Any = None) -> TpuTensor:
        """AOTAutograd's hook for a subclass tangent: a TpuTensor already is a plain tpu tensor."""
        return self


_ONLY_TPU = (TpuTensor,)  # the usual ``types`` of a dispatch
_make_wrapper = torch.Tensor._make_wrapper_subclass


def _rebuild_tpu_tensor(cpu: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """Tensors pickled before __reduce_ex__ used torch's rebuild: honours map_location too."""
    return torch._utils._rebuild_device_tensor_from_cpu_tensor(cpu, cpu.dtype, str(DEVICE), requires_grad)


def contiguous_strides(size) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def make_alias(box: StorageBox, size, stride, offset: int, dtype: torch.dtype) -> TpuTensor:
    """A tensor viewing ``box`` with the given torch layout (sizes/strides/offset in elements)."""
    t = torch.Tensor._make_wrapper_subclass(
        TpuTensor, size, strides=stride, storage_offset=offset, dtype=dtype, device=DEVICE
    )
    t.storage_box = box
    _set_flags(t, tuple(size), tuple(stride), offset)
    return t


def set_math_bits(t: TpuTensor, conj: bool, neg: bool) -> None:
    """Give a new view ``t`` the conjugate / negative bits torch's view kernel set on its result."""
    if not (conj or neg):
        return
    torch._C._set_conj(t, conj)
    torch._C._set_neg(t, neg)
    t.math_bits = _MATH_BITS[conj, neg]
    t.whole_storage = False


_MATH_BITS = {(True, False): jnp.conj, (False, True): jnp.negative,
              (True, True): lambda a: jnp.negative(jnp.conj(a))}


def _set_flags(t: TpuTensor, size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> None:
    t.dtype_view = t.storage_box.array.dtype != to_jax_dtype(t.dtype)
    t.whole_storage = (not t.dtype_view and t.math_bits is None and offset == 0
               and math.prod(size) == t.storage_box.array.size and stride == contiguous_strides(size))


# --- metadata changes in place (squeeze_, t_, as_strided_, resize_, set_ ...) ---------------------

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset


def meta_like(t: TpuTensor) -> torch.Tensor:
    """A meta tensor with ``t``'s layout over a meta storage as large as ``t``'s box."""
    base = torch.empty((t.storage_box.nbytes // t.element_size(),), dtype=t.dtype, device="meta")
    meta = base.as_strided(t.shape, t.stride(), t.storage_offset())
    if t.math_bits is not None:  # so that views of it get their bits from torch's kernels
        torch._C._set_conj(meta, t.is_conj())
        torch._C._set_neg(meta, t.is_neg())
    return meta


def set_layout(t: TpuTensor, size, stride, offset: int, box: StorageBox | None = None) -> None:
    """Re-point ``t`` (in place, same Python object) at ``box`` (default: its own) with a new layout.

    torch's own metadata of the wrapper (sizes, strides, offset; what ``t.shape`` reports) changes
    through the CPU kernel of ``set_``, over a data-less storage at least as large as the layout.
    """
    box = t.storage_box if box is None else box
    size, stride = tuple(size), tuple(stride)
    _check_bounds(size, stride, offset, box.nbytes // t.element_size())
    storage = torch.Tensor.untyped_storage(t)
    needed = _extent(size, stride, offset) * t.element_size()
    if needed > storage.nbytes():
        holder = torch.Tensor._make_wrapper_subclass(TpuTensor, (needed,), dtype=torch.uint8, device=DEVICE)
        storage = torch.Tensor.untyped_storage(holder)
    _set_storage.redispatch(_CPU_KEYS, t, storage, offset, size, stride)
    t.storage_box = box
    _set_flags(t, size, stride, offset)


def resize(t: TpuTensor, size, memory_format: torch.memory_format | None = None) -> None:
    """``t.resize_(size)``: same offset, contiguous (or ``memory_format``) strides; the storage grows
    (zero-filled) when the new layout needs more elements than it has."""
    size = tuple(size)
    if memory_format is None and size == tuple(t.shape):
        return
    stride = torch.empty(size, device="meta", memory_format=memory_format or torch.contiguous_format).stride()
    offset = t.storage_offset()
    box = t.storage_box
    needed = _extent(size, stride, offset) * t.element_size()
    if needed > box.nbytes:
        old = box.array.reshape(-1)
        grow = -(-(needed - box.nbytes) // old.dtype.itemsize)
        box.array = jnp.concatenate([old, jnp.zeros((grow,), old.dtype)])
        box._ptr = 0  # reallocated storage: a new address, as on CPU
    set_layout(t, size, stride, offset)


def _extent(size, stride, offset: int) -> int:
    """Elements a layout needs its storage to have (0 for an empty layout)."""
    if not math.prod(size):
        return 0
    return offset + 1 + sum((n - 1) * st for n, st in zip(size, stride))


def from_jax(array: jax.Array) -> TpuTensor:
    """Wrap a JAX array as a new tpu tensor owning a fresh storage (no copy)."""
    return wrap_owned(array, array.shape, to_torch_dtype(array.dtype))


def wrap_owned(array: jax.Array, shape: tuple[int, ...], dtype: torch.dtype) -> TpuTensor:
    """:func:`from_jax` for a caller that already has ``array``'s shape and torch dtype (eager
    dispatch's fast path; unchecked)."""
    t = _make_wrapper(TpuTensor, shape, dtype=dtype, device=DEVICE)
    t.storage_box = StorageBox(array)
    t.whole_storage = True
    return t


def share_storage(t: TpuTensor, source: TpuTensor) -> None:
    """Make ``t`` (of ``source``'s layout) view ``source``'s storage as ``source`` does."""
    t.storage_box, t.whole_storage, t.dtype_view = source.storage_box, source.whole_storage, source.dtype_view


def to_jax(t: torch.Tensor) -> jax.Array:
    """The current value of a tpu tensor (any view) as a JAX array with the tensor's shape."""
    if type(t) is not TpuTensor:
        raise TypeError(f"to_jax expects a tpu tensor, got a tensor on {t.device}")
    box = t.storage_box
    if t.whole_storage:
        a = box.array
        shape = t.shape
        if a.shape == shape:
            return a
        if a.size == math.prod(shape):
            return _reshaper(tuple(shape))(_concrete(a))
        t.whole_storage = False  # another tensor resized the shared storage
    array = _concrete(box.array)
    if t.dtype_view:
        array = dtype_views.reinterpret(array, to_jax_dtype(t.dtype))
    value = _reader(tuple(t.shape), t.stride(), t.storage_offset(), array.size)(array)
    return value if t.math_bits is None else t.math_bits(value)


def concrete_value(t: TpuTensor) -> jax.Array:
    """:func:`to_jax` of ``t``, a computed (or in-flight) JAX array even under defer_and_fuse."""
    return _concrete(to_jax(t))


def write(t: TpuTensor, value: jax.Array) -> None:
    """Store ``value`` (same shape and dtype as ``t``) into the elements ``t`` views."""
    box = t.storage_box
    if t.whole_storage:
        if value.size == box.array.size:
            box.array = value  # any shape with the storage's numel; keeps this tensor's reads free
            return
        t.whole_storage = False  # another tensor resized the shared storage
    if t.math_bits is not None:  # conjugation and negation undo themselves
        value = t.math_bits(value)
    if t.dtype_view:
        old = _concrete(box.array)
        flat = dtype_views.reinterpret(old, value.dtype)
        writer = _writer(tuple(t.shape), t.stride(), t.storage_offset(), flat.size)
        box.array = dtype_views.restore(old, writer(flat, _concrete(value)))
        return
    writer = _writer(tuple(t.shape), t.stride(), t.storage_offset(), box.array.size)
    box.array = writer(_concrete(box.array), _concrete(value))


def _concrete(array: jax.Array) -> jax.Array:
    """A placeholder array (defer_and_fuse's LazyArray) as its value; other arrays unchanged."""
    return array if type(array) is _ARRAY else array.reshape(array.shape)


# --- strided views, compiled per layout -----------------------------------------------------------
# A view (shape, stride, offset) over a flat storage is read and written by one jitted program per
# layout. Most views (transposes, permutes, slices with steps, narrow, select, diagonal, expand) are
# a "block": after sorting the dims by stride, each stride is a multiple of the next one, so the
# view is a corner of a reshape of the storage region it spans: slice + reshape + slice + transpose
# (+ broadcast for stride-0 dims). Overlapping layouts gather with a cached index vector.


@lru_cache(maxsize=256)
def _reshaper(shape: tuple[int, ...]) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda a: a.reshape(shape))


class _Block:
    """How a strided view sits in its storage region (see the comment above)."""

    def __init__(self, shape, stride, offset: int, storage_numel: int) -> None:
        dims = sorted(
            ((n, st, i) for i, (n, st) in enumerate(zip(shape, stride)) if n != 1 and st != 0),
            key=lambda d: -d[1],
        )
        sizes = [n for n, _, _ in dims]
        strides = [st for _, st, _ in dims]
        self.ok = all(a % b == 0 and a // b >= n for a, b, n in zip(strides, strides[1:], sizes[1:]))
        self.offset = offset
        self.length = sizes[0] * strides[0] if dims else 1  # elements of the region the view spans
        self.pad = max(0, offset + self.length - storage_numel)
        # region as [n0, s0/s1, ..., s(m-1)/sm, sm]; the view is its corner [:n0, :n1, ..., :nm, :1]
        self.dense = tuple(sizes[:1]) + tuple(a // b for a, b in zip(strides, strides[1:])) + tuple(strides[-1:])
        self.corner = tuple(sizes) + ((1,) if dims else ())
        order = [i for _, _, i in dims]  # original dim of each sorted dim
        self.to_view = tuple(sorted(range(len(order)), key=lambda k: order[k]))  # sorted -> view order
        self.to_sorted = tuple(sorted(range(len(order)), key=lambda k: self.to_view[k]))
        self.squeezed = tuple(shape[i] for i in sorted(order))
        self.unbroadcast = tuple(n if (st != 0 or n == 1) else 1 for n, st in zip(shape, stride))
        self.expanded = any(st == 0 and n != 1 for n, st in zip(shape, stride))
        self.shape = tuple(shape)

    def region(self, flat: jax.Array) -> jax.Array:
        if self.pad:
            flat = jnp.concatenate([flat, jnp.zeros((self.pad,), flat.dtype)])
        return jax.lax.slice(flat, (self.offset,), (self.offset + self.length,)).reshape(self.dense), flat

    def read(self, array: jax.Array) -> jax.Array:
        region, _ = self.region(array.reshape(-1))
        corner = jax.lax.slice(region, (0,) * region.ndim, self.corner)
        view = corner.reshape(self.corner[:-1]).transpose(self.to_view).reshape(self.unbroadcast)
        return jnp.broadcast_to(view, self.shape) if self.expanded else view

    def write(self, array: jax.Array, value: jax.Array) -> jax.Array:
        region, flat = self.region(array.reshape(-1))
        corner = value.reshape(self.squeezed).transpose(self.to_sorted).reshape(self.corner)
        region = jax.lax.dynamic_update_slice(region, corner.astype(region.dtype), (0,) * region.ndim)
        flat = jax.lax.dynamic_update_slice(flat, region.reshape(-1), (self.offset,))
        return (flat[: flat.size - self.pad] if self.pad else flat).reshape(array.shape)


def _check_bounds(shape, stride, offset: int, storage_numel: int) -> None:
    if not math.prod(shape):
        return
    last = offset + sum((n - 1) * st for n, st in zip(shape, stride))
    if offset < 0 or last >= storage_numel:
        raise RuntimeError(
            f"view of size {list(shape)}, stride {list(stride)}, offset {offset} is out of bounds "
            f"for a storage of {storage_numel} elements"
        )


@lru_cache(maxsize=4096)
def _reader(shape, stride, offset: int, storage_numel: int) -> Callable[[jax.Array], jax.Array]:
    """A jitted ``storage array -> view value`` for one layout."""
    _check_bounds(shape, stride, offset, storage_numel)
    if not math.prod(shape):
        return jax.jit(lambda a: jnp.zeros(shape, a.dtype))
    block = _Block(shape, stride, offset, storage_numel)
    if block.ok:
        return jax.jit(block.read)
    idx = index_vector(shape, stride, offset, storage_numel)
    return lambda a: _gather_jit(a, idx, shape)


@lru_cache(maxsize=4096)
def _writer(shape, stride, offset: int, storage_numel: int) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """A jitted ``(storage array, value) -> new storage array`` for one layout."""
    _check_bounds(shape, stride, offset, storage_numel)
    if not math.prod(shape):
        return lambda a, v: a
    block = _Block(shape, stride, offset, storage_numel)
    if block.ok and not block.expanded:
        return jax.jit(block.write)
    idx = index_vector(shape, stride, offset, storage_numel)
    return lambda a, v: _scatter_jit(a, idx, v)


@partial(jax.jit, static_argnums=2)
def _gather_jit(array: jax.Array, idx: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return array.reshape(-1).at[idx].get(mode="promise_in_bounds").reshape(shape)


@jax.jit
def _scatter_jit(array: jax.Array, idx: jax.Array, value: jax.Array) -> jax.Array:
    flat = array.reshape(-1).at[idx].set(value.reshape(-1).astype(array.dtype), mode="promise_in_bounds")
    return flat.reshape(array.shape)


@lru_cache(maxsize=4096)
def index_vector(shape, stride, offset: int, storage_numel: int) -> jax.Array:
    """Flat storage indices of a strided view, in row-major element order (cached per layout)."""
    idx = np.full((), offset, dtype=np.int64)
    for size, st in zip(shape, stride):
        idx = idx[..., None] + np.arange(size, dtype=np.int64) * st
    idx = idx.reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= storage_numel):
        raise RuntimeError(
            f"view of size {list(shape)}, stride {list(stride)}, offset {offset} is out of bounds "
            f"for a storage of {storage_numel} elements"
        )
    return jnp.asarray(idx.astype(np.int32 if storage_numel < 2**31 else np.int64))


def zeros(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A new zero-filled array: what factories allocate, by a program compiled once per shape and
    dtype (an eager ``jnp.zeros`` dispatches a broadcast of a host scalar, ~4x the cost at 1 MiB)."""
    return _zeros_maker(tuple(shape), jnp.dtype(dtype))()


@lru_cache(maxsize=1024)
def _zeros_maker(shape: tuple[int, ...], dtype: Any) -> Callable[[], jax.Array]:
    return jax.jit(lambda: jnp.zeros(shape, dtype))


def to_cpu(t: TpuTensor) -> torch.Tensor:
    """A new CPU tensor holding a copy of a tpu tensor's value."""
    return array_to_cpu(to_jax(t))


def array_to_cpu(array: jax.Array) -> torch.Tensor:
    """A new CPU tensor holding a copy of a JAX array."""
    arr = np.array(array, copy=True)
    if arr.dtype == jnp.bfloat16:
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
    if arr.dtype in FLOAT8_NUMPY:  # ml_dtypes' float8 formats, which torch.from_numpy does not take
        return torch.from_numpy(arr.view(np.uint8)).view(to_torch_dtype(arr.dtype))
    return torch.from_numpy(arr) if arr.ndim else torch.from_numpy(arr.reshape(1)).reshape(())


def cpu_to_jax(t: torch.Tensor) -> jax.Array:
    """A JAX array holding a copy of a CPU tensor's value.

    Read through DLPack, then copied: ``t.numpy()`` would mark the caller's storage non-resizable
    (a later ``resize_`` / out= on it would fail), and the zero-copy DLPack array would change
    with ``t``.
    """
    if t.is_quantized:
        raise NotImplementedError(
            f"tpu tensors cannot hold quantized values ({t.dtype}); quantize on CPU, or keep the "
            "integer representation (int_repr()) with its scale and zero point on tpu"
        )
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    if t.is_pinned():  # DLPack names pinned memory CUDA host memory, which JAX reads only with CUDA
        t = t.clone()
    return jnp.array(jax.dlpack.from_dlpack(t), copy=True)


def from_cpu(t: torch.Tensor) -> TpuTensor:
    """Copy a CPU tensor to a new tpu tensor."""
    return from_jax(cpu_to_jax(t))

