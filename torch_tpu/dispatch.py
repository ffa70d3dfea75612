"""Eager dispatch of aten ops on tpu tensors: one cached handler per OpOverload.

The handler for an op is decided once (first call) from its schema and the registry:
view op -> alias the input's storage box with metadata computed on meta tensors;
in-place / out= op -> run the functional sibling's lowering and write into the target(s);
lowered op -> unwrap to JAX arrays, run through the current mode's executor, wrap;
op with a decomposition -> run it on the tpu tensors (``torch_tpu.decompositions``, counted);
anything else -> CPU fallback (counted). A few ops that cross devices or return Python values
(``copy_``, ``_to_copy``, ``_local_scalar_dense`` ...) have dedicated handlers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from torch_tpu import decompositions, fallback, metadata_ops, modes, op_jit, sparse
from torch_tpu import device as tpu_device
from torch_tpu import memory_format as formats
from torch_tpu import random as tpu_random
from torch_tpu import tensor as tensor_mod
from torch_tpu._jax import ARRAY_TYPE, jax, jnp
from torch_tpu.dtypes import to_jax_dtype, to_torch_dtype
from torch_tpu.lowerings import indexing
from torch_tpu.registry import Lowering, get_lowering
from torch_tpu.tensor import TpuTensor, cpu_to_jax, from_jax, make_alias, meta_like, to_cpu, to_jax, write

aten = torch.ops.aten
Handler = Callable[[Any, tuple, dict], Any]
_HANDLERS: dict[Any, Handler] = {}
_ARRAY = ARRAY_TYPE
_STRICT = modes.EagerMode.STRICT
_MODE = modes._current  # [the eager mode]
_COUNTS = fallback._lowered_counts
_LAST_OUTPUT = tpu_device._last_output
# The fast path (op_jit.fast): (op, each argument's shape and dtype or value) -> the op_jit
# program that ran the op's lowering for such a call, called with the tensor arguments' arrays
# directly (JAX's C++ jit dispatch). Filled by the lowered handler once op_jit compiled a program
# for the signature (so op_jit's compile-on-second-sight policy and size cap hold). Calls whose
# tensors are plain tpu tensors take it; in-place ops among them
# (_FAST_INPLACE) whose program's output has the target's shape and dtype store it whole.
_FAST_INPLACE: set[Any] = set()
_KWARGS = object()  # where a fast key's keyword arguments start


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    if _MODE[0] is _STRICT and op_jit._config["enabled"]:
        found = _fast_signature(func, args, kwargs)
        if found is not None:
            program = op_jit.fast.get(found[0])
            if program is not None:
                try:
                    out = program(*found[1])
                except Exception:  # noqa: BLE001  (what the lowering rejects: the full path raises torch's error)
                    op_jit.fast.pop(found[0], None)
                else:
                    _COUNTS[func.__name__] += 1
                    op_jit._stats.hits += 1
                    if func in _FAST_INPLACE:  # op_(target, ...): the target's full array is replaced
                        target = args[0]
                        target._box.array = _LAST_OUTPUT[0] = out
                        return target
                    if type(out) is _ARRAY:
                        _LAST_OUTPUT[0] = out
                        return from_jax(out)
                    return _wrap(out)
    handler = _HANDLERS.get(func)
    if handler is None:
        handler = _HANDLERS[func] = sparse.routed(func, _make_handler(func))
    return handler(func, args, kwargs)


def _fast_signature(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, list] | None:
    """(fast key, the tensor arguments' arrays), or None when the call cannot take the fast path
    (a view, a CPU or lazy tensor, a tensor list, an argument of another kind). Keyword arguments
    follow the positional ones by name, sorted: the order op_jit's program takes their arrays in."""
    key: list[Any] = [func]
    arrays = []
    values = args if not kwargs else (*args, _KWARGS, *(x for item in sorted(kwargs.items()) for x in item))
    for a in values:
        kind = type(a)
        if kind is TpuTensor:
            array = a._box.array
            if type(array) is not _ARRAY or not a._full:
                return None
            aval = array.aval
            if aval.shape != a.shape:
                return None
            arrays.append(array)
            key.append((aval.shape, aval.dtype))
        elif kind is float:
            key.append(a if a else (float, math.copysign(1.0, a)))  # 0.0 == -0.0, but 1/x differs
        elif kind is int or kind is bool:
            key.append((kind, a))
        elif a is None or kind is str or kind is torch.dtype or a is _KWARGS:
            key.append(a)
        elif kind is list or kind is tuple:
            for e in a:
                if type(e) is not int:
                    return None
            key.append((kind, *a))
        else:
            return None
    return tuple(key), arrays


def _note_fast(func: Any, lowering: Lowering, args: tuple, kwargs: dict) -> None:
    """After the lowered handler ran ``func``: give the call's signature its op_jit program."""
    program = op_jit.last_program()
    if program is None or lowering.needs_key or _MODE[0] is not _STRICT or indexing.has_bounds_check(lowering.op):
        return
    found = _fast_signature(func, args, kwargs)
    if found is not None:
        op_jit.fast[found[0]] = program


def clear_handler_cache() -> None:
    """Forget cached per-op handlers and compiled per-op programs (after registering new lowerings)."""
    _HANDLERS.clear()
    op_jit.clear()  # the fast path's programs too


# --- argument conversion ---------------------------------------------------------------------


def _foreign(x: torch.Tensor) -> jax.Array:
    if x.device.type == "cpu" and x.dim() == 0:
        return cpu_to_jax(x)  # CPU scalars mix with device tensors, as on CUDA
    raise RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, tpu:0 and {x.device}!"
    )


