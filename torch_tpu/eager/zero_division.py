"""Integer division by zero. CPU torch raises ``RuntimeError("ZeroDivisionError")`` for an integer
``//``, ``%``, ``fmod`` or ``div(..., rounding_mode=...)`` by zero; XLA returns a number
(``x // 0 == -1`` truncated, ``-2`` floored for int64, ``x % 0 == 0``, all bits set for unsigned).

Eager dispatch refuses a zero divisor given as a Python number or a CPU tensor in every mode (no
device read). A tpu tensor divisor is read only in the ``debug`` mode (one device->host read per
integer division); ``strict`` and ``defer_and_fuse`` eager, and compiled programs, return XLA's
numbers, as ``torch_xla`` does.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_tpu.runtime._jax import jax, jnp
from torch_tpu.runtime.tensor import TpuTensor, to_jax

aten = torch.ops.aten

_ROUNDED = frozenset({aten.div.Tensor_mode, aten.div.Scalar_mode})  # integral only with a rounding mode
_INTEGER_DIVISIONS = _ROUNDED | {
    aten.floor_divide.default, aten.floor_divide.Scalar, aten.remainder.Tensor, aten.remainder.Scalar,
    aten.remainder.Scalar_Tensor, aten.fmod.Tensor, aten.fmod.Scalar,
}


def _integral(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return not (x.dtype.is_floating_point or x.dtype.is_complex)
    return isinstance(x, int)  # bool too


def check(op: Any, args: tuple, kwargs: dict, read_device: bool) -> None:
    """Raise CPU's error when ``op`` is an integer division whose divisor holds a zero; a tpu tensor
    divisor is read only when ``read_device``."""
    if op not in _INTEGER_DIVISIONS or len(args) < 2:
        return
    if op in _ROUNDED and kwargs.get("rounding_mode", args[2] if len(args) > 2 else None) is None:
        return
    dividend, divisor = args[0], args[1]
    if not (_integral(dividend) and _integral(divisor)):
        return
    if isinstance(divisor, TpuTensor):
        if not read_device or not divisor.numel():
            return
        zero = bool(jax.device_get(jnp.any(to_jax(divisor) == 0)))
    elif isinstance(divisor, torch.Tensor):
        zero = bool((divisor == 0).any())
    else:
        zero = divisor == 0
    if zero:
        raise RuntimeError("ZeroDivisionError")
