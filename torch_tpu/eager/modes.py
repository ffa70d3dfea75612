"""Eager execution modes and the per-op executor seam.

``strict`` (default): each lowered op runs at once through JAX's asynchronous dispatch (as one
jitted program per op signature, see ``torch_tpu.eager.op_jit``); errors
inside the device computation surface at the next host read (``.cpu()``, ``.item()``).
``debug``: synchronous; after every op waits for the result, raises when a floating output has
NaN/Inf that its inputs did not have, naming the op, and an integer division by a tpu tensor
holding a zero raises CPU's ``ZeroDivisionError`` (``torch_tpu.eager.zero_division``; the other modes
return XLA's numbers for it); a ``torch.compile`` graph first runs the input checks of its ops
(``register_lowering(check=)``, e.g. the SparseCore ops' bounds) on its concrete inputs
(``torch_tpu.compile.program.graph``). ``defer_and_fuse``: the lazy executor
(``torch_tpu.eager.lazy``) that ``import torch_tpu`` registers with :func:`register_executor`.
Index arguments are checked against their dimension in every mode (``torch_tpu.ops.lowerings.indexing.check_bounds``).

Select with ``TORCH_TPU_EAGER_MODE=strict|debug|defer_and_fuse``, :func:`set_eager_mode`, or the
:func:`eager_mode` context manager. An executor is ``fn(lowering, args, kwargs) -> outputs``
over JAX arrays (the same calling convention as a lowering, see ``torch_tpu.ops.registry``).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from typing import Any

from torch_tpu.eager import op_jit
from torch_tpu.ops.registry import Lowering
from torch_tpu.runtime._jax import jax, jnp
from tpu_facts import knobs


class EagerMode(enum.Enum):
    """The eager modes, named and ordered as TorchTPU's: ``DEFER_AND_FUSE``, ``DEFER_NEVER`` (each
    op dispatched at once, asynchronously; the value ``"strict"``, alias ``STRICT``) and
    ``DEFER_NEVER_AND_LAUNCH_BLOCKING`` (each op waited for; ``"debug"``, alias ``DEBUG``)."""

    DEFER_AND_FUSE = "defer_and_fuse"
    DEFER_NEVER = "strict"
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "debug"
    STRICT = "strict"
    DEBUG = "debug"

    __hash__ = object.__hash__  # members are singletons; Enum's own hash runs Python code per op


Executor = Callable[[Lowering, tuple, dict], Any]


def run_strict(lowering: Lowering, args: tuple, kwargs: dict) -> Any:
    return op_jit.call(lowering, args, kwargs)


def run_debug(lowering: Lowering, args: tuple, kwargs: dict) -> Any:
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


_EXECUTORS: dict[EagerMode, Executor] = {EagerMode.STRICT: run_strict, EagerMode.DEBUG: run_debug}


def _parse(mode: str | EagerMode) -> EagerMode:
    if isinstance(mode, EagerMode):
        return mode
    try:
        return EagerMode(mode.lower())
    except ValueError:
        choices = ", ".join(m.value for m in EagerMode)
        raise ValueError(f"unknown torch_tpu eager mode {mode!r}; choose one of: {choices}") from None


current_mode_cell = [_parse(knobs.EAGER_MODE.text())]


def register_executor(mode: str | EagerMode, executor: Executor) -> None:
    """Install the executor used for ``mode`` (``torch_tpu.eager.register()`` installs all three)."""
    _EXECUTORS[_parse(mode)] = executor


def get_eager_mode() -> EagerMode:
    return current_mode_cell[0]


def set_eager_mode(mode: str | EagerMode) -> None:
    """Switch the eager mode for the whole process."""
    parsed = _parse(mode)
    if parsed not in _EXECUTORS:
        raise RuntimeError(
            f"eager mode {parsed.value!r} has no executor registered (register one with "
            "torch_tpu.register_executor)"
        )
    current_mode_cell[0] = parsed


@contextlib.contextmanager
def eager_mode(mode: str | EagerMode) -> Iterator[None]:
    """Run the block in ``mode``, restoring the previous mode afterwards."""
    previous = current_mode_cell[0]
    set_eager_mode(mode)
    try:
        yield
    finally:
        current_mode_cell[0] = previous


def current_executor() -> Executor:
    """The executor for the op being dispatched now (the per-op seam)."""
    try:
        return _EXECUTORS[current_mode_cell[0]]
    except KeyError:
        raise RuntimeError(f"eager mode {current_mode_cell[0].value!r} has no executor registered") from None
