"""Eager execution modes and the per-op executor seam.

``strict`` (default): each lowered op runs at once through JAX's asynchronous dispatch (as one
jitted program per op signature, see ``torch_tpu.op_jit``); errors
inside the device computation surface at the next host read (``.cpu()``, ``.item()``).
``debug``: synchronous; after every op waits for the result, raises when a floating output has
NaN/Inf that its inputs did not have, and checks index arguments against their dimension,
naming the op. ``defer_and_fuse``: reserved for the lazy executor that ``torch_tpu.compile``
registers with :func:`register_executor`.

Select with ``TORCH_TPU_EAGER_MODE=strict|debug|defer_and_fuse``, :func:`set_eager_mode`, or the
:func:`eager_mode` context manager. An executor is ``fn(lowering, args, kwargs) -> outputs``
over JAX arrays (the same calling convention as a lowering, see ``torch_tpu.registry``).
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Callable, Iterator
from typing import Any

from torch_tpu import op_jit
from torch_tpu._jax import jax, jnp
from torch_tpu.registry import Lowering


class EagerMode(enum.Enum):
    STRICT = "strict"
    DEBUG = "debug"
    DEFER_AND_FUSE = "defer_and_fuse"

    __hash__ = object.__hash__  # members are singletons; Enum's own hash runs Python code per op


Executor = Callable[[Lowering, tuple, dict], Any]


def run_strict(lowering: Lowering, args: tuple, kwargs: dict) -> Any:
    return op_jit.call(lowering, args, kwargs)


def run_debug(lowering: Lowering, args: tuple, kwargs: dict) -> Any:
    check_indices(lowering.op, args)
    out = op_jit.call(lowering, args, kwargs)
    leaves = [x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array)]
    jax.block_until_ready(leaves)
    if any(_has_nonfinite(x) for x in leaves) and not any(
        _has_nonfinite(x) for x in jax.tree_util.tree_leaves((args, kwargs)) if isinstance(x, jax.Array)
    ):
        raise FloatingPointError(f"{lowering.op}: produced NaN or Inf from finite inputs (torch_tpu debug mode)")
    return out


def _has_nonfinite(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact) and x.size > 0 and not bool(jnp.isfinite(x).all())


# op name -> (position of the indexed tensor, position of the index, dim or None for "per list entry",
#             whether negative indices are allowed)
_INDEX_ARGS: dict[str, tuple[int, int, int | str | None, bool]] = {
    "aten::index": (0, 1, None, True),
    "aten::index_put": (0, 1, None, True),
    "aten::index_select": (0, 2, "arg1", False),
    "aten::gather": (0, 2, "arg1", False),
    "aten::scatter": (0, 2, "arg1", False),
    "aten::scatter_add": (0, 2, "arg1", False),
    "aten::scatter_reduce.two": (0, 2, "arg1", False),
    "aten::embedding": (0, 1, 0, False),
    "aten::index_add": (0, 2, "arg1", False),
}


def check_indices(op: Any, args: tuple) -> None:
    """Raise IndexError naming ``op`` when an index argument is out of bounds (debug mode)."""
    spec = _INDEX_ARGS.get(op._schema.name)
    if spec is None or len(args) <= spec[1]:
        return
    data_pos, index_pos, dim, allow_negative = spec
    data, index = args[data_pos], args[index_pos]
    if dim is None:
        pairs = [(d, ix) for d, ix in enumerate(index) if ix is not None and not jnp.issubdtype(ix.dtype, jnp.bool_)]
    else:
        d = args[1] if dim == "arg1" else dim
        pairs = [(d % max(data.ndim, 1), index)]
    for d, ix in pairs:
        if ix.size == 0:
            continue
        size = data.shape[d] if data.ndim else 1
        lo, hi = int(ix.min()), int(ix.max())
        low_limit = -size if allow_negative else 0
        if lo < low_limit or hi >= size:
            bad = lo if lo < low_limit else hi
            raise IndexError(f"{op}: index {bad} is out of bounds for dimension {d} with size {size}")


_EXECUTORS: dict[EagerMode, Executor] = {EagerMode.STRICT: run_strict, EagerMode.DEBUG: run_debug}


def _parse(mode: str | EagerMode) -> EagerMode:
    if isinstance(mode, EagerMode):
        return mode
    try:
        return EagerMode(mode.lower())
    except ValueError:
        choices = ", ".join(m.value for m in EagerMode)
        raise ValueError(f"unknown torch_tpu eager mode {mode!r}; choose one of: {choices}") from None


_current = [_parse(os.environ.get("TORCH_TPU_EAGER_MODE", "strict"))]


def register_executor(mode: str | EagerMode, executor: Executor) -> None:
    """Install the executor used for ``mode`` (torch_tpu.compile registers defer_and_fuse)."""
    _EXECUTORS[_parse(mode)] = executor


def get_eager_mode() -> EagerMode:
    return _current[0]


def set_eager_mode(mode: str | EagerMode) -> None:
    """Switch the eager mode for the whole process."""
    parsed = _parse(mode)
    if parsed not in _EXECUTORS:
        raise RuntimeError(
            f"eager mode {parsed.value!r} has no executor registered (import the module providing it, "
            "e.g. torch_tpu.compile for defer_and_fuse)"
        )
    _current[0] = parsed


@contextlib.contextmanager
def eager_mode(mode: str | EagerMode) -> Iterator[None]:
    """Run the block in ``mode``, restoring the previous mode afterwards."""
    previous = _current[0]
    set_eager_mode(mode)
    try:
        yield
    finally:
        _current[0] = previous


def current_executor() -> Executor:
    """The executor for the op being dispatched now (the per-op seam)."""
    try:
        return _EXECUTORS[_current[0]]
    except KeyError:
        raise RuntimeError(f"eager mode {_current[0].value!r} has no executor registered") from None
