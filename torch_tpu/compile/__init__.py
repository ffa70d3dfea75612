"""Graph mode for torch_tpu: ``torch.compile(backend="tpu")``, ``train_step`` (a whole training step
as one program, optionally with a JAX input stage such as an embedding lookup fused in), shape
buckets, and the controls of the persistent compile cache and of the ``defer_and_fuse`` eager mode
(re-exported from ``torch_tpu.runtime`` and ``torch_tpu.eager``).

Importing it changes no eager behaviour: the lowerings graphs use and the defer_and_fuse executor
are registered by ``import torch_tpu``. The "tpu" Dynamo backend name resolves through the
``torch_dynamo_backends`` entry point; :func:`torch_tpu.compile.backend.register` adds it to Dynamo's
table by hand where the package is not installed (this import calls it).
"""

from torch_tpu.compile import backend as _backend
from torch_tpu.compile.backend import compile_stats, compiled_graphs, reset_compile_stats
from torch_tpu.compile.buckets import BucketPolicy, BucketStats, bucketed
from torch_tpu.compile.step_program import TrainStep, TrainStepStats, train_step
from torch_tpu.eager.lazy import DeferStats, LazyArray, defer_stats, flush, reset_defer_stats
from torch_tpu.runtime.persistent_cache import cache_dir, cache_stats, configure_cache, reset_cache_stats

_backend.register()

__all__ = [
    "BucketPolicy",
    "BucketStats",
    "DeferStats",
    "LazyArray",
    "TrainStep",
    "TrainStepStats",
    "bucketed",
    "defer_stats",
    "flush",
    "reset_defer_stats",
    "train_step",
    "cache_dir",
    "cache_stats",
    "compile_stats",
    "compiled_graphs",
    "configure_cache",
    "reset_cache_stats",
    "reset_compile_stats",
]
