"""The op registry: what an aten ``OpOverload`` does on tpu, as one of two kinds of record.

* a **lowering** (:func:`register_lowering`): a JAX implementation over ``jax.Array`` values. It
  serves every executor alike: eager dispatch (``torch_tpu.eager.dispatch``), torch.compile (an FX
  interpreter over core-ATen graphs running inside one ``jax.jit``) and lazy defer_and_fuse.
* a **composite** (:func:`register_composite`): a function over tpu tensors built from other ops,
  for ops PyTorch gives only device kernels (the SDPA overrideable ops, the Transformer fast
  path). Eager dispatch runs it in the decomposition tier; AOTAutograd decomposes graphs with it.

The lowering modules (``torch_tpu.ops.lowerings``) and the composite modules
(``torch_tpu.ops.attention``, ``torch_tpu.ops.transformer``) fill both tables when
``torch_tpu.ops.register()`` loads them, which ``import torch_tpu`` does once.

Contract of a lowering ``fn``
-----------------------------
* Called as ``fn(*args, **kwargs)`` with the op's arguments as the aten schema gives them, where
  every Tensor is replaced by a ``jax.Array`` (lists of tensors by lists of arrays, ``None`` stays
  ``None``); every other argument is passed unchanged (python numbers, int lists, ``torch.dtype``,
  ``torch.device``, ...). Defaults of omitted schema arguments are NOT filled in: give the Python
  function the same defaults as the schema.
* Returns what the op returns with tensors as ``jax.Array``: one array, or a tuple/list of them.
  Output dtypes follow torch's rules (type promotion, ``int -> float`` for ``sigmoid`` ...):
  use the helpers in ``torch_tpu.ops.lowerings._common``.
* Pure and traceable under ``jax.jit``: no wrapper/box access, no side effects, no host reads of
  array values (``int(x)``). Python logic may depend on shapes, dtypes and non-tensor arguments.
  Ops whose output shape depends on values (``nonzero``) are registered with ``static_shape=False``;
  a jit-based executor must run them eagerly (or pad them).
* Random ops are registered with ``needs_key=True`` and receive a ``key=`` keyword (a JAX PRNG key).
* Mutation is not lowered: in-place ``foo_`` and ``out=`` overloads run their functional sibling
  (``foo``) and the executor writes the result back. View ops (``view``, ``transpose`` ...) have
  value-semantics lowerings here (for graphs); eager dispatch keeps real aliasing on top of them.
* An op that updates some of its inputs besides computing its outputs (batch norm's running
  stats, whether or not the schema marks them ``Tensor(a!)``) is registered with
  ``writes=("running_mean", ...)``: the lowering stays pure and returns the schema's outputs
  followed by one new value per name in ``writes`` (``None``: that input is left unchanged).
  Eager dispatch stores those values into the named tpu tensors; graph executors only accept
  such an op when it writes nothing (functionalized graphs use the op's functional variant).
* A lowering only graphs need is registered with ``graph_only=True`` (``_to_copy`` inside one
  program, where ``device=`` means nothing): eager dispatch has a dedicated handler for the op and
  never uses the record; graph executors (torch.compile, ``train_step``) do.

API
---
``register_lowering(*ops, needs_key=False, static_shape=True, writes=(), graph_only=False)``  decorator adding ``fn``.
``get_lowering(op) -> Lowering | None``  the entry for an ``OpOverload`` (``None``: not lowered).
``lowered_ops() -> frozenset``  every registered overload.
``register_composite(*ops)``  decorator adding a composite ``fn(*args, **kwargs)`` over tpu tensors.
``get_composite(op) -> fn | None``; ``composites() -> dict``  op -> composite, a copy.
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
    writes: tuple[str, ...] = ()  # inputs the op updates; fn returns their new values after the outputs
    graph_only: bool = False  # eager dispatch has a dedicated handler; only graph executors use it
    check: Callable[[tuple, dict], None] | None = None  # eager dispatch's input check (see register_lowering)

    @property
    def num_outputs(self) -> int:
        """How many of ``fn``'s results are the op's own outputs (the rest are ``writes``)."""
        return len(self.op._schema.returns)

    def write_targets(self, args: tuple, kwargs: dict) -> list[Any]:
        """The arguments named by ``writes``, in order, from a call's ``args``/``kwargs``."""
        return [kwargs[name] if name in kwargs else args[i] if i < len(args) else None
                for name, i in zip(self.writes, _positions(self.op, self.writes))]


