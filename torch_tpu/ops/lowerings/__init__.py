"""JAX lowerings of aten ops: their ``register_lowering`` decorators fill ``torch_tpu.ops.registry``
when ``torch_tpu.ops.register()`` loads this package (``import torch_tpu`` does, once)."""

from torch_tpu.ops.lowerings import (  # noqa: F401
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
from torch_tpu.ops.lowerings import foreach, graph_copies  # noqa: F401,E402  (build on the per-tensor lowerings)
