"""``torch_tpu._internal.pallas.jax_op``: TorchTPU's way to make a JAX function a torch operator.

``jax_op(name, fn)`` registers ``fn`` (parameters annotated ``jax.Array`` for arrays and
``int``/``float``/``bool``/``str`` for static values, as TorchTPU takes them) as the torch op
``name`` through :func:`torch_tpu.ops.pallas.jax_op` and returns the op: called with tpu tensors it
runs ``fn`` on the device (eager or inside ``torch.compile(backend="tpu")``). Off TPU, Pallas
kernels in ``fn`` run in Pallas' TPU interpret mode; a SparseCore kernel, which interpret mode
cannot run, raises :class:`~torch_tpu.eager.fallback.KernelUnavailable`, on which eager
dispatch runs the calling op's CPU kernel (counted in ``torch_tpu.fallback_counts()``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jax.experimental.pallas import tpu as pltpu

from torch_tpu.eager.fallback import KernelUnavailable
from torch_tpu.ops.pallas.op import jax_op as _register
from torch_tpu.ops.pallas.platform import interpret
from torch_tpu.runtime._jax import jax

__all__ = ["KernelUnavailable", "jax_op"]

# jax-tpu-embedding / Pallas ask the device for its SparseCore layout first; off TPU that fails with this
_NO_TPU_INFO = "Unsupported TPU device kind"


def _torch_signature(fn: Callable[..., Any], name: str) -> inspect.Signature:
    signature = inspect.signature(fn, eval_str=True)
    params = []
    for p in signature.parameters.values():
        if p.annotation is jax.Array or p.annotation is torch.Tensor:
            p = p.replace(annotation=torch.Tensor)
        elif p.annotation is inspect.Parameter.empty:
            raise TypeError(f"jax_op {name}: annotate parameter {p.name!r} (jax.Array or int/float/bool/str)")
        params.append(p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD))
    returns = signature.return_annotation
    if returns is jax.Array:
        returns = torch.Tensor
    return inspect.Signature(params, return_annotation=returns)


def _on_this_platform(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` traced as this platform runs Pallas kernels: interpret mode (32-bit, as Mosaic) off TPU."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not interpret():
            return fn(*args, **kwargs)
        try:
            with pltpu.force_tpu_interpret_mode(), jax.enable_x64(False):
                return fn(*args, **kwargs)
        except ValueError as e:
            if _NO_TPU_INFO not in str(e):
                raise
            raise KernelUnavailable(f"{name}: its Pallas kernel needs a TPU's SparseCores, which Pallas interpret "
                                    f"mode on {jax.default_backend()} cannot run ({e})") from e

    return run


def jax_op(name: str, fn: Callable[..., Any], donate_argnums: Sequence[int] = ()) -> Callable[..., Any]:
    """Register ``fn`` as the torch op ``name`` ("namespace::op") and return the op (module
    docstring). ``donate_argnums`` is accepted for TorchTPU's signature; inputs are not donated."""
    del donate_argnums  # an eager op's inputs stay valid: nothing is donated
    wrapped = _on_this_platform(fn, name)
    wrapped.__signature__ = _torch_signature(fn, name)
    return _register(name, wrapped)
