"""``Module.to("tpu")`` / ``.cpu()`` / ``.tpu()`` keep Parameter objects, as ``.cuda()`` does.

``nn.Module._apply`` keeps a Parameter (it assigns ``param.data``) only when
``torch._has_compatible_shallow_copy_type(param, converted)`` holds, true between CPU and CUDA.
A tpu tensor is a Python wrapper subclass, so between CPU and tpu it does not hold (and ``.data``
cannot change a tensor's Python class): torch would make a new Parameter per module, breaking
weight ties, ``p is q`` identity and optimizers built before the move. For a module whose own
parameters cross between CPU and tpu, ``_apply`` runs with torch's swap semantics
(``torch.__future__.set_swap_module_params_on_conversion``), which keep the Parameter object and
swap its contents. Other conversions are left to torch as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_tpu.runtime.tensor import TpuTensor

_module_apply = torch.nn.Module._apply


def _crosses_host_and_tpu(before: torch.Tensor, after: torch.Tensor) -> bool:
    """A CPU <-> tpu conversion: the pair CUDA would give ``.data`` semantics, which tpu cannot."""
    before_tpu, after_tpu = isinstance(before, TpuTensor), isinstance(after, TpuTensor)
    host = after if before_tpu else before
    return before_tpu != after_tpu and host.device.type == "cpu"


def _apply(self: torch.nn.Module, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> torch.nn.Module:
    if recurse:
        for module in self.children():
            module._apply(fn)
    params = [p for p in self._parameters.values() if p is not None]
    if not params or torch.__future__.get_swap_module_params_on_conversion() \
            or torch.__future__.get_overwrite_module_params_on_conversion():
        return _module_apply(self, fn, recurse=False)
    # each parameter is converted once, here, so that the choice of semantics can look at the result
    with torch.no_grad():
        converted = {id(p): (p, fn(p)) for p in params}
    if not any(_crosses_host_and_tpu(p, new) for p, new in converted.values()):
        return _module_apply(self, _reuse(converted, fn), recurse=False)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return _module_apply(self, _reuse(converted, fn), recurse=False)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def _reuse(converted: dict[int, tuple[torch.Tensor, Any]], fn: Callable[[torch.Tensor], Any]) -> Callable:
    def convert(t: torch.Tensor) -> Any:
        found = converted.get(id(t))
        return found[1] if found is not None and found[0] is t else fn(t)

    return convert


def install() -> None:
    torch.nn.Module._apply = _apply
