"""Pallas kernels as torch operators on the tpu device (Mosaic on TPU, interpret mode elsewhere).

``jax_op`` wraps any JAX function (one calling ``pallas_call``) as a torch custom operator that runs
in eager mode and inside ``torch.compile(backend="tpu")`` programs; the recsys kernels below use it.
"""

from torch_tpu.ops.pallas.cross import low_rank_cross, low_rank_cross_reference
from torch_tpu.ops.pallas.embedding_bag import combiner_gains, embedding_bag_csr, embedding_bag_csr_reference
from torch_tpu.ops.pallas.interaction import dot_interaction, dot_interaction_reference
from torch_tpu.ops.pallas.op import jax_op
from torch_tpu.ops.pallas.platform import batch_block, interpret, kernel_call, lowering_for_tpu

__all__ = [
    "batch_block",
    "combiner_gains",
    "dot_interaction",
    "dot_interaction_reference",
    "embedding_bag_csr",
    "embedding_bag_csr_reference",
    "interpret",
    "jax_op",
    "kernel_call",
    "low_rank_cross",
    "low_rank_cross_reference",
    "lowering_for_tpu",
]
