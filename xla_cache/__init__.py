"""The persistent XLA compile cache every job shares: where it lives, its size cap, which programs
go in, and an LRU that other processes evicting entries at the same time cannot break.

Importing this package imports only the standard library; :func:`install` imports JAX and points
it at the cache. The components that compile JAX programs call it (``import torch_tpu``, the
sparsecore ``xla`` and ``tpu`` backends), so every job (``train`` with either dense device,
``infer``, ``profile``, eager use of the tpu device) shares one cache, and a job that does not
need the tpu device never imports (registers) it for the cache's sake.

Layout, one level per subdirectory of :func:`cache_dir`:

* ``executables/``: JAX's persistent cache of compiled XLA executables (``jax_compilation_cache_dir``
  with JAX's LRU bookkeeping; the older uncapped ``xla/`` is no longer used).
* other levels (``fx/``, ``steps/``: torch_tpu's translated graphs and traced training steps;
  ``compiled/``: their executables, serialized) hold one ``<key>.jaxexport`` file per entry,
  written and trimmed by :func:`store`, read by :func:`load`.

A corrupt entry (truncated by a full disk or a killed writer, damaged) is removed with a warning
naming it when it is read, and the program is compiled again: :func:`load` decodes through the
caller's decoder, and JAX's executables are checked when read (:func:`_tolerant_lru_cache`).

What goes in: whole programs, compiled inside :func:`persistent` (torch_tpu's compiled graphs and
training steps, the sparsecore engine's lookup/update programs); outside it only programs that
take at least ``SLOW_COMPILE_SECS`` to compile (JAX's own default rule). The tpu device's per-op
eager programs compile in milliseconds and stay in memory, so they never crowd the cache out.

Location: ``TORCH_TPU_COMPILE_CACHE`` (a directory, or ``0``/``off`` to disable), else
``$XDG_CACHE_HOME/torch_tpu/compile`` (``~/.cache/...``); change it with :func:`configure`.
Size: each level is capped at ``TORCH_TPU_COMPILE_CACHE_MAX_MB`` (default 2048 MB); the least
recently used entries go first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

_DISABLED = {"0", "off", "false", "none", ""}
DEFAULT_MAX_MB = 2048
XLA_LEVEL = "executables"
ENTRY_SUFFIX = ".jaxexport"  # the other levels' entries: serialized jax.export programs
SLOW_COMPILE_SECS = 1.0  # outside persistent(): only compiles this slow are written

T = TypeVar("T")
_log = logging.getLogger(__name__)
_state: dict[str, Path | None] = {"dir": None}
_max_bytes = [DEFAULT_MAX_MB << 20]
_local = threading.local()
_installed = [False]
_bypass_lock = threading.Lock()
# JAX executable cache events of programs compiled inside persistent() (hits, misses)
xla_counts = {"hits": 0, "misses": 0}


def default_cache_dir() -> Path | None:
    """Where the cache lives unless :func:`configure` moved it (None: disabled)."""
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


def configure(directory: str | os.PathLike | None, max_bytes: int | None = None) -> None:
    """Use ``directory`` for every cache level (each capped at ``max_bytes``, default
    :func:`default_max_bytes`), or disable persistent caching with None. JAX's executable cache
    gets the tolerant LRU (see :func:`_tolerant_lru_cache`)."""
    import jax
    from jax._src import compilation_cache

    path = Path(directory).expanduser() if directory is not None else None
    if path is not None:
        (path / XLA_LEVEL).mkdir(parents=True, exist_ok=True)
    _state["dir"] = path
    _max_bytes[0] = default_max_bytes() if max_bytes is None else int(max_bytes)
    jax.config.update("jax_compilation_cache_dir", str(path / XLA_LEVEL) if path is not None else None)
    jax.config.update("jax_compilation_cache_max_size", _max_bytes[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", SLOW_COMPILE_SECS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if not getattr(compilation_cache.LRUCache, "tolerant", False):
        compilation_cache.LRUCache = _tolerant_lru_cache()  # what get_file_cache() builds
    compilation_cache.reset_cache()  # JAX reads the directory once; make the change take effect


@contextlib.contextmanager
def persistent() -> Iterator[None]:
    """Programs compiled inside are written to (and counted in) the persistent cache."""
    from jax._src import config as jax_config

    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        with jax_config.persistent_cache_min_compile_time_secs(0.0):
            yield
    finally:
        _local.depth = depth


@contextlib.contextmanager
def jax_cache_bypassed() -> Iterator[None]:
    """JAX's executable cache neither read nor written by the compiles inside (process-wide: a
    compile on another thread meanwhile is not cached either). For programs stored serialized in
    a level of their own: an executable JAX loaded from its cache serializes without its code
    (XLA:CPU, jaxlib 0.10: the copy fails at run time with "Function ... not found")."""
    import jax
    from jax._src import compilation_cache

    with _bypass_lock:
        enabled = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()  # JAX reads the setting once: make the change take effect
        try:
            yield
        finally:
            jax.config.update("jax_enable_compilation_cache", enabled)
            compilation_cache.reset_cache()


def load(level: str, key: str, decode: Callable[[bytes], T]) -> T | None:
    """The stored entry ``key`` of ``level`` (e.g. ``"fx"``) as ``decode`` reads it, or None:
    never stored, or corrupt (``decode`` raised): then it is removed with a warning naming it, so
    the caller compiles the program again and stores it anew."""
    directory = _state["dir"]
    if directory is None:
        return None
    path = directory / level / f"{key}{ENTRY_SUFFIX}"
    try:
        blob = path.read_bytes()
        os.utime(path)  # recently used: the cap removes it last
    except FileNotFoundError:  # never stored, or another process trimmed it just now
        return None
    try:
        return decode(blob)
    except Exception as error:  # noqa: BLE001  any decoding failure means a damaged entry
        drop_corrupt(path, error)
        return None


def drop_corrupt(path: Path, error: BaseException, *companions: Path) -> None:
    """Remove the corrupt cache entry ``path`` (and its ``companions``), warning with its name."""
    for file in (path, *companions):
        file.unlink(missing_ok=True)
    reason = " ".join(str(error).split())[:200] or type(error).__name__
    _log.warning("compile cache entry %s is corrupt (%s: %s): removed, the program is compiled again",
                 path, type(error).__name__, reason)


def store(level: str, key: str, blob: bytes) -> None:
    """Write atomically, so a concurrent reader in another process never sees a partial file;
    then trim the level to its cap, oldest use first."""
    directory = _state["dir"]
    if directory is None:
        return
    target = directory / level / f"{key}{ENTRY_SUFFIX}"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    os.replace(tmp, target)
    _trim(target.parent, f"*{ENTRY_SUFFIX}", _max_bytes[0])


def _trim(directory: Path, pattern: str, max_bytes: int) -> None:
    entries = []
    for path in directory.glob(pattern):
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
        xla_counts["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        xla_counts["misses"] += 1


def _tolerant_lru_cache() -> type:
    """JAX's LRU cache, made safe against other processes sharing the directory.

    JAX 0.10's eviction reads every entry's ``-atime`` file unguarded: one entry without it (a
    process killed between writing the two files, another evicting it meanwhile, or a writer
    without a size cap, which keeps no atimes) makes every later write raise FileNotFoundError
    (a warning per program, and nothing new is stored). Here a missing atime counts as oldest, a
    vanished entry is skipped, and a read racing an eviction is a miss. An entry that does not
    decompress (truncated) is removed with a warning and is a miss: JAX alone would warn on every
    run and never replace it (``put`` keeps an existing entry)."""
    from jax._src import compilation_cache, lru_cache

    class TolerantLRUCache(lru_cache.LRUCache):
        tolerant = True

        def get(self, key: str) -> bytes | None:
            try:
                blob = super().get(key)
            except FileNotFoundError:
                return None
            if blob is not None:
                try:
                    compilation_cache.decompress_executable(blob)
                except Exception as error:  # noqa: BLE001  zstd/zlib errors: a damaged entry
                    drop_corrupt(self.path / f"{key}{lru_cache._CACHE_SUFFIX}", error,
                                 self.path / f"{key}{lru_cache._ATIME_SUFFIX}")
                    return None
            return blob

        def _evict_if_needed(self, *, additional_size: int = 0) -> None:
            if not self.eviction_enabled:
                return
            entries, total = [], 0
            for cache_path in self.path.glob(f"*{lru_cache._CACHE_SUFFIX}"):
                key = cache_path.name.removesuffix(lru_cache._CACHE_SUFFIX)
                try:
                    stat = cache_path.stat()
                except FileNotFoundError:
                    continue
                size = stat.length if lru_cache.pathlib.epath_installed else stat.st_size  # as JAX reads it
                try:
                    atime = int.from_bytes((self.path / f"{key}{lru_cache._ATIME_SUFFIX}").read_bytes(), "little")
                except FileNotFoundError:
                    atime = 0
                entries.append((atime, key, size))
                total += size
            for _, key, size in sorted(entries):
                if total <= self.max_size - additional_size:
                    break
                (self.path / f"{key}{lru_cache._CACHE_SUFFIX}").unlink(missing_ok=True)
                (self.path / f"{key}{lru_cache._ATIME_SUFFIX}").unlink(missing_ok=True)
                total -= size

    return TolerantLRUCache


def install() -> None:
    """Count JAX cache events and apply the default location (once per process)."""
    if _installed[0]:
        return
    _installed[0] = True
    import jax

    jax.monitoring.register_event_listener(_on_jax_event)
    configure(default_cache_dir())

