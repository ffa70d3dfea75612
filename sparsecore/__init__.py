"""SparseCore embedding engine: specs, stacking, host preprocessing, lookups with fused updates.

The nn.Module over these tables is ``torchrec_tpu.sharding.ShardedSparseCoreEBC`` (one rank or
many; ``loss.backward()`` applies the fused optimizer update).

Backends (``sparsecore.backends``): ``xla`` (pure JAX, the reference semantics), ``fbgemm``
(FBGEMM TBE on the host), ``tpu`` (jax-tpu-embedding's SparseCore kernels).

The names below are imported on first use, so that a light module (``sparsecore.backends``' names,
read by the train CLI's ``--help``) can be imported without torch and TorchRec.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

# exported name -> its module
_EXPORTS = {
    "StackCSR": "sparsecore.csr_format",
    **dict.fromkeys(("FdoRecorder", "PartitionOverflowError", "StackStats"), "sparsecore.limits"),
    **dict.fromkeys(("FTRL", "SGD", "Adagrad", "Adam", "OptimizerSpec", "RowWiseAdagrad"), "sparsecore.optimizers"),
    **dict.fromkeys(("PreprocessedBatch", "preprocess"), "sparsecore.preprocess"),
    **dict.fromkeys(("FeatureSpec", "Initializer", "SparseCoreTopology", "TableSpec"), "sparsecore.specs"),
    **dict.fromkeys(("StackingPlan", "plan_stacking"), "sparsecore.stacking"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sparsecore' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """Importing a submodule binds it on its package: ``sparsecore.preprocess`` (the module) would
    then shadow the exported function of that name; the export wins, as when the package imported
    its names eagerly."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