def _unwrap(x: Any) -> Any:
    t = type(x)
    if t is TpuTensor:
        return to_jax(x)
    if t is list or t is tuple:
        if any(isinstance(e, torch.Tensor) for e in x):
            return [_unwrap(e) for e in x]
        return x
    if isinstance(x, TpuTensor):
        return to_jax(x)
    if isinstance(x, torch.Tensor):
        return _foreign(x)
    return x


def _wrap(out: Any) -> Any:
    if type(out) is _ARRAY:
        tpu_device.note_output(out)
        return from_jax(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_wrap(o) for o in out)
    if isinstance(out, jax.Array):
        return from_jax(out)
    return out


# index / index_put take index tensors and masks on CPU with tpu data, as CUDA does
_HOST_INDICES_ACCEPTED = frozenset({aten.index.Tensor, aten.index_put.default, aten._index_put_impl.default})


def _unwrap_args(op: Any, args: tuple) -> list:
    if op in _HOST_INDICES_ACCEPTED and len(args) > 1:
        indices = [cpu_to_jax(i) if isinstance(i, torch.Tensor) and not isinstance(i, TpuTensor) else _unwrap(i)
                   for i in args[1]]
        return [_unwrap(args[0]), indices, *map(_unwrap, args[2:])]
    return [_unwrap(a) for a in args]


def _execute(func: Any, lowering: Lowering, args: tuple, kwargs: dict) -> Any:
    jargs = _unwrap_args(lowering.op, args)
    indexing.check_bounds(lowering.op, jargs)
    jkwargs = {k: _unwrap(v) for k, v in kwargs.items()} if kwargs else {}
    if lowering.needs_key:
        jkwargs["key"] = tpu_random.next_key()
    try:
        out = modes.current_executor()(lowering, jargs, jkwargs)
    except (TypeError, ValueError) as e:
        _raise_as_torch(func, args, kwargs, e)
    fallback.count_lowered(func)
    if lowering.writes:
        out = _store_writes(lowering, args, kwargs, out)
    return out


def _store_writes(lowering: Lowering, args: tuple, kwargs: dict, out: Any) -> Any:
    """Store the new values of the inputs ``lowering`` updates; return the op's own outputs."""
    n = lowering.num_outputs
    for target, value in zip(lowering.write_targets(args, kwargs), out[n:]):
        if value is not None and target is not None:
            _store(target, value)
    return out[0] if n == 1 else tuple(out[:n])


