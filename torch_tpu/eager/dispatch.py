"""Eager dispatch of aten ops on tpu tensors: one cached handler per OpOverload.

The handler for an op is decided once (first call) from its schema and the registry:
view op -> alias the input's storage box with metadata computed on meta tensors;
in-place / out= op -> run the functional sibling's lowering and write into the target(s);
lowered op -> unwrap to JAX arrays, run through the current mode's executor, wrap;
op with a decomposition -> run it on the tpu tensors (``torch_tpu.ops.decompositions``, counted);
op a library registered a tpu kernel for (``torch.library`` "TPU" key) -> that kernel;
anything else -> CPU fallback (counted). A few ops that cross devices or return Python values
(``copy_``, ``_to_copy``, ``_local_scalar_dense`` ...) have dedicated handlers.

The handlers live in ``torch_tpu.eager.handlers`` and ``torch_tpu.eager.views``; this module picks
one per op (:func:`_make_handler`) and runs the fast path. ``torch_tpu.eager.register()`` makes
:func:`dispatch` the tensor model's ``__torch_dispatch__`` target.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._library import custom_ops as _custom_ops

from torch_tpu.eager import collectives, fallback, modes, op_jit, sparse
from torch_tpu.eager.handlers import (
    LIKE_FACTORIES,
    clone_handler,
    decomposed_handler,
    eager_lowering,
    equal_handler,
    fallback_handler,
    fast_signature,
    inplace_handler,
    lift_fresh_handler,
    like_handler,
    lowered_handler,
    out_handler,
    sibling_compute,
    to_copy_handler,
    wrap_outputs,
)
from torch_tpu.eager.views import (
    fast_view,
    layout_expand,
    layout_permute,
    layout_select,
    layout_slice,
    layout_t,
    layout_transpose,
    layout_unsqueeze,
    layout_view,
    same_view_handler,
    view_handler,
)
from torch_tpu.ops import decompositions, metadata_ops
from torch_tpu.ops.kernels import copy_from_kernel, copy_kernel, local_scalar_dense_kernel
from torch_tpu.runtime import device as tpu_device
from torch_tpu.runtime import dtypes, memory_format, precision
from torch_tpu.runtime import generator as tpu_generator
from torch_tpu.runtime import tensor as tpu_tensor
from torch_tpu.runtime._jax import ARRAY_TYPE
from torch_tpu.runtime.tensor import to_jax

aten = torch.ops.aten
Handler = Callable[[Any, tuple, dict], Any]
_HANDLERS: dict[Any, Handler] = {}
_ARRAY = ARRAY_TYPE
_STRICT = modes.EagerMode.STRICT
_MODE = modes.current_mode_cell  # [the eager mode]
_COUNTS = fallback.LOWERED_COUNTS
_LAST_OUTPUT = tpu_device.last_output
_FAST = op_jit.fast
_OP_JIT = op_jit.settings
_STATS = op_jit.counters
_TORCH_PRECISION = precision.torch_matmul_precision
_SEEN_PRECISION = precision.seen_torch_setting
_SYNC_PRECISION = precision.sync
_TORCH_DTYPES = dtypes.JAX_TO_TORCH
_WRAP_OWNED = tpu_tensor.wrap_owned


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    if _TORCH_PRECISION() != _SEEN_PRECISION[0]:  # torch.set_float32_matmul_precision reaches JAX
        _SYNC_PRECISION()  # before the op traces (and the program cache keys on it)
    if _MODE[0] is _STRICT and _OP_JIT["enabled"]:
        found = fast_signature(func, args, kwargs)
        if found is not None:
            entry = _FAST.get(found[0])
            if entry is not None and entry[0] is func:  # (func, program, name, in place)
                try:
                    out = entry[1](*found[1])
                except Exception:  # noqa: BLE001  (what the lowering rejects: the full path raises torch's error)
                    _FAST.pop(found[0], None)
                else:
                    _COUNTS[entry[2]] += 1
                    _STATS.hits += 1
                    if entry[3]:  # op_(target, ...): the target's full array is replaced
                        target = args[0]
                        target.storage_box.array = _LAST_OUTPUT[0] = out
                        return target
                    if type(out) is _ARRAY:  # from_jax, its dtype conversion inlined
                        aval = out.aval
                        dtype = _TORCH_DTYPES.get(aval.dtype)
                        if dtype is not None:
                            _LAST_OUTPUT[0] = out
                            return _WRAP_OWNED(out, aval.shape, dtype)
                    return wrap_outputs(out)
    handler = _HANDLERS.get(func)
    if handler is None:
        handler = _HANDLERS[func] = sparse.routed(func, tpu_generator.checked(func, _make_handler(func)))
    return handler(func, args, kwargs)


def clear_handler_cache() -> None:
    """Forget cached per-op handlers and compiled per-op programs (after registering new lowerings)."""
    _HANDLERS.clear()
    op_jit.clear()  # the fast path's programs too


_SPECIAL: dict[Any, Handler] = {
    aten.is_pinned.default: lambda func, args, kwargs: False,  # pinning is for host memory
    # one in-order stream (torch.tpu.Stream): nothing can reuse the memory before the work is done
    aten.record_stream.default: lambda func, args, kwargs: None,
    aten.copy_.default: copy_kernel,
    aten._copy_from.default: copy_from_kernel,
    aten._to_copy.default: to_copy_handler,
    aten.clone.default: clone_handler,
    aten._local_scalar_dense.default: local_scalar_dense_kernel,
    aten.equal.default: equal_handler,
    aten.detach.default: same_view_handler,
    aten.alias.default: same_view_handler,
    aten.lift_fresh.default: lift_fresh_handler,
    aten.lift_fresh_copy.default: lift_fresh_handler,
    aten.t.default: fast_view(layout_t),
    aten.transpose.int: fast_view(layout_transpose),
    aten.permute.default: fast_view(layout_permute),
    aten.unsqueeze.default: fast_view(layout_unsqueeze),
    aten.view.default: fast_view(layout_view),
    aten.select.int: fast_view(layout_select),
    aten.slice.Tensor: fast_view(layout_slice),
    aten.expand.default: fast_view(layout_expand),
    **metadata_ops.HANDLERS,
}


def _column_major(handler: Handler) -> Handler:
    """``nonzero``'s result laid out as CPU lays it out: ``[n, ndim]`` with strides ``(1, n)``."""
    def run(func: Any, args: tuple, kwargs: dict) -> Any:
        out = handler(func, args, kwargs)
        return memory_format.laid_out(to_jax(out), (1, out.shape[0]), out.dtype)

    return run


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


