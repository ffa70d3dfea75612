"""Graph mode for torch_tpu: ``torch.compile(backend="tpu")``, ``train_step`` (a whole training step
as one program, with any tpu:: op the step calls, e.g. the SparseCore lookup and fused update), shape
buckets, and the controls of the persistent compile cache and of the ``defer_and_fuse`` eager mode
(re-exported from ``torch_tpu.runtime`` and ``torch_tpu.eager``).

Four subpackages: ``program`` (an FX graph as one compiled program, the base of the others),
``collectives`` (collectives in compiled graphs; imports ``program``), ``dynamo`` (the backend) and
``step`` (``train_step``), each of those two importing ``program`` and ``collectives`` but not the
other (``tests/test_layering.py``).

Importing it changes no eager behaviour: the lowerings graphs use and the defer_and_fuse executor
are registered by ``import torch_tpu``. The "tpu" Dynamo backend name resolves through the
``torch_dynamo_backends`` entry point; :func:`torch_tpu.compile.dynamo.backend.register` adds it to
Dynamo's table by hand where the package is not installed (this import calls it).

Collectives in compiled graphs (``torch.distributed.all_reduce`` and the functional collectives,
which Dynamo traces as ``_c10d_functional`` ops): by default each forward/backward graph holding
any is split at every collective (:mod:`torch_tpu.compile.collectives.collectives`); the runs of ops
between them are compiled programs and each collective runs through the process group's eager path
(tpu_dist's XLA transport for tpu tensors) between them, complete before the next program starts
(its ``wait_tensor`` is a no-op). Inside ``with fuse_collectives():`` graphs compiled there lower
their collectives into ONE program instead (a ``shard_map`` over the group's devices of the
multi-controller JAX runtime: ``psum``, ``all_gather``, ``psum_scatter``, ``all_to_all``), falling
back to the split graph with a warning where they cannot
(:mod:`torch_tpu.compile.collectives.fused_collectives`). Either way, on its first call a graph with
collectives all-gathers the digest of its collective sequence over each group it uses; ranks that
compiled different collectives raise :class:`CollectiveMismatchError` naming both sequences
instead of deadlocking.
"""

from torch_tpu.compile.collectives.collectives import CollectiveMismatchError
from torch_tpu.compile.collectives.fused_collectives import fuse_collectives
from torch_tpu.compile.dynamo import backend as _backend
from torch_tpu.compile.dynamo.backend import compile_stats, compiled_graphs, reset_compile_stats
from torch_tpu.compile.dynamo.buckets import BucketPolicy, BucketStats, bucketed
from torch_tpu.compile.step.step_program import TrainStep, TrainStepStats, train_step
from torch_tpu.eager.lazy import DeferStats, LazyArray, defer_stats, flush, reset_defer_stats
from torch_tpu.runtime.persistent_cache import cache_dir, cache_stats, configure_cache, reset_cache_stats

_backend.register()

__all__ = [
    "BucketPolicy",
    "BucketStats",
    "CollectiveMismatchError",
    "DeferStats",
    "LazyArray",
    "TrainStep",
    "TrainStepStats",
    "bucketed",
    "defer_stats",
    "fuse_collectives",
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