def _host_zeros(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with every tensor as a CPU tensor of zeros of its layout and dtype."""
    def to_host(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).zero_()
        return x

    return pytree.tree_map(to_host, (args, kwargs))


def _raise_as_torch(func: Any, args: tuple, kwargs: dict, error: Exception) -> None:
    """Re-raise a JAX error as the exception CPU torch gives for the same shapes and dtypes."""
    host_args, host_kwargs = _host_zeros(args, kwargs)
    try:
        func(*host_args, **host_kwargs)
    except Exception as torch_error:
        raise type(torch_error)(str(torch_error)) from error
    raise RuntimeError(f"{func}: TPU lowering failed: {type(error).__name__}: {error}") from error


# --- handlers --------------------------------------------------------------------------------


def _lowered_handler(lowering: Lowering) -> Handler:
    if lowering.writes:
        def run_writing(func: Any, args: tuple, kwargs: dict) -> Any:
            return _wrap(_execute(func, lowering, args, kwargs))

        return run_writing

    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        out = _execute(func, lowering, args, kwargs)
        _note_fast(func, lowering, args, kwargs)
        return _wrap(out)

    return run


_TORCH_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
    torch.uint8: "Byte", torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}


def _store(target: torch.Tensor, value: jax.Array) -> None:
    """Write ``value`` into ``target`` with torch's in-place casting and shape rules."""
    if type(target) is not TpuTensor:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, tpu:0 and {target.device}!"
        )
    want = to_jax_dtype(target.dtype)
    if value.dtype != want:
        got = to_torch_dtype(value.dtype)
        if not torch.can_cast(got, target.dtype):
            raise RuntimeError(
                f"result type {_TORCH_NAMES.get(got, got)} can't be cast to the desired output type "
                f"{_TORCH_NAMES.get(target.dtype, target.dtype)}"
            )
        value = value.astype(want)
    shape = tuple(target.shape)
    if value.shape != shape:
        try:
            ok = jnp.broadcast_shapes(value.shape, shape) == shape
        except ValueError:
            ok = False
        if not ok:
            raise RuntimeError(
                f"output with shape {list(shape)} doesn't match the broadcast shape {list(value.shape)}"
            )
        value = jnp.broadcast_to(value, shape)
    tpu_device.note_output(value)
    write(target, value)


Compute = Callable[[Any, tuple, dict], Any]  # (op, args, kwargs) -> JAX value(s) of the functional sibling


def _sibling_compute(func: Any, sibling: Any) -> Compute | None:
    """How a mutating op computes what it writes: its functional sibling's lowering, or the
    sibling run through dispatch (its decomposition); None when it has neither (or the sibling
    lacks some of the op's arguments, e.g. ``randperm.generator_out`` -> ``randperm``)."""
    lowering = get_lowering(sibling)
    if lowering is not None:
        return lambda func, args, kwargs: _execute(func, lowering, args, kwargs)
    names = {a.name for a in sibling._schema.arguments}
    inputs = [a for a in func._schema.arguments if a.alias_info is None or not a.alias_info.is_write]
    if decompositions.decomposition(sibling) is None or any(a.name not in names for a in inputs):
        return None

    def decomposed(func: Any, args: tuple, kwargs: dict) -> Any:
        out = sibling(*args, **kwargs)
        fallback.count_decomposed(func)
        return pytree.tree_map_only(TpuTensor, to_jax, out)

    return decomposed


def _inplace_handler(compute: Compute, lowering: Lowering | None = None) -> Handler:
    """``op_(target, ...)``: compute the functional sibling (``lowering``, when it has one), store
    into the target."""
    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        out = compute(func, args, kwargs)
        target = args[0]
        if isinstance(target, (list, tuple)):
            for t, v in zip(target, out):
                _store(t, v)
            return None
        exact = type(out) is _ARRAY and type(target) is TpuTensor and out.shape == target.shape \
            and out.dtype == to_jax_dtype(target.dtype)
        _store(target, out)
        if exact and lowering is not None:  # later calls store the program's output as it is
            _note_fast(func, lowering, args, kwargs)
            _FAST_INPLACE.add(func)
        return target

    return run


_checked_out_dtypes: set[tuple] = set()