_PRIVATEUSE1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
# PyTorch's own ops keep their paths (lowerings, decompositions, the CPU fallback): their generic
# PrivateUse1 kernels (fsdp's copy-ins, collectives) are not a device implementation
_TORCH_NAMESPACES = frozenset({"aten", "prims", "fsdp"}) | decompositions.COLLECTIVE_NAMESPACES


def _has_library_kernel(func: Any) -> bool:
    """A non-aten op with a kernel for tpu tensors from its library: registered for the "TPU"
    (PrivateUse1) key (TorchRec's Pallas kernels, its fbgemm routing), or a ``torch.library.custom_op``
    (its Python function serves every device): the op's device implementation."""
    if func.namespace in _TORCH_NAMESPACES:
        return False
    return (torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "PrivateUse1")
            or func.name() in _custom_ops.OPDEFS)


def _library_kernel_handler(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run the library's tpu kernel on the tpu tensors; where its Pallas kernel cannot run on this
    platform (a SparseCore kernel off TPU), the op's CPU kernel, counted as a fallback, from then on."""
    try:
        return func.redispatch(_PRIVATEUSE1, *args, **kwargs)
    except fallback.KernelUnavailable:
        _HANDLERS[func] = fallback_handler
        return fallback_handler(func, args, kwargs)


def _awaiting_library_kernel(func: Any, args: tuple, kwargs: dict) -> Any:
    """A library op without a tpu kernel yet: the CPU fallback until its library registers one
    (TorchRec's Pallas kernels register when ``pallas/impl.py`` is imported, perhaps after a first call)."""
    if _has_library_kernel(func):
        _HANDLERS[func] = _library_kernel_handler
        return _library_kernel_handler(func, args, kwargs)
    return fallback_handler(func, args, kwargs)


def _make_handler(func: Any) -> Handler:
    handler = _decide_handler(func)
    if handler is fallback_handler and func.namespace not in _TORCH_NAMESPACES:
        return _awaiting_library_kernel
    return handler


def _decide_handler(func: Any) -> Handler:
    special = _SPECIAL.get(func)
    if special is not None:
        return special
    if collectives.is_collective(func):
        return collectives.run_collective
    schema = func._schema
    if decompositions.is_composite(func) and (_is_view(schema) or eager_lowering(func) is None):
        return decomposed_handler(func, func.decompose)
    if _is_view(schema):
        return view_handler
    own = eager_lowering(func)
    if own is not None and own.writes:  # updates inputs through its lowering's ``writes``
        return lowered_handler(own)
    if own is None and _has_library_kernel(func):
        return _library_kernel_handler
    write_args = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if write_args:
        sibling = _functional_sibling(func)
        if sibling is not None and _is_view(sibling._schema):
            return metadata_ops.inplace_view_handler(sibling)
        compute = sibling_compute(func, sibling) if sibling is not None else None
        if compute is None:
            return fallback_handler
        if all(a.kwarg_only for a in write_args):
            taken = {a.name for a in sibling._schema.arguments}
            factory_kwargs = [name for name in ("dtype", "device") if name in taken]
            return out_handler(compute, [a.name for a in write_args], factory_kwargs)
        if write_args[0] is schema.arguments[0] and len(write_args) == 1:
            return inplace_handler(compute, eager_lowering(sibling))
        return fallback_handler
    lowering = eager_lowering(func)
    if lowering is not None:
        if func in LIKE_FACTORIES:
            return like_handler(lowered_handler(lowering))
        if func is aten.nonzero.default:
            return _column_major(lowered_handler(lowering))
        return lowered_handler(lowering)
    decomposition = decompositions.decomposition(func)
    return decomposed_handler(func, decomposition) if decomposition is not None else fallback_handler


