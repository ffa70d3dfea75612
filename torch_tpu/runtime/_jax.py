"""JAX import with the settings the device relies on (imported before any jax use in torch_tpu).

int64/float64 tensors silently become 32-bit unless x64 is enabled, so it is switched on here.
Importing torch_tpu must not start the JAX backend (``jax.distributed.initialize``, for the XLA
collectives of ``tpu_dist``, has to run first), so nothing here or at any module level of
torch_tpu creates an array; ``ARRAY_TYPE`` names the concrete array class without making one.

JAX's collection of Python tracebacks is switched off (``TORCH_TPU_JAX_TRACEBACKS=1`` keeps it,
for debugging JAX-level errors): every array, every compiled executable and every traced
operation kept a native traceback holding the code objects of the whole Python stack, invisibly
to Python's garbage collector. Under ``torch.compile`` that stack includes the frame Dynamo
generated, whose code object's death is what deletes the compiled function Dynamo installed as a
global: an eager op compiled there (its executable cached) kept that global, the compiled graph
and its loaded executables alive after the module and ``torch._dynamo.reset()``, so a
long-lived process compiling many modules ran out of memory mappings ("LLVM compilation error:
Cannot allocate memory", then a segfault). JAX then records no source lines in its error
messages and HLO metadata.
"""


import jax
from jax._src.array import ArrayImpl
from jax._src.lib import _jax

from tpu_facts import knobs

jax.config.update("jax_enable_x64", True)
_jax.set_tracebacks_enabled(knobs.JAX_TRACEBACKS.on())

import jax.numpy as jnp  # noqa: E402
from jax.extend import core as jax_core  # noqa: E402  (jaxpr types: Literal)

ARRAY_TYPE = ArrayImpl

__all__ = ["ARRAY_TYPE", "jax", "jax_core", "jnp"]
