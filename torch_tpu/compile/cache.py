"""Persistent compilation cache: our FX-graph translations plus JAX's compiled executables.

Two levels, both under one directory:

* ``<dir>/fx/<key>.jaxexport``: the serialized ``jax.export`` of a translated FX graph, keyed by a
  hash of the graph code, input shapes/dtypes, constants and the lowering registry. A hit skips
  the FX -> JAX translation and the trace.
* ``<dir>/xla``: JAX's persistent cache of compiled executables (``jax_compilation_cache_dir``,
  with ``jax_persistent_cache_min_compile_time_secs=0`` so small programs are cached too).

Location: ``TORCH_TPU_COMPILE_CACHE`` (a directory, or ``0``/``off`` to disable), else
``$XDG_CACHE_HOME/torch_tpu/compile`` (``~/.cache/...``). Change it with :func:`configure_cache`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from torch_tpu._jax import jax
from jax._src import compilation_cache as _jax_cache

_DISABLED = {"0", "off", "false", "none", ""}


@dataclasses.dataclass
class CacheStats:
    """Hit/miss counters since the last :func:`reset_cache_stats`."""

    fx_memory_hits: int = 0  # translation reused within this process
    fx_disk_hits: int = 0  # translation loaded from the persistent cache
    fx_misses: int = 0  # graph translated and traced
    xla_hits: int = 0  # JAX executable loaded from the persistent cache
    xla_misses: int = 0  # JAX executable compiled (and stored)


_stats = CacheStats()
_state: dict[str, Path | None] = {"dir": None}


def cache_stats() -> CacheStats:
    """A snapshot of the cache counters."""
    return dataclasses.replace(_stats)


def reset_cache_stats() -> None:
    for field in dataclasses.fields(CacheStats):
        setattr(_stats, field.name, 0)


def default_cache_dir() -> Path | None:
    """Where the cache lives unless :func:`configure_cache` moved it (None: disabled)."""
    env = os.environ.get("TORCH_TPU_COMPILE_CACHE")
    if env is not None:
        return None if env.strip().lower() in _DISABLED else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torch_tpu" / "compile"


def cache_dir() -> Path | None:
    """The active cache directory (None: persistent caching is off)."""
    return _state["dir"]


def configure_cache(directory: str | os.PathLike | None) -> None:
    """Use ``directory`` for both cache levels, or disable persistent caching with None."""
    path = Path(directory).expanduser() if directory is not None else None
    if path is not None:
        (path / "fx").mkdir(parents=True, exist_ok=True)
        (path / "xla").mkdir(parents=True, exist_ok=True)
    _state["dir"] = path
    jax.config.update("jax_compilation_cache_dir", str(path / "xla") if path is not None else None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _jax_cache.reset_cache()  # JAX reads the directory once; make the change take effect


def load_translation(key: str) -> bytes | None:
    """The stored serialized export for ``key``, or None."""
    directory = _state["dir"]
    if directory is None:
        return None
    path = directory / "fx" / f"{key}.jaxexport"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def store_translation(key: str, blob: bytes) -> None:
    """Write atomically, so a concurrent reader in another process never sees a partial file."""
    directory = _state["dir"]
    if directory is None:
        return
    target = directory / "fx" / f"{key}.jaxexport"
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    os.replace(tmp, target)


def _on_jax_event(event: str, **_: object) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _stats.xla_hits += 1
    elif event == "/jax/compilation_cache/cache_misses":
        _stats.xla_misses += 1


def install() -> None:
    """Count JAX cache events and apply the default location (called once at import)."""
    jax.monitoring.register_event_listener(_on_jax_event)
    configure_cache(default_cache_dir())