def _positions(op: OpOverload, names: tuple[str, ...]) -> list[int]:
    index = {a.name: i for i, a in enumerate(op._schema.arguments)}
    return [index[n] for n in names]


def _check_writes(op: OpOverload, writes: tuple[str, ...]) -> None:
    args = {a.name: a for a in op._schema.arguments}
    unknown = [n for n in writes if n not in args]
    if unknown:
        raise ValueError(f"{op}: writes={unknown} are not arguments of {op._schema}")
    annotated = [a.name for a in op._schema.arguments
                 if a.alias_info is not None and a.alias_info.is_write and not a.kwarg_only]
    undeclared = [n for n in annotated if n not in writes]
    if undeclared:
        raise ValueError(f"{op} mutates {undeclared} (Tensor(a!) in its schema): list them in writes=")


_TABLE: dict[OpOverload, Lowering] = {}
# "ns::name.overload" -> (fn, flags) of ops another module defines when it loads (torch._inductor's
# prims.fma): recorded in _TABLE the first time get_lowering is asked for the op
_BY_NAME: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {}
_COMPOSITES: dict[OpOverload, Callable[..., Any]] = {}


def register_lowering(
    *ops: OpOverload, needs_key: bool = False, static_shape: bool = True, writes: tuple[str, ...] = (),
    graph_only: bool = False, check: Callable[[tuple, dict], None] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` as the JAX lowering of each of ``ops`` (OpOverloads, e.g. ``aten.add.Tensor``,
    or the name ``"ns::op.overload"`` of an op that some other module defines when it loads);
    ``writes`` names the inputs the ops update (see the module docstring); ``check(args, kwargs)``,
    called by eager dispatch with a call's concrete JAX arrays before it runs, raises on bad input
    values (such calls skip the per-op fast path)."""
    writes = tuple(writes)
    flags = {"needs_key": needs_key, "static_shape": static_shape, "writes": writes, "graph_only": graph_only,
             "check": check}

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            if isinstance(op, str):  # "prims::fma.default": an op that exists once its module loads
                _BY_NAME[op] = (fn, flags)
                continue
            if not isinstance(op, OpOverload):
                raise TypeError(f"register_lowering expects OpOverloads (aten.add.Tensor), got {op!r}")
            if op in _TABLE:
                raise ValueError(f"{op} already has a lowering ({_TABLE[op].fn.__qualname__})")
            _check_writes(op, writes)
            _TABLE[op] = Lowering(op, fn, needs_key, static_shape, writes, graph_only, check)
        return fn

    return decorate


def get_lowering(op: OpOverload) -> Lowering | None:
    """The registered lowering of ``op``, or None when it has none."""
    found = _TABLE.get(op)
    if found is None and _BY_NAME and isinstance(op, OpOverload):
        pending = _BY_NAME.pop(f"{op._schema.name}.{op._overloadname}", None)
        if pending is not None:
            register_lowering(op, **pending[1])(pending[0])
            found = _TABLE[op]
    return found


def lowered_ops() -> frozenset[OpOverload]:
    """Every op overload with a lowering."""
    return frozenset(_TABLE)


def register_composite(*ops: OpOverload) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` (over tpu tensors, the op's schema as its signature) as the composite of each
    of ``ops``: eager dispatch's decomposition tier and torch.compile's decompositions run it."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            if not isinstance(op, OpOverload):
                raise TypeError(f"register_composite expects OpOverloads, got {op!r}")
            if op in _COMPOSITES:
                raise ValueError(f"{op} already has a composite ({_COMPOSITES[op].__qualname__})")
            _COMPOSITES[op] = fn
        return fn

    return decorate


def get_composite(op: OpOverload) -> Callable[..., Any] | None:
    """The registered composite of ``op``, or None when it has none."""
    return _COMPOSITES.get(op)


def composites() -> dict[OpOverload, Callable[..., Any]]:
    """Every registered composite (a copy: op -> fn)."""
    return dict(_COMPOSITES)
