"""Graph mode for torch_tpu: ``torch.compile(backend="tpu")``, shape buckets, the persistent compile
cache and the ``defer_and_fuse`` eager mode.

``import torch_tpu.compile`` registers the "tpu" Dynamo backend and the defer_and_fuse executor.
"""

import torch_tpu  # noqa: F401  (the device and the lowering registry)
from torch_tpu.compile import backend as _backend, cache as _cache
from torch_tpu.compile.backend import compile_stats, compiled_graphs, reset_compile_stats
from torch_tpu.compile.cache import cache_dir, cache_stats, configure_cache, reset_cache_stats

_cache.install()
_backend.register()

__all__ = [
    "cache_dir",
    "cache_stats",
    "compile_stats",
    "compiled_graphs",
    "configure_cache",
    "reset_cache_stats",
    "reset_compile_stats",
]
