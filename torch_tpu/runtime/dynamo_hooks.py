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

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_DYNAMO = "torch._dynamo"


def install(tensor_type: type) -> None:
    """Patch Dynamo for ``tensor_type`` now if it is imported, else as soon as it is."""
    if _DYNAMO in sys.modules and hasattr(sys.modules[_DYNAMO], "optimize"):
        _patch(tensor_type)
    elif not any(isinstance(f, _AfterDynamoImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoImport(tensor_type))


def _patch(tensor_type: type) -> None:
    from torch._dynamo import trace_rules
    from torch._dynamo.variables import builder

    wrap = builder.VariableBuilder._wrap
    if getattr(wrap, "_tpu_tensor_as_plain", False):
        return
    for package in ("torch_tpu", "jax", "jaxlib"):
        trace_rules.add(package)

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


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` with the normal finder, then runs the patch after its module body."""

    def __init__(self, tensor_type: type) -> None:
        self._tensor_type = tensor_type

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: Any) -> None:
            exec_module(module)
            _patch(self._tensor_type)

        spec.loader.exec_module = exec_then_patch
        return spec
