"""torch_tpu's levels of the persistent compile cache (:mod:`xla_cache`, shared by every job).

* ``<dir>/fx/<key>.jaxexport``: the serialized ``jax.export`` of a translated FX graph
  (``torch.compile(backend="tpu")``), keyed by a hash of the graph code, input shapes/dtypes,
  constants and the lowering registry. A hit skips the FX -> JAX translation and the trace.
* ``<dir>/steps/<key>.jaxexport``: a traced ``torch_tpu.compile.train_step`` program
  (:mod:`torch_tpu.compile.step.step_cache`). A hit skips tracing the step.
* ``<dir>/compiled/<key>.jaxexport``: the compiled executable of one of them, serialized without
  pickle (:mod:`torch_tpu.compile.program.executable_codec`), keyed by its program's key, the backend, the
  device and the input types (:mod:`torch_tpu.compile.program.executables`). A hit skips lowering and
  compiling.
* ``<dir>/executables``: the compiled XLA executables of all of them (JAX's cache).

Every entry carries its key and a digest, checked when read, and the directory is used only when
it is this user's own (the trust policy of :mod:`xla_cache`).

``import torch_tpu`` applies the default location (:func:`xla_cache.default_cache_dir`); the
eager device's per-op programs stay in memory. :func:`configure_cache` moves or disables it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import xla_cache
from xla_cache import cache_dir, persistent

FX_LEVEL = "fx"
STEP_LEVEL = "steps"
COMPILED_LEVEL = "compiled"  # whole programs' executables, serialized (torch_tpu.compile.program.executables)


@dataclasses.dataclass
class CacheStats:
    """Hit/miss counters since the last :func:`reset_cache_stats` (XLA counters: programs
    compiled inside :func:`persistent` only)."""

    fx_memory_hits: int = 0  # translation reused within this process
    fx_disk_hits: int = 0  # translation loaded from the persistent cache
    fx_misses: int = 0  # graph translated and traced
    step_disk_hits: int = 0  # train_step program loaded from the persistent cache (no trace)
    step_misses: int = 0  # train_step traced (and stored)
    xla_hits: int = 0  # executable loaded from the persistent cache (JAX's, or a serialized whole program)
    xla_misses: int = 0  # JAX executable compiled (and stored)


counters = CacheStats()


def cache_stats() -> CacheStats:
    """A snapshot of the cache counters."""
    return dataclasses.replace(counters, xla_hits=xla_cache.xla_counts["hits"],
                               xla_misses=xla_cache.xla_counts["misses"])


def reset_cache_stats() -> None:
    for field in dataclasses.fields(CacheStats):
        setattr(counters, field.name, 0)
    xla_cache.xla_counts.update(hits=0, misses=0)


def configure_cache(directory: str | os.PathLike | None, max_bytes: int | None = None) -> None:
    """Use ``directory`` for every cache level (each capped at ``max_bytes``), or disable
    persistent caching with None (:func:`xla_cache.configure`)."""
    xla_cache.configure(directory, max_bytes)


def load_translation(key: str) -> Any:
    """The stored ``jax.export.Exported`` for ``key``, or None (never stored, or corrupt: then
    removed with a warning)."""
    from torch_tpu.runtime._jax import jax

    return xla_cache.load(FX_LEVEL, key, lambda blob: jax.export.deserialize(bytearray(blob)))


def store_translation(key: str, blob: bytes) -> None:
    """Store a serialized export under ``key`` (atomically; the level stays under its cap)."""
    xla_cache.store(FX_LEVEL, key, blob)


__all__ = ["CacheStats", "cache_dir", "cache_stats", "configure_cache", "load_translation",
           "persistent", "reset_cache_stats", "store_translation"]
