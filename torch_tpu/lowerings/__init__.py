"""JAX lowerings of aten ops; importing this package fills ``torch_tpu.registry``."""

from torch_tpu.lowerings import (  # noqa: F401
    activations,
    batch_norm,
    conv,
    elementwise,
    embedding_bag,
    factories,
    indexing,
    linalg,
    losses,
    norms,
    pooling,
    reductions,
    rnn,
    shape,
)

# isort: split
from torch_tpu.lowerings import foreach  # noqa: F401,E402  (builds on the per-tensor lowerings)
