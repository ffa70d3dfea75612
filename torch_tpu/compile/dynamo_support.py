"""Let Dynamo and AOTAutograd take tpu tensors as graph inputs like plain tensors.

Dynamo wraps a tensor subclass as a tensor only when it keeps torch's ``__torch_dispatch__`` or is
a traceable (flattenable) subclass; :class:`~torch_tpu.tensor.TpuTensor` is neither (its elements
live in a JAX array), so Dynamo would trace INTO its ``__torch_dispatch__`` on meta tensors.
:func:`install` routes TpuTensor values to Dynamo's plain-tensor wrapper (fake tensors on device
tpu:0), keeps Dynamo out of torch_tpu's and JAX's own frames (eager work between graphs calls
into them from C++), and gives TpuTensor the tangent hook AOTAutograd calls when a backward's incoming
gradient is a subclass instance: a TpuTensor already has the metadata of a plain tpu tensor.

Stopgap until ``torch_tpu.tensor`` provides both itself; each part is skipped when already present.
"""

from __future__ import annotations

from typing import Any

from torch._dynamo import trace_rules
from torch._dynamo.variables import builder

from torch_tpu.tensor import TpuTensor


def _coerce_same_metadata_as_tangent(self: TpuTensor, expected_metadata: Any, expected_type: Any = None) -> TpuTensor:
    return self


def install() -> None:
    for package in ("torch_tpu", "jax", "jaxlib"):
        trace_rules.add(package)
    if not hasattr(TpuTensor, "__coerce_same_metadata_as_tangent__"):
        TpuTensor.__coerce_same_metadata_as_tangent__ = _coerce_same_metadata_as_tangent
    wrap = builder.VariableBuilder._wrap
    if getattr(wrap, "_tpu_tensor_as_plain", False):
        return

    def _wrap(self: Any, value: Any) -> Any:
        if type(value) is TpuTensor:
            return self.wrap_tensor(value)
        return wrap(self, value)

    _wrap._tpu_tensor_as_plain = True
    builder.VariableBuilder._wrap = _wrap
