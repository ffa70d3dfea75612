"""The eager handlers: how a tpu op call runs once ``torch_tpu.eager.dispatch`` chose its kind.

Lowered ops unwrap to JAX arrays, run through the current mode's executor and wrap the result;
in-place and out= ops compute their functional sibling and store into the targets with torch's
casting and shape rules; decomposed ops run their decomposition on tpu tensors (counted, falling
back to CPU when it declines); a few ops that cross devices or aliasing rules have dedicated
handlers. The lowered handler also fills the fast path (``op_jit.fast``) that dispatch tries first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torch_tpu.eager import fallback, modes, op_jit, zero_division
from torch_tpu.eager.views import same_view_handler
from torch_tpu.ops import decompositions, metadata_ops
from torch_tpu.ops.lowerings import indexing
from torch_tpu.ops.registry import Lowering, get_lowering
from torch_tpu.runtime import device as tpu_device
from torch_tpu.runtime import generator as tpu_generator
from torch_tpu.runtime import memory_format as formats
from torch_tpu.runtime import random as tpu_random
from torch_tpu.runtime import tensor as tensor_mod
from torch_tpu.runtime._jax import ARRAY_TYPE, jax, jnp
from torch_tpu.runtime.dtypes import to_jax_dtype, to_torch_dtype
from torch_tpu.runtime.tensor import TpuTensor, cpu_to_jax, from_jax, to_cpu, to_jax, write

aten = torch.ops.aten
Handler = Callable[[Any, tuple, dict], Any]
_ARRAY = ARRAY_TYPE
_STRICT = modes.EagerMode.STRICT
_MODE = modes.current_mode_cell  # [the eager mode]
# The fast path (op_jit.fast): (id of the op, each tensor argument's aval or other argument's value) -> the
# entry (op, op_jit program, op name, in place) whose program ran the op's lowering for such a call;
# dispatch calls it with the tensor arguments' arrays directly (JAX's C++ jit dispatch). Filled by
# the lowered handler once op_jit compiled a program for the signature (so op_jit's size cap holds).
# Calls whose tensors are plain tpu tensors take it; an in-place op's entry (its program's output
# has the target's shape and dtype) stores that output whole into the target.
_KWARGS = object()  # where a fast key's keyword arguments start


def eager_lowering(op: Any) -> Lowering | None:
    """The registry's lowering of ``op`` for eager dispatch (``graph_only`` records are not)."""
    lowering = get_lowering(op)
    return None if lowering is None or lowering.graph_only else lowering


def fast_signature(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, list] | None:
    """(fast key, the tensor arguments' arrays), or None when the call cannot take the fast path
    (a view, a CPU or lazy tensor, a tensor list, an argument of another kind). Keyword arguments
    follow the positional ones by name, sorted: the order op_jit's program takes their arrays in.
    The key starts with ``id(func)`` (an OpOverload hashes in Python); the entry holds ``func``
    itself, which dispatch compares."""
    key: list[Any] = [id(func)]
    arrays = []
    values = args if not kwargs else (*args, _KWARGS, *(x for item in sorted(kwargs.items()) for x in item))
    for a in values:
        kind = type(a)
        if kind is TpuTensor:
            array = a.storage_box.array
            if type(array) is not _ARRAY or not a.whole_storage:
                return None
            aval = array.aval  # shape, dtype, weak type; interned, hashed and compared in C++
            if aval.shape != a.shape:
                return None
            arrays.append(array)
            key.append(aval)
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


def _note_fast(func: Any, lowering: Lowering, args: tuple, kwargs: dict, inplace: bool = False) -> None:
    """After the lowered handler ran ``func``: give the call's signature its op_jit program."""
    program = op_jit.last_program()
    if (program is None or lowering.needs_key or _MODE[0] is not _STRICT or lowering.check is not None
            or indexing.has_bounds_check(lowering.op)):
        return
    found = fast_signature(func, args, kwargs)
    if found is not None:
        op_jit.fast[found[0]] = (func, program, func.__name__, inplace)


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


def wrap_outputs(out: Any) -> Any:
    if type(out) is _ARRAY:
        tpu_device.note_output(out)
        return from_jax(out)
    if isinstance(out, (tuple, list)):
        return type(out)(wrap_outputs(o) for o in out)
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
    zero_division.check(lowering.op, args, kwargs, read_device=_MODE[0] is modes.EagerMode.DEBUG)
    jargs = _unwrap_args(lowering.op, args)
    indexing.check_bounds(lowering.op, jargs)
    jkwargs = {k: _unwrap(v) for k, v in kwargs.items()} if kwargs else {}
    if lowering.check is not None:
        lowering.check(jargs, jkwargs)
    if lowering.needs_key:
        generator = kwargs.get("generator")
        jkwargs["key"] = tpu_random.next_key() if generator is None else tpu_generator.key_from(generator)
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


# --- lowered, in-place and out= handlers -----------------------------------------------------


def lowered_handler(lowering: Lowering) -> Handler:
    if lowering.writes:
        def run_writing(func: Any, args: tuple, kwargs: dict) -> Any:
            return wrap_outputs(_execute(func, lowering, args, kwargs))

        return run_writing

    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        out = _execute(func, lowering, args, kwargs)
        _note_fast(func, lowering, args, kwargs)
        return wrap_outputs(out)

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


