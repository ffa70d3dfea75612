"""SparseCore embedding engine: specs, stacking, host preprocessing, lookups with fused updates.

The nn.Module over these tables is ``torchrec_tpu.sharding.ShardedSparseCoreEBC`` (one rank or
many; ``loss.backward()`` applies the fused optimizer update).

Backends (``sparsecore.backends``): ``xla`` (pure JAX, the reference semantics), ``fbgemm``
(FBGEMM TBE on the host), ``tpu`` (jax-tpu-embedding's SparseCore kernels).
"""

from sparsecore.csr_format import StackCSR
from sparsecore.limits import FdoRecorder, PartitionOverflowError, StackStats
from sparsecore.optimizers import FTRL, SGD, Adagrad, Adam, OptimizerSpec, RowWiseAdagrad
from sparsecore.preprocess import PreprocessedBatch, preprocess
from sparsecore.specs import FeatureSpec, Initializer, SparseCoreTopology, TableSpec
from sparsecore.stacking import StackingPlan, plan_stacking

__all__ = [
    "FTRL", "SGD", "Adagrad", "Adam", "FdoRecorder", "FeatureSpec", "Initializer", "OptimizerSpec",
    "PartitionOverflowError", "PreprocessedBatch", "RowWiseAdagrad", "SparseCoreTopology", "StackCSR", "StackStats",
    "StackingPlan", "TableSpec", "plan_stacking", "preprocess",
]
