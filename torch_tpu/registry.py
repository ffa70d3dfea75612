"""The op-lowering registry: one table mapping aten ``OpOverload`` -> JAX implementation.

It serves every executor alike: eager dispatch (``torch_tpu.dispatch``), torch.compile (an FX
interpreter over core-ATen graphs running inside one ``jax.jit``) and lazy defer_and_fuse.

Contract of a lowering ``fn``
-----------------------------
* Called as ``fn(*args, **kwargs)`` with the op's arguments as the aten schema gives them, where
  every Tensor is replaced by a ``jax.Array`` (lists of tensors by lists of arrays, ``None`` stays
  ``None``); every other argument is passed unchanged (python numbers, int lists, ``torch.dtype``,
  ``torch.device``, ...). Defaults of omitted schema arguments are NOT filled in: give the Python
  function the same defaults as the schema.
* Returns what the op returns with tensors as ``jax.Array``: one array, or a tuple/list of them.
  Output dtypes follow torch's rules (type promotion, ``int -> float`` for ``sigmoid`` ...):
  use the helpers in ``torch_tpu.lowerings._common``.
* Pure and traceable under ``jax.jit``: no wrapper/box access, no side effects, no host reads of
  array values (``int(x)``). Python logic may depend on shapes, dtypes and non-tensor arguments.
  Ops whose output shape depends on values (``nonzero``) are registered with ``static_shape=False``;
  a jit-based executor must run them eagerly (or pad them).
* Random ops are registered with ``needs_key=True`` and receive a ``key=`` keyword (a JAX PRNG key).
* Mutation is not lowered: in-place ``foo_`` and ``out=`` overloads run their functional sibling
  (``foo``) and the executor writes the result back. View ops (``view``, ``transpose`` ...) have
  value-semantics lowerings here (for graphs); eager dispatch keeps real aliasing on top of them.

API
---
``register_lowering(*ops, needs_key=False, static_shape=True)``  decorator adding ``fn`` for ops.
``get_lowering(op) -> Lowering | None``  the entry for an ``OpOverload`` (``None``: not lowered).
``lowered_ops() -> frozenset``  every registered overload.

Importing ``torch_tpu.lowerings`` fills the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

OpOverload = torch._ops.OpOverload


@dataclass(frozen=True)
class Lowering:
    op: OpOverload
    fn: Callable[..., Any]
    needs_key: bool = False  # random op: fn takes key=<jax PRNG key>
    static_shape: bool = True  # False: output shape depends on input values


_TABLE: dict[OpOverload, Lowering] = {}


def register_lowering(
    *ops: OpOverload, needs_key: bool = False, static_shape: bool = True
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` as the JAX lowering of each of ``ops`` (OpOverloads, e.g. ``aten.add.Tensor``)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            if not isinstance(op, OpOverload):
                raise TypeError(f"register_lowering expects OpOverloads (aten.add.Tensor), got {op!r}")
            if op in _TABLE:
                raise ValueError(f"{op} already has a lowering ({_TABLE[op].fn.__qualname__})")
            _TABLE[op] = Lowering(op, fn, needs_key, static_shape)
        return fn

    return decorate


def get_lowering(op: OpOverload) -> Lowering | None:
    """The registered lowering of ``op``, or None when it has none."""
    return _TABLE.get(op)


def lowered_ops() -> frozenset[OpOverload]:
    """Every op overload with a lowering."""
    return frozenset(_TABLE)
