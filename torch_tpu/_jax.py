"""JAX import with the settings the device relies on (imported before any jax use in torch_tpu).

int64/float64 tensors silently become 32-bit unless x64 is enabled, so it is switched on here.
"""

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

__all__ = ["jax", "jnp"]
