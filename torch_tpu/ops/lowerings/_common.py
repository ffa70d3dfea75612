"""Helpers shared by lowerings: torch's type promotion on JAX arrays and Python scalars."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch

from torch_tpu.runtime._jax import ARRAY_TYPE, jax, jnp
from torch_tpu.runtime.dtypes import to_jax_dtype, to_torch_dtype

Operand = Any  # jax.Array | bool | int | float | complex | None


_ARRAY = ARRAY_TYPE


def _kind(x: Operand) -> tuple[str, Any] | None:
    if type(x) is _ARRAY:
        return ("dim" if x.ndim else "zero", x.dtype)
    if x is None:
        return None
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) and not isinstance(x, (bool, int, float, complex)):
        return ("dim" if np.ndim(x) else "zero", np.dtype(x.dtype))
    if isinstance(x, bool):
        return ("wrapped", torch.bool)
    if isinstance(x, int):
        return ("wrapped", torch.int64)
    if isinstance(x, float):
        return ("wrapped", torch.get_default_dtype())
    if isinstance(x, complex):
        return ("wrapped", torch.complex128 if torch.get_default_dtype() == torch.float64 else torch.complex64)
    raise TypeError(f"unsupported operand {type(x).__name__} in a tpu lowering")


def _combine(higher: torch.dtype | None, lower: torch.dtype | None) -> torch.dtype | None:
    """torch's combine_categories (c10/core/ScalarType / TensorIterator result-type rules)."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    if higher.is_complex:
        return higher
    if lower.is_complex:
        return higher.to_complex() if higher.is_floating_point else lower
    if higher.is_floating_point:
        return higher
    if higher == torch.bool or lower.is_floating_point:
        return torch.promote_types(higher, lower)
    return higher


@lru_cache(maxsize=4096)
def _result_torch_dtype(kinds: tuple) -> torch.dtype:
    state: dict[str, torch.dtype | None] = {"dim": None, "zero": None, "wrapped": None}
    for where, dt in kinds:
        dt = dt if isinstance(dt, torch.dtype) else to_torch_dtype(dt)
        cur = state[where]
        state[where] = dt if cur is None else torch.promote_types(cur, dt)
    return _combine(state["dim"], _combine(state["zero"], state["wrapped"]))


def result_dtype(*operands: Operand) -> np.dtype:
    """The dtype torch's type promotion gives for these operands (arrays and Python scalars)."""
    kinds = tuple(k for k in map(_kind, operands) if k is not None)
    return to_jax_dtype(_result_torch_dtype(kinds))


def float_dtype(*operands: Operand) -> np.dtype:
    """result_dtype, with integer/bool results raised to the default float (torch's int->float ops)."""
    dt = result_dtype(*operands)
    if jnp.issubdtype(dt, jnp.inexact):
        return dt
    return to_jax_dtype(torch.get_default_dtype())


def cast(x: Operand, dtype: Any) -> jax.Array:
    """``x`` as a JAX value of ``dtype`` (arrays converted only when needed)."""
    if isinstance(x, jax.Array):
        return x if x.dtype == dtype else x.astype(dtype)
    return jnp.asarray(x, dtype)


def promoted(*operands: Operand) -> list[jax.Array]:
    """All operands cast to their torch-promoted common dtype."""
    first = operands[0]
    if type(first) is _ARRAY and all(type(x) is _ARRAY and x.dtype == first.dtype for x in operands):
        return list(operands)  # the common case needs no promotion
    dt = result_dtype(*operands)
    return [_cast_keep_weak_scalar(x, dt) for x in operands]


def _cast_keep_weak_scalar(x: Operand, dtype: Any) -> Any:
    # A Python int/float stays a (weakly typed) Python scalar: JAX then computes in ``dtype``
    # without materialising a constant array per call.
    if type(x) in (int, float) and jnp.issubdtype(dtype, jnp.inexact if type(x) is float else jnp.number):
        return x
    return cast(x, dtype)


def floated(*operands: Operand) -> list[jax.Array]:
    dt = float_dtype(*operands)
    return [cast(x, dt) for x in operands]


def jdtype(dtype: torch.dtype | None, default: Any = None) -> Any:
    """A torch dtype argument (possibly None) as a JAX dtype."""
    if dtype is None:
        return default if default is not None else to_jax_dtype(torch.get_default_dtype())
    return to_jax_dtype(dtype)


def wrap_dim(dim: int, ndim: int) -> int:
    """``dim`` as a non-negative dim of an ``ndim``-d tensor (a 0-d one takes 0 and -1), raising
    torch's IndexError when it is out of range (c10's maybe_wrap_dim): dims never wrap around."""
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, {rank - 1}], but got {dim})")
    return dim % rank


def wrap_dims(dims: Any, ndim: int) -> tuple[int, ...]:
    """A dim list as non-negative dims, in order; torch's errors for one out of range or repeated."""
    wrapped = tuple(wrap_dim(d, ndim) for d in dims)
    for i, d in enumerate(wrapped):
        if d in wrapped[:i]:
            raise RuntimeError(f"dim {d} appears multiple times in the list of dims")
    return wrapped


def norm_dims(dims: Any, ndim: int) -> tuple[int, ...]:
    """A dim / dim list argument (None or [] meaning all) as sorted non-negative dims."""
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return tuple(range(ndim))
    wrapped = wrap_dims(dims, ndim)
    return tuple(sorted(wrapped)) if ndim else ()


def is_one(scale: Operand) -> bool:
    """Whether a scale argument (``alpha``, ``value``) is the Python number 1.

    A traced scale (the per-op jit cache turns changing floats into inputs) is never "1": the
    multiplication stays in the program and gives the same result either way.
    """
    return isinstance(scale, (int, float)) and scale == 1


def is_float(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


_REDUCED_FLOATS = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def upcast(x: jax.Array | None) -> jax.Array | None:
    """``x`` in the dtype torch computes it in: float32 for bfloat16/float16 (CPU and CUDA kernels
    accumulate in float32 too), unchanged otherwise; None passes through."""
    return x.astype(jnp.float32) if x is not None and x.dtype in _REDUCED_FLOATS else x


def opmath(fn: Any, *arrays: jax.Array, **kwargs: Any) -> Any:
    """``fn(*arrays, **kwargs)`` computed in :func:`upcast` precision, each float32 result rounded
    back once to the arrays' dtype. The arrays share one dtype (promote first)."""
    if not arrays or arrays[0].dtype not in _REDUCED_FLOATS:
        return fn(*arrays, **kwargs)
    low = arrays[0].dtype
    out = fn(*map(upcast, arrays), **kwargs)
    return jax.tree.map(lambda o: o.astype(low) if o.dtype == jnp.float32 else o, out)
