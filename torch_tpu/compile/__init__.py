"""Graph mode for torch_tpu: ``torch.compile(backend="tpu")``, ``train_step`` (a whole training step
as one program, optionally with a JAX input stage such as an embedding lookup fused in), shape
buckets, the persistent compile cache's controls and the ``defer_and_fuse`` eager mode.

``import torch_tpu.compile`` registers the "tpu" Dynamo backend and the defer_and_fuse executor.
"""

import torch_tpu  # noqa: F401  (the device and the lowering registry)
from torch_tpu import modes as _modes
from torch_tpu.compile import backend as _backend
from torch_tpu.compile import extra_lowerings as _extra  # noqa: F401
from torch_tpu.compile import lazy as _lazy
from torch_tpu.compile.backend import compile_stats, compiled_graphs, reset_compile_stats
from torch_tpu.compile.buckets import BucketPolicy, BucketStats, bucketed
from torch_tpu.compile.input_stage import InputStage, StageInput
from torch_tpu.compile.lazy import DeferStats, LazyArray, defer_stats, flush, reset_defer_stats
from torch_tpu.compile.step_program import TrainStep, TrainStepStats, train_step
from torch_tpu.persistent_cache import cache_dir, cache_stats, configure_cache, reset_cache_stats

_backend.register()
_modes.register_executor(_modes.EagerMode.DEFER_AND_FUSE, _lazy.run_deferred)
# tensors produced under defer_and_fuse stay usable after switching back to another mode
_modes.register_executor(_modes.EagerMode.STRICT, _lazy.materializing(_modes.run_strict))
_modes.register_executor(_modes.EagerMode.DEBUG, _lazy.materializing(_modes.run_debug))

__all__ = [
    "BucketPolicy",
    "BucketStats",
    "DeferStats",
    "InputStage",
    "LazyArray",
    "StageInput",
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
