"""Persistent compilation cache, on by default: whole-program translations and XLA executables.

Two levels, both under one directory:

* ``<dir>/fx/<key>.jaxexport``: the serialized ``jax.export`` of a translated FX graph
  (``torch.compile(backend="tpu")``), keyed by a hash of the graph code, input shapes/dtypes,
  constants and the lowering registry. A hit skips the FX -> JAX translation and the trace.
* ``<dir>/executables``: JAX's persistent cache of compiled executables
  (``jax_compilation_cache_dir``, with JAX's LRU bookkeeping; the older uncapped ``<dir>/xla``,
  whose entries lack it, is no longer used).

Whole programs are written: compiled graphs, ``torch_tpu.compile.train_step`` programs and
whatever else compiles inside :func:`persistent`; outside it only programs that take at least
``SLOW_COMPILE_SECS`` to compile (JAX's own default rule; e.g. the sparsecore engine's lookup and
update programs). The eager device's per-op programs (and view readers/writers) compile in
milliseconds and stay in memory, so they never crowd the cache out.

Location: ``TORCH_TPU_COMPILE_CACHE`` (a directory, or ``0``/``off`` to disable), else
``$XDG_CACHE_HOME/torch_tpu/compile`` (``~/.cache/...``); change it with :func:`configure_cache`.
Size: each level is capped at ``TORCH_TPU_COMPILE_CACHE_MAX_MB`` (default 2048 MB); the least
recently used entries go first. ``import torch_tpu`` applies the default, so every job using the
device (train, infer, profile, eager) shares it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from jax._src import compilation_cache as _jax_cache
from jax._src import config as _jax_config

from torch_tpu._jax import jax

_DISABLED = {"0", "off", "false", "none", ""}
DEFAULT_MAX_MB = 2048
XLA_LEVEL = "executables"
SLOW_COMPILE_SECS = 1.0  # outside persistent(): only compiles this slow are written


@dataclasses.dataclass
class CacheStats:
    """Hit/miss counters since the last :func:`reset_cache_stats` (XLA counters: programs
    compiled inside :func:`persistent` only)."""

    fx_memory_hits: int = 0  # translation reused within this process
    fx_disk_hits: int = 0  # translation loaded from the persistent cache
    fx_misses: int = 0  # graph translated and traced
    xla_hits: int = 0  # JAX executable loaded from the persistent cache
    xla_misses: int = 0  # JAX executable compiled (and stored)


_stats = CacheStats()
_state: dict[str, Path | None] = {"dir": None}
_max_bytes = [DEFAULT_MAX_MB << 20]
_local = threading.local()


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


def default_max_bytes() -> int:
    """The size cap per cache level from ``TORCH_TPU_COMPILE_CACHE_MAX_MB``."""
    raw = os.environ.get("TORCH_TPU_COMPILE_CACHE_MAX_MB", str(DEFAULT_MAX_MB))
    try:
        mb = int(raw)
    except ValueError:
        raise ValueError(f"TORCH_TPU_COMPILE_CACHE_MAX_MB={raw!r} is not a whole number of megabytes") from None
    if mb < 1:
        raise ValueError(f"TORCH_TPU_COMPILE_CACHE_MAX_MB={mb} must be >= 1 (disable with TORCH_TPU_COMPILE_CACHE=off)")
    return mb << 20


def cache_dir() -> Path | None:
    """The active cache directory (None: persistent caching is off)."""
    return _state["dir"]


def configure_cache(directory: str | os.PathLike | None, max_bytes: int | None = None) -> None:
    """Use ``directory`` for both cache levels (each capped at ``max_bytes``, default
    :func:`default_max_bytes`), or disable persistent caching with None."""
    path = Path(directory).expanduser() if directory is not None else None
    if path is not None:
        (path / "fx").mkdir(parents=True, exist_ok=True)
        (path / XLA_LEVEL).mkdir(parents=True, exist_ok=True)
    _state["dir"] = path
    _max_bytes[0] = default_max_bytes() if max_bytes is None else int(max_bytes)
    jax.config.update("jax_compilation_cache_dir", str(path / XLA_LEVEL) if path is not None else None)
    jax.config.update("jax_compilation_cache_max_size", _max_bytes[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", SLOW_COMPILE_SECS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _jax_cache.reset_cache()  # JAX reads the directory once; make the change take effect


@contextlib.contextmanager
def persistent() -> Iterator[None]:
    """Programs compiled inside are written to (and counted in) the persistent cache."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        with _jax_config.persistent_cache_min_compile_time_secs(0.0):
            yield
    finally:
        _local.depth = depth


def load_translation(key: str) -> bytes | None:
    """The stored serialized export for ``key``, or None."""
    directory = _state["dir"]
    if directory is None:
        return None
    path = directory / "fx" / f"{key}.jaxexport"
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    os.utime(path)  # recently used: the cap removes it last
    return blob


def store_translation(key: str, blob: bytes) -> None:
    """Write atomically, so a concurrent reader in another process never sees a partial file;
    then trim the level to its cap, oldest use first."""
    directory = _state["dir"]
    if directory is None:
        return
    target = directory / "fx" / f"{key}.jaxexport"
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    os.replace(tmp, target)
    _trim(directory / "fx", _max_bytes[0])


def _trim(directory: Path, max_bytes: int) -> None:
    entries = []
    for path in directory.glob("*.jaxexport"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue  # another process trimmed it
        entries.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size


def _on_jax_event(event: str, **_: object) -> None:
    if not getattr(_local, "depth", 0):
        return
    if event == "/jax/compilation_cache/cache_hits":
        _stats.xla_hits += 1
    elif event == "/jax/compilation_cache/cache_misses":
        _stats.xla_misses += 1


_installed = [False]


def install() -> None:
    """Count JAX cache events and apply the default location (once; ``import torch_tpu`` does it)."""
    if _installed[0]:
        return
    _installed[0] = True
    jax.monitoring.register_event_listener(_on_jax_event)
    configure_cache(default_cache_dir())
