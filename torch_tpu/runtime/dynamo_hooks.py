"""Let Dynamo take tpu tensors as graph inputs like plain tensors (any backend, not only "tpu").

Dynamo wraps a tensor subclass as a tensor only when it keeps torch's ``__torch_dispatch__`` or is
a traceable (flattenable) subclass; :class:`~torch_tpu.runtime.tensor.TpuTensor` is neither (its elements
live in a JAX array), so Dynamo would trace INTO its ``__torch_dispatch__`` on meta tensors.
:func:`install` routes TpuTensor values to Dynamo's plain-tensor wrapper (fake tensors on device
tpu:0) and keeps Dynamo out of torch_tpu's and JAX's own frames (eager work between graphs calls
into them from C++), and makes errors of AOTAutograd's tracing modes inside a traced backward raise
(:func:`torch_tpu.runtime.backward_errors.guard_mode`) instead of aborting. It also gives Dynamo the "tpu"
device interface (:mod:`torch_tpu.runtime.dynamo_device`).

Importing Dynamo costs seconds, so when it is not loaded yet the patch runs right after
``torch._dynamo`` finishes importing (a one-shot import hook), not at ``import torch_tpu``.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from torch_tpu.runtime.after_import import call_after_import


def install(tensor_type: type) -> None:
    """Patch Dynamo for ``tensor_type`` now if it is imported, else as soon as it is."""
    call_after_import("torch._dynamo", "optimize", _patcher(tensor_type))


# torch.tpu.ops' Python functions (TorchTPU's namespace) are user code a compiled model calls
# (TorchRec's fused modules unstack their lookups with one; HSTU pads its jagged batches): Dynamo
# traces into them (named, not imported: they are TorchTPU's face, torch_tpu._internal, above the rooms)
TRACED_MODULES = frozenset({"torch_tpu._internal.tpu_namespace", "torch_tpu._internal.tpu_namespace_ops",
                            "torch_tpu._internal.jagged"})


_CONSTANT_RESULTS: list[Callable[..., Any]] = []


def constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Dynamo calls ``fn`` while tracing and takes its result as a constant of the graph
    (``torch.compiler.assume_constant_result``, without importing Dynamo now)."""
    _CONSTANT_RESULTS.append(fn)
    if "torch._dynamo" in sys.modules:
        _mark_constant_results()
    return fn


def _mark_constant_results() -> None:
    import torch._dynamo

    for fn in _CONSTANT_RESULTS:
        torch._dynamo.assume_constant_result(fn)


def _skip_torch_tpu(trace_rules: Any) -> None:
    """Dynamo skips every torch_tpu module but :data:`TRACED_MODULES`: a package holding one is
    skipped module by module (and its ``__init__``), any other package whole."""
    holders = {"torch_tpu", *(prefix for m in TRACED_MODULES for prefix in _parents(m))}
    for name in _skipped("torch_tpu", Path(__file__).resolve().parents[1], holders):
        trace_rules.add(name)
    for package in holders:
        trace_rules.FORCE_SKIP_FILES.add(importlib.util.find_spec(package).origin)


def _skipped(package: str, directory: Path, holders: set[str]) -> Iterator[str]:
    """The modules and packages of ``package`` to skip, found on disk: nothing is imported (this runs
    while torch may be mid-import, when importing ``torch_tpu.compile``, which needs
    ``torch._inductor``, fails and leaves its submodules half-loaded)."""
    import pkgutil

    for info in pkgutil.iter_modules([str(directory)], f"{package}."):
        if info.name in holders:
            yield from _skipped(info.name, directory / info.name.rpartition(".")[2], holders)
        elif info.name not in TRACED_MODULES:
            yield info.name


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@functools.cache
def _patcher(tensor_type: type) -> Any:
    return functools.partial(_patch, tensor_type)


def _patch(tensor_type: type) -> None:
    from torch._dynamo import trace_rules
    from torch._dynamo.variables import builder

    wrap = builder.VariableBuilder._wrap
    if getattr(wrap, "_tpu_tensor_as_plain", False):
        return
    for package in ("jax", "jaxlib"):
        trace_rules.add(package)
    _skip_torch_tpu(trace_rules)
    _mark_constant_results()

    def _wrap(self: Any, value: Any) -> Any:
        if type(value) is tensor_type:
            return self.wrap_tensor(value)
        return wrap(self, value)

    _wrap._tpu_tensor_as_plain = True
    builder.VariableBuilder._wrap = _wrap
    # ... and as a plain TensorVariable, not a __torch_function__ subclass (TpuTensor disables
    # __torch_function__): higher-order ops (torch.ops.higher_order.scan ...) take only plain ones
    infer_subclass_type = builder.infer_subclass_type

    def _infer_subclass_type(value: Any) -> Any:
        return None if type(value) is tensor_type else infer_subclass_type(value)

    builder.infer_subclass_type = _infer_subclass_type

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

    from torch_tpu.runtime import backward_errors

    for mode_type in (FakeTensorMode, FunctionalTensorMode, ProxyTorchDispatchMode):
        backward_errors.guard_mode(mode_type)

    from torch_tpu.runtime import dynamo_device  # imports Dynamo: only here

    dynamo_device.register()