def _check_out_dtypes(func: Any, args: tuple, kwargs: dict) -> None:
    """Raise torch's error when an out= call's out tensors have a dtype the op refuses (``nonzero``
    and ``argmax`` write int64 only, ``index_select`` its input's dtype ...), which storing the result
    with torch's casting rules would accept. The op's meta kernel is the quick check; when it objects
    (or the op has none) the CPU kernel, run on zeros, decides. Once per op and argument dtypes."""
    leaves = pytree.tree_leaves((args, kwargs))
    key = (func, *(x.dtype for x in leaves if isinstance(x, torch.Tensor)))
    if key in _checked_out_dtypes:
        return
    meta_args, meta_kwargs = pytree.tree_map_only(
        torch.Tensor, lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta"), (args, kwargs))
    try:
        func(*meta_args, **meta_kwargs)
    except Exception:  # noqa: BLE001  (the CPU kernel says whether the call is wrong)
        host_args, host_kwargs = _host_zeros(args, kwargs)
        func(*host_args, **host_kwargs)
    _checked_out_dtypes.add(key)


def _out_handler(compute: Compute, out_names: list[str], factory_kwargs: list[str]) -> Handler:
    """``op(..., out=targets)``; ``factory_kwargs`` (``dtype``, ``device``): the functional sibling's
    arguments taken from the first target (a factory's result must be made where it goes)."""
    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        _check_out_dtypes(func, args, kwargs)
        targets = [kwargs[n] for n in out_names]
        rest = {k: v for k, v in kwargs.items() if k not in out_names}
        for name in factory_kwargs:
            rest.setdefault(name, getattr(targets[0], name))
        out = compute(func, args, rest)
        values = out if isinstance(out, (tuple, list)) else [out]
        for t, v in zip(targets, values):
            if type(t) is TpuTensor:
                metadata_ops.resize_output(t, v.shape)
            _store(t, v)
        return targets[0] if len(targets) == 1 else tuple(targets)

    return run


def _view_handler(func: Any, args: tuple, kwargs: dict) -> Any:
    source = args[0]
    if type(source) is not TpuTensor:
        return fallback.run_on_cpu(func, args, kwargs)
    box = source._box

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


def _fast_view(layout: Callable[..., tuple | None]) -> Handler:
    """A view handler computing (sizes, strides, offset) in Python; meta tensors for the rest."""

    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        t = args[0]
        if type(t) is TpuTensor and not kwargs and t._math_bits is None:
            meta = layout(tuple(t.shape), t.stride(), t.storage_offset(), *args[1:])
            if meta is not None:
                return make_alias(t._box, meta[0], meta[1], meta[2], t.dtype)
        return _view_handler(func, args, kwargs)

    return run


def _layout_t(size, stride, offset):
    if len(size) > 2:
        return None  # the meta kernel raises torch's error
    return (size[::-1], stride[::-1], offset) if len(size) == 2 else (size, stride, offset)


def _in_range(dim: int, n: int) -> bool:
    """Whether ``dim`` is a dim of an ``n``-d layout; the fast views leave any other call to the
    meta kernels, which raise torch's errors."""
    return -n <= dim < n


def _layout_transpose(size, stride, offset, d0, d1):
    n = len(size)
    if not (_in_range(d0, n) and _in_range(d1, n)):
        return None
    d0, d1 = d0 % n, d1 % n
    size, stride = list(size), list(stride)
    size[d0], size[d1] = size[d1], size[d0]
    stride[d0], stride[d1] = stride[d1], stride[d0]
    return size, stride, offset


def _layout_permute(size, stride, offset, dims):
    n = len(size)
    if len(dims) != n or not n or not all(_in_range(d, n) for d in dims):
        return None
    dims = [d % n for d in dims]
    if len(set(dims)) != n:
        return None
    return [size[d] for d in dims], [stride[d] for d in dims], offset


def _layout_unsqueeze(size, stride, offset, dim):
    n = len(size)
    if not -n - 1 <= dim <= n:
        return None
    dim %= n + 1
    new_stride = stride[dim] * size[dim] if dim < n else 1
    return size[:dim] + (1,) + size[dim:], stride[:dim] + (new_stride,) + stride[dim:], offset


def _layout_view(size, stride, offset, shape):
    if stride != tensor_mod._contiguous_strides(size):
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
    return shape, tensor_mod._contiguous_strides(shape), offset


def _layout_select(size, stride, offset, dim, index):
    n = len(size)
    if not _in_range(dim, n):
        return None
    dim %= n
    if not -size[dim] <= index < size[dim]:
        return None
    index %= size[dim]
    return size[:dim] + size[dim + 1:], stride[:dim] + stride[dim + 1:], offset + index * stride[dim]


def _layout_slice(size, stride, offset, dim=0, start=None, end=None, step=1):
    n = len(size)
    if not _in_range(dim, n) or step <= 0:
        return None
    dim %= n
    start, end, _ = slice(start, end, step).indices(size[dim])
    length = max(0, -(-(end - start) // step))
    new_size, new_stride = list(size), list(stride)
    new_size[dim], new_stride[dim] = length, stride[dim] * step
    return new_size, new_stride, offset + (start * stride[dim] if length else 0)


def _layout_expand(size, stride, offset, shape, implicit=False):
    lead = len(shape) - len(size)
    if lead < 0:
        return None
    new_size, new_stride = [], []
    for i, s in enumerate(shape):
        if i < lead:
            if s < 0:
                return None
            new_size.append(s), new_stride.append(0)
            continue
        old = size[i - lead]
        if s == -1 or s == old:
            new_size.append(old), new_stride.append(stride[i - lead])
        elif old == 1:
            new_size.append(s), new_stride.append(0)
        else:
            return None
    return new_size, new_stride, offset


def _same_view_handler(func: Any, args: tuple, kwargs: dict) -> Any:
    """detach / alias: same metadata over the same box."""
    t = args[0]
    if t._math_bits is not None:
        return _view_handler(func, args, kwargs)
    return make_alias(t._box, t.shape, t.stride(), t.storage_offset(), t.dtype)


def _lift_fresh(func: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.tensor(data, device="tpu")`` lifts the tpu tensor it made from ``data``. Tracing modes
    (torch.compile's fake, functional and proxy modes) pass tensor subclasses on to their own
    dispatch: under them the data is lifted as the plain CPU tensor it was, then moved to the device
    by a traced copy (the graph of ``torch.tensor(data).to("tpu")``)."""
    if torch._C._len_torch_dispatch_stack():
        return func(to_cpu(args[0])).to(tensor_mod.DEVICE)
    return _same_view_handler(func, args, kwargs) if func is aten.lift_fresh.default else _clone(func, args, kwargs)


def _fallback_handler(func: Any, args: tuple, kwargs: dict) -> Any:
    return fallback.run_on_cpu(func, args, kwargs)


# --- dedicated handlers ----------------------------------------------------------------------


def _copy_(func: Any, args: tuple, kwargs: dict) -> Any:
    dst, src = args[0], args[1]
    if type(dst) is not TpuTensor:
        dst.copy_(to_cpu(src))
        return dst
    value = to_jax(src) if isinstance(src, TpuTensor) else cpu_to_jax(src)
    value = value.astype(to_jax_dtype(dst.dtype))
    if value.shape != tuple(dst.shape):
        try:
            value = jnp.broadcast_to(value, tuple(dst.shape))
        except ValueError:
            torch.empty(dst.shape, device="meta").copy_(torch.empty(src.shape, device="meta"))
            raise
    tpu_device.note_output(value)
    write(dst, value)
    return dst


def _copy_from(func: Any, args: tuple, kwargs: dict) -> Any:
    src, dst = args[0], args[1]
    return _copy_(func, (dst, src), {})


def _to_copy(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    dtype = kwargs.get("dtype") or x.dtype
    device = kwargs.get("device")
    strides = formats.copy_strides(x, kwargs.get("memory_format"))
    if device is not None and torch.device(device).type != tensor_mod.DEVICE_NAME:
        host = to_cpu(x)
        if strides is not None:
            host = torch.empty_strided(x.shape, strides, dtype=host.dtype).copy_(host)
        return host.to(device=device, dtype=dtype)
    value = to_jax(x)
    want = to_jax_dtype(dtype)
    if value.dtype != want:
        value = value.astype(want)
    tpu_device.note_output(value)
    return formats.laid_out(value, strides, dtype)


def _clone(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    value = to_jax(x)  # arrays are immutable: sharing the value is a copy
    fallback.count_lowered(func)
    strides = formats.copy_strides(x, kwargs.get("memory_format"))
    return _wrap(value) if strides is None else formats.laid_out(value, strides, x.dtype)


# ``*_like(x)`` factories: a new tensor laid out like ``x`` (its memory_format, preserve by default)
_LIKE_FACTORIES = frozenset({aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
                             aten.full_like.default})


def _like_handler(lowered: Handler) -> Handler:
    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        out = lowered(func, args, kwargs)
        strides = formats.copy_strides(args[0], kwargs.get("memory_format"))
        return out if strides is None else formats.laid_out(to_jax(out), strides, out.dtype)

    return run


def _local_scalar_dense(func: Any, args: tuple, kwargs: dict) -> Any:
    value = np.asarray(to_jax(args[0])).reshape(-1)[0]
    if value.dtype == np.bool_:
        return bool(value)
    if np.issubdtype(value.dtype, np.integer):
        return int(value)
    if np.issubdtype(value.dtype, np.complexfloating):
        return complex(value)
    return float(value)


def _equal(func: Any, args: tuple, kwargs: dict) -> bool:
    a, b = (_unwrap(x) for x in args[:2])
    return a.shape == b.shape and bool(jnp.array_equal(a, b))


_SPECIAL: dict[Any, Handler] = {
    aten.is_pinned.default: lambda func, args, kwargs: False,  # pinning is for host memory
    # one in-order stream (torch.tpu.Stream): nothing can reuse the memory before the work is done
    aten.record_stream.default: lambda func, args, kwargs: None,
    aten.copy_.default: _copy_,
    aten._copy_from.default: _copy_from,
    aten._to_copy.default: _to_copy,
    aten.clone.default: _clone,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.equal.default: _equal,
    aten.detach.default: _same_view_handler,
    aten.alias.default: _same_view_handler,
    aten.lift_fresh.default: _lift_fresh,
    aten.lift_fresh_copy.default: _lift_fresh,
    aten.t.default: _fast_view(_layout_t),
    aten.transpose.int: _fast_view(_layout_transpose),
    aten.permute.default: _fast_view(_layout_permute),
    aten.unsqueeze.default: _fast_view(_layout_unsqueeze),
    aten.view.default: _fast_view(_layout_view),
    aten.select.int: _fast_view(_layout_select),
    aten.slice.Tensor: _fast_view(_layout_slice),
    aten.expand.default: _fast_view(_layout_expand),
    **metadata_ops.HANDLERS,
}


# --- handler selection -----------------------------------------------------------------------


def _is_view(schema: Any) -> bool:
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    return bool(schema.returns) and schema.returns[0].alias_info is not None


def _positional_signature(schema: Any) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in schema.arguments if not a.kwarg_only]


def _keyword_inputs(schema: Any) -> set[str]:
    return {a.name for a in schema.arguments
            if a.kwarg_only and (a.alias_info is None or not a.alias_info.is_write)}


def _sibling_by_signature(packet: Any, schema: Any) -> Any:
    """The non-mutating overload of ``packet`` with ``schema``'s positional arguments that takes
    every keyword input of ``schema`` (``div.out_mode`` -> ``div.Tensor_mode``, not ``div.Tensor``),
    the one with the fewest keywords when several do."""
    signature, keywords = _positional_signature(schema), _keyword_inputs(schema)
    matches = []
    for name in packet.overloads():
        overload = getattr(packet, name)
        mutable = any(a.alias_info is not None and a.alias_info.is_write for a in overload._schema.arguments)
        if not mutable and _positional_signature(overload._schema) == signature:
            if keywords <= _keyword_inputs(overload._schema):
                matches.append(overload)
    return min(matches, key=lambda o: len(_keyword_inputs(o._schema)), default=None)


_INPLACE_SIBLINGS = {"normal_": "normal_functional"}


def _functional_sibling(func: Any) -> Any:
    """The non-mutating overload computing what an in-place or out= overload writes."""
    schema = func._schema
    base = schema.name.split("::")[1]
    write_args = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if all(a.kwarg_only for a in write_args):  # out= variant: same packet, without the out args
        packet = getattr(aten, base, None)
        return packet and _sibling_by_signature(packet, schema)
    if not base.endswith("_"):
        return None
    packet = getattr(aten, _INPLACE_SIBLINGS.get(base, base[:-1]), None)
    if packet is None:
        return None
    same = getattr(packet, func._overloadname, None)
    if same is not None:
        return same
    return _sibling_by_signature(packet, schema)


def _make_handler(func: Any) -> Handler:
    special = _SPECIAL.get(func)
    if special is not None:
        return special
    schema = func._schema
    if decompositions.is_composite(func) and (_is_view(schema) or get_lowering(func) is None):
        return decompositions.handler(func, func.decompose)
    if _is_view(schema):
        return _view_handler
    own = get_lowering(func)
    if own is not None and own.writes:  # updates inputs through its lowering's ``writes``
        return _lowered_handler(own)
    write_args = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if write_args:
        sibling = _functional_sibling(func)
        if sibling is not None and _is_view(sibling._schema):
            return metadata_ops.inplace_view_handler(sibling)
        compute = _sibling_compute(func, sibling) if sibling is not None else None
        if compute is None:
            return _fallback_handler
        if all(a.kwarg_only for a in write_args):
            taken = {a.name for a in sibling._schema.arguments}
            factory_kwargs = [name for name in ("dtype", "device") if name in taken]
            return _out_handler(compute, [a.name for a in write_args], factory_kwargs)
        if write_args[0] is schema.arguments[0] and len(write_args) == 1:
            return _inplace_handler(compute, get_lowering(sibling))
        return _fallback_handler
    lowering = get_lowering(func)
    if lowering is not None:
        if func in _LIKE_FACTORIES:
            return _like_handler(_lowered_handler(lowering))
        return _lowered_handler(lowering)
    decomposition = decompositions.decomposition(func)
    return decompositions.handler(func, decomposition) if decomposition is not None else _fallback_handler


tensor_mod._dispatch = dispatch
