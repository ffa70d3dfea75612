"""The bytes of a storage seen as another dtype, for dtype-changing views (``t.view(torch.int32)``).

A box holds one JAX array of the storage's dtype. A view of another dtype sees the same bytes:
its sizes / strides / offset count elements of its own dtype, like torch's. Reads gather from
:func:`reinterpret` (the box's bytes as the view's dtype); writes scatter into it and store it back
with :func:`restore`, so both sides see each other's writes.

Bytes beyond the last whole element of the view's dtype (an int16 storage of 3 elements seen as
int32) are not visible through the view and are kept unchanged by its writes.
"""

from __future__ import annotations

import numpy as np

from torch_tpu.runtime._jax import jax, jnp

_BYTE = np.dtype(np.uint8)


def _to_bytes(flat: jax.Array) -> jax.Array:
    """A 1-d array's bytes (native order) as a 1-d uint8 array."""
    if flat.dtype == np.bool_:
        return flat.astype(_BYTE)
    if jnp.issubdtype(flat.dtype, jnp.complexfloating):
        flat = jnp.stack([flat.real, flat.imag], axis=-1).reshape(-1)
    return jax.lax.bitcast_convert_type(flat, _BYTE).reshape(-1)


def _from_bytes(raw: jax.Array, dtype: np.dtype) -> jax.Array:
    """The whole elements of ``dtype`` in a 1-d uint8 array (a trailing partial element is dropped)."""
    count = raw.size // dtype.itemsize
    raw = raw[: count * dtype.itemsize]
    if dtype == np.bool_:
        return raw != 0
    if jnp.issubdtype(dtype, jnp.complexfloating):
        parts = _from_bytes(raw, np.dtype(jnp.finfo(dtype).dtype))
        return jax.lax.complex(parts[0::2], parts[1::2])
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(raw, dtype)
    return jax.lax.bitcast_convert_type(raw.reshape(count, dtype.itemsize), dtype)


def reinterpret(storage: jax.Array, dtype: np.dtype) -> jax.Array:
    """A storage array's bytes as a flat array of ``dtype``."""
    return _from_bytes(_to_bytes(storage.reshape(-1)), np.dtype(dtype))


def restore(storage: jax.Array, flat: jax.Array) -> jax.Array:
    """``storage`` (same shape and dtype) holding the bytes of ``flat``, a reinterpretation of it."""
    raw = _to_bytes(flat)
    if raw.size < storage.nbytes:
        raw = jnp.concatenate([raw, _to_bytes(storage.reshape(-1))[raw.size:]])
    return _from_bytes(raw, storage.dtype).reshape(storage.shape)
