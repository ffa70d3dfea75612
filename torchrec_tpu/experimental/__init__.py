"""Retired: TorchRec's TPU module API now comes from TorchRec itself.

``torchrec==1.9.2`` ships ``torchrec.experimental.torch_tpu``; with ``import torch_tpu`` it runs
unchanged on this project's tpu device (``torch.tpu.ops``, the ``pybind_input_preprocessing``
backend, ``torch_tpu._internal.pallas``). This package was our copy of that API; only a re-export of
its 19 names is left, so old ``from torchrec_tpu.experimental import X`` lines keep working.

Migrating: replace ``torchrec_tpu.experimental`` with ``torchrec.experimental.torch_tpu`` (import
``torch_tpu`` first). What TorchRec's own module does differently from the copy:

- ``set_unstacked_table_weights`` / ``get_unstacked_table_weights`` take and give tables in
  sharded row order (no MOD sharding); to load logical tables use
  ``checkpoint.utils.stack_and_shard_global_tensor`` (and ``unstack_and_unshard_global_tensor``);
- fused Adam uses the raw ``lr`` as the step size with eps 1e-10 by default (no bias correction):
  its first update is ~3.16x ``torch.optim.Adam``'s with default betas;
- pooled outputs order their keys by stack; ``SparseCoreSavePlanner`` / ``SparseCoreLoadPlanner``
  need ``stacked_configs=`` for stacked tables (unsharding to CPU, loading at another topology);
- ``SparseCoreTrainPipeline`` keeps the tables it trains (the module's parameters stay as they were);
- ``SparseCoreInputPreprocessor`` reads each feature's ids and offsets only: a KJT's per-sample
  weights are ignored, without a warning (they never reach torch_tpu's preprocessing backend).
"""

from typing import Any

__all__ = [
    "KeyedSparseCorePreprocessedInput", "PrefetchDataLoader", "SparseCoreBatch", "SparseCoreDataLoader",
    "SparseCoreEmbeddingConfig", "SparseCoreFusedEmbeddingBagCollection", "SparseCoreFusedEmbeddingCollection",
    "SparseCoreInputPreprocessor", "SparseCoreLoadPlanner", "SparseCorePreprocessedInput", "SparseCoreSavePlanner",
    "SparseCoreTrainPipeline", "StackedSparseCoreEmbeddingConfig", "TPUEmbeddingUnfused", "auto_stack_tables",
    "prepare_tables_for_stacking", "stack_and_shard_tables", "stack_tables", "unshard_and_unstack_tables",
]


def __getattr__(name: str) -> Any:
    """TorchRec's export ``name``, resolved on first use (with the tpu device registered)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; it re-exports "
                             f"torchrec.experimental.torch_tpu's {__all__}")
    import torchrec.experimental.torch_tpu as torchrec_tpu_module

    import torch_tpu  # noqa: F401  (TorchRec's TPU module needs TorchTPU's environment)

    return getattr(torchrec_tpu_module, name)
