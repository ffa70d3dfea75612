"""``Module.to("tpu")`` / ``.cpu()`` / ``.tpu()`` keep Parameter objects, as ``.cuda()`` does.

``nn.Module._apply`` keeps a Parameter (it assigns ``param.data``) only when
``torch._has_compatible_shallow_copy_type(param, converted)`` holds, true between CPU and CUDA.
A tpu tensor is a Python wrapper subclass, so between CPU and tpu it does not hold (and ``.data``
cannot change a tensor's Python class): torch would make a new Parameter per module, breaking
weight ties, ``p is q`` identity and optimizers built before the move. For a module whose own
parameters cross between CPU and tpu, ``_apply`` runs with torch's swap semantics
(``torch.__future__.set_swap_module_params_on_conversion``), which keep the Parameter object and
swap its contents. Other conversions are left to torch as they are.

A lazy module's ``UninitializedParameter`` / ``UninitializedBuffer`` cannot become a tpu tensor
and stay lazy (the tpu tensor is a wrapper subclass, which they cannot wrap): such a tensor stays
on the host, uninitialised, and the conversion is applied to the module again right after its
first forward materialises it (a forward pre-hook that runs after the lazy module's own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from torch_tpu.runtime.tensor import TpuTensor

_module_apply = torch.nn.Module._apply
_PENDING = "_torch_tpu_conversions_after_initialization"


def _crosses_host_and_tpu(before: torch.Tensor, after: torch.Tensor) -> bool:
    """A CPU <-> tpu conversion: the pair CUDA would give ``.data`` semantics, which tpu cannot."""
    before_tpu, after_tpu = isinstance(before, TpuTensor), isinstance(after, TpuTensor)
    host = after if before_tpu else before
    return before_tpu != after_tpu and host.device.type == "cpu"


def _apply(self: torch.nn.Module, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> torch.nn.Module:
    if recurse:
        for module in self.children():
            module._apply(fn)
    lazy = [(store, name, t) for store in (self._parameters, self._buffers) for name, t in store.items()
            if is_lazy(t) and _moves_to_tpu(t, fn)]
    if not lazy:
        return _apply_own(self, fn)
    for store, name, _ in lazy:
        del store[name]
    try:
        _apply_own(self, fn)
    finally:
        for store, name, t in lazy:
            store[name] = t
    _convert_after_initialization(self, fn)
    return self


def _moves_to_tpu(lazy: torch.Tensor, fn: Callable[[torch.Tensor], Any]) -> bool:
    """Whether ``fn`` takes a lazy tensor's host storage to tpu (probed on a plain empty tensor:
    the lazy ones refuse to become a tpu tensor)."""
    probe = torch.empty(0, dtype=lazy.dtype, device=lazy.device)
    with torch.no_grad():
        return _crosses_host_and_tpu(probe, fn(probe))


def _convert_after_initialization(module: torch.nn.Module, fn: Callable[[torch.Tensor], Any]) -> None:
    pending = module.__dict__.setdefault(_PENDING, [])
    if not pending:
        def convert(mod: torch.nn.Module, args: Any) -> None:
            if any(is_lazy(t) for t in (*mod._parameters.values(), *mod._buffers.values())):
                return
            handle.remove()
            for conversion in mod.__dict__.pop(_PENDING):
                _apply(mod, conversion, recurse=False)

        handle = module.register_forward_pre_hook(convert)
    pending.append(fn)


def _apply_own(self: torch.nn.Module, fn: Callable[[torch.Tensor], Any]) -> torch.nn.Module:
    """``_apply`` of the module's own parameters and buffers."""
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
