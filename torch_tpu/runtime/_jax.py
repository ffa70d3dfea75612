"""JAX import with the settings the device relies on (imported before any jax use in torch_tpu).

int64/float64 tensors silently become 32-bit unless x64 is enabled, so it is switched on here.
Importing torch_tpu must not start the JAX backend (``jax.distributed.initialize``, for the XLA
collectives of ``tpu_dist``, has to run first), so nothing here or at any module level of
torch_tpu creates an array; ``ARRAY_TYPE`` names the concrete array class without making one.
"""

import jax
from jax._src.array import ArrayImpl

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

ARRAY_TYPE = ArrayImpl

__all__ = ["ARRAY_TYPE", "jax", "jnp"]
