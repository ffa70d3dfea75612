"""Mapping between torch dtypes and JAX (numpy) dtypes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from torch_tpu.runtime._jax import jnp

_TORCH_TO_JAX: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.bool: np.dtype(np.bool_),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}
# float8 formats torch and JAX (ml_dtypes) both have; torch's names, JAX's encodings
FLOAT8_DTYPES: tuple[torch.dtype, ...] = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                      "float8_e8m0fnu")
    if hasattr(torch, name) and hasattr(ml_dtypes, name)
)
_TORCH_TO_JAX.update({d: np.dtype(getattr(ml_dtypes, str(d).removeprefix("torch."))) for d in FLOAT8_DTYPES})
FLOAT8_NUMPY = frozenset(_TORCH_TO_JAX[dtype] for dtype in FLOAT8_DTYPES)
JAX_TO_TORCH: dict[np.dtype, torch.dtype] = {v: k for k, v in _TORCH_TO_JAX.items()}
# every torch dtype in one fixed order, so processes can exchange a dtype as an integer
_CODED: tuple[torch.dtype, ...] = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)},
                                               key=str))


def to_jax_dtype(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype holding a torch dtype; TypeError naming the dtype when there is none."""
    try:
        return _TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"torch dtype {dtype} has no TPU (JAX) equivalent") from None


def to_torch_dtype(dtype) -> torch.dtype:
    """The torch dtype for a JAX/numpy dtype."""
    found = JAX_TO_TORCH.get(dtype)  # a numpy dtype (every array's): no conversion
    if found is not None:
        return found
    try:
        return JAX_TO_TORCH[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"JAX dtype {dtype} has no torch equivalent") from None


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype`` as a small integer, the same in every process of one torch version."""
    return _CODED.index(dtype)


def dtype_of_code(code: int) -> torch.dtype:
    """The dtype :func:`dtype_code` gave ``code``."""
    return _CODED[code]


def is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)