def sibling_compute(func: Any, sibling: Any) -> Compute | None:
    """How a mutating op computes what it writes: its functional sibling's lowering, or the
    sibling run through dispatch (its decomposition); None when it has neither (or the sibling
    lacks some of the op's arguments, e.g. ``randperm.generator_out`` -> ``randperm``)."""
    lowering = eager_lowering(sibling)
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


def inplace_handler(compute: Compute, lowering: Lowering | None = None) -> Handler:
    """``op_(target, ...)``: compute the functional sibling (``lowering``, when it has one), store
    into the target."""
    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        out = compute(func, args, kwargs)
        target = args[0]
        if isinstance(target, (list, tuple)):
            for t, v in zip(target, out):
                _store(t, v)
            return None
        exact = type(out) is _ARRAY and type(target) is TpuTensor and out.shape == target.shape\
            and out.dtype == to_jax_dtype(target.dtype)
        _store(target, out)
        if exact and lowering is not None:  # later calls store the program's output as it is
            _note_fast(func, lowering, args, kwargs, inplace=True)
        return target

    return run


_checked_out_dtypes: set[tuple] = set()
# ops whose meta kernels accept any out= dtype where CPU's refuse some (``sort(out=(values, float
# indices))``): the CPU kernel decides for them
_META_SILENT_OUT_DTYPES = frozenset(f"aten::{name}" for name in (
    "sort", "argsort", "kthvalue", "mode", "median", "nanmedian", "cummax", "cummin", "searchsorted", "bucketize"))


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
        meta_decides = func._schema.name not in _META_SILENT_OUT_DTYPES
    except Exception:  # noqa: BLE001  (the CPU kernel says whether the call is wrong)
        meta_decides = False
    if not meta_decides:
        host_args, host_kwargs = _host_zeros(args, kwargs)
        func(*host_args, **host_kwargs)
    _checked_out_dtypes.add(key)


def out_handler(compute: Compute, out_names: list[str], factory_kwargs: list[str]) -> Handler:
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



_decomposing: set[Any] = set()  # ops whose decomposition runs now (re-entered: CPU fallback)


def decomposed_handler(op: Any, fn: decompositions.Decomposition) -> Callable[[Any, tuple, dict], Any]:
    """An eager handler running ``fn`` (the decomposition of ``op``), falling back to CPU when the op
    is re-entered during its own decomposition, when ``fn`` declines (``NotImplemented``) or fails."""

    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        if func in _decomposing:
            return fallback.run_on_cpu(func, args, kwargs)
        _decomposing.add(func)
        try:
            out = fn(*args, **kwargs)
        except fallback.TpuFallbackError:
            raise  # names the unlowered op the decomposition reached
        except NotImplementedError as error:  # reached a kernel no backend-agnostic path has
            if not fallback.fallback_allowed():
                raise fallback.TpuFallbackError(
                    f"{func} has no TPU lowering, its decomposition failed ({error}) and CPU fallback is disabled"
                ) from error
            out = NotImplemented
        except Exception:
            if not fallback.fallback_allowed():
                raise
            out = NotImplemented  # the CPU kernel gives the result (or the error CPU torch raises)
        finally:
            _decomposing.discard(func)
        if out is NotImplemented:
            return fallback.run_on_cpu(func, args, kwargs)
        fallback.count_decomposed(func)
        return out

    return run


def lift_fresh_handler(func: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.tensor(data, device="tpu")`` lifts the tpu tensor it made from ``data``. Tracing modes
    (torch.compile's fake, functional and proxy modes) pass tensor subclasses on to their own
    dispatch: under them the data is lifted as the plain CPU tensor it was, then moved to the device
    by a traced copy (the graph of ``torch.tensor(data).to("tpu")``)."""
    if torch._C._len_torch_dispatch_stack():
        return func(to_cpu(args[0])).to(tensor_mod.DEVICE)
    if func is aten.lift_fresh.default:
        return same_view_handler(func, args, kwargs)
    return clone_handler(func, args, kwargs)


def fallback_handler(func: Any, args: tuple, kwargs: dict) -> Any:
    return fallback.run_on_cpu(func, args, kwargs)


# --- dedicated handlers ----------------------------------------------------------------------


def to_copy_handler(func: Any, args: tuple, kwargs: dict) -> Any:
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


def clone_handler(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    value = to_jax(x)  # arrays are immutable: sharing the value is a copy
    fallback.count_lowered(func)
    strides = formats.copy_strides(x, kwargs.get("memory_format"))
    return wrap_outputs(value) if strides is None else formats.laid_out(value, strides, x.dtype)


# ``*_like(x)`` factories: a new tensor laid out like ``x`` (its memory_format, preserve by default)
LIKE_FACTORIES = frozenset({aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
                             aten.full_like.default})


def like_handler(lowered: Handler) -> Handler:
    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        out = lowered(func, args, kwargs)
        strides = formats.copy_strides(args[0], kwargs.get("memory_format"))
        return out if strides is None else formats.laid_out(to_jax(out), strides, out.dtype)

    return run


def equal_handler(func: Any, args: tuple, kwargs: dict) -> bool:
    a, b = (_unwrap(x) for x in args[:2])
    return a.shape == b.shape and bool(jnp.array_equal(a, b))


