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

Trust: what the cache holds runs as code (a compiled XLA executable is native code), so, as ssh's
StrictModes and pip's and Inductor's per-user caches do, the directory and each level directory
are used only when they are real directories owned by the current user, writable by that user and
by no group or other user, and no directory above lets another user rename them away: each is
owned by root or the user and writable by no one else unless sticky (:mod:`xla_cache.trust`; this
module creates them ``0700``). The directory is opened once, when configured, walking its path
without following links, and each level once, relative to it; every entry is then read, written,
listed and evicted relative to those descriptors, JAX's ``executables/`` included (JAX's cache is
this package's class, :mod:`xla_cache.jax_lru`), so a directory renamed away and replaced after
the check is never followed: the job keeps using the directory it checked. A directory that fails
(another owner, group/world-writable, read-only, a regular file in its place, an unwritable or
shared parent), or a write that fails later (a full disk), turns the persistent cache off for the
process, JAX's included, with one warning line naming the directory, why, and how to fix it; the
job runs uncached. Nothing in the cache is a pickle: every entry of every level, JAX's ``executables/``
included, is a plain header (magic, format version, the full key it was stored under, payload
length, sha256 of the payload) and the raw payload (:mod:`xla_cache.entries`); ``compiled/``
holds executables in a plain encoding (``torch_tpu.compile.program.executable_codec``).

On load an entry must be a regular file inside its level (no symbolic link, FIFO, device;
opened without following links or blocking) of this user's alone (owned by the user, writable by
no one else, no second hard link: else a miss, removed, with one warning per process), no bigger
than the level's cap, and match its
header: magic, version, the key asked for (an entry copied over another key's name is refused,
JAX's file-name keyed entries too: :mod:`xla_cache.jax_lru`), length and digest. Anything else,
and an entry the caller's decoder refuses (a damaged program), is a miss: the file is removed with
one warning naming it and the program is compiled again and stored anew. Within a trusted
directory only this user (or root) can write entries; the checks turn their accidents (damage,
truncation, a misplaced copy, a special file) into misses, never a wrong program or a hang.

What goes in: whole programs, compiled inside :func:`persistent` (torch_tpu's compiled graphs and
training steps, the sparsecore engine's lookup/update programs); outside it only programs that
take at least ``SLOW_COMPILE_SECS`` to compile (JAX's own default rule). The tpu device's per-op
eager programs compile in milliseconds and stay in memory, so they never crowd the cache out.

Location: ``TORCH_TPU_COMPILE_CACHE`` (a directory, or ``0``/``off`` to disable), else
``$XDG_CACHE_HOME/torch_tpu/compile`` (``~/.cache/...``); change it with :func:`configure`.
Size: each level is capped at ``TORCH_TPU_COMPILE_CACHE_MAX_MB`` (a whole number of megabytes >= 1,
default 2048; another value is a :class:`ConfigError`); the least recently used entries go first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from tpu_facts import knobs
from xla_cache import entries, jax_lru, trust
from xla_cache.trust import Directory

_DISABLED = {"0", "off", "false", "none", ""}
DEFAULT_MAX_MB = int(knobs.COMPILE_CACHE_MAX_MB.default)  # type: ignore[arg-type]
XLA_LEVEL = jax_lru.LEVEL
ENTRY_SUFFIX = ".jaxexport"  # the other levels' entries: serialized jax.export programs
SLOW_COMPILE_SECS = 1.0  # outside persistent(): only compiles this slow are written

T = TypeVar("T")
_log = logging.getLogger(__name__)
_root: list[Directory | None] = [None]  # the open cache directory (None: caching is off)
_levels: dict[str, Directory] = {}  # its levels the trust policy admitted, open
_warned: set[str] = set()  # reasons the cache was turned off, each warned about once
_max_bytes = [DEFAULT_MAX_MB << 20]
_local = threading.local()
_installed = [False]
_bypass_lock = threading.Lock()
# JAX executable cache events of programs compiled inside persistent() (hits, misses)
xla_counts = {"hits": 0, "misses": 0}
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # each program JAX compiles or loads
_compiled = [0]  # programs XLA compiled in this process (not loaded from JAX's cache or this one's)


def compiles() -> int:
    """Programs XLA compiled in this process so far (since :func:`install`), every program's: those
    loaded from a cache (JAX's executables or this package's) are not counted."""
    return _compiled[0]


def default_cache_dir() -> Path | None:
    """Where the cache lives unless :func:`configure` moved it (None: disabled)."""
    env = knobs.COMPILE_CACHE.value()
    if env is not None:
        return None if env.lower() in _DISABLED else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torch_tpu" / "compile"


class ConfigError(ValueError):
    """An environment variable of the cache holds a value it does not take; ``str()`` names the
    variable, the value and what is allowed."""


def default_max_bytes() -> int:
    """The size cap per cache level from ``TORCH_TPU_COMPILE_CACHE_MAX_MB`` (:class:`ConfigError`
    when it is not a whole number >= 1)."""
    raw = knobs.COMPILE_CACHE_MAX_MB.text()  # empty: unset
    try:
        mb = int(raw)
    except ValueError:
        mb = 0
    if mb < 1:
        raise ConfigError(f"{knobs.COMPILE_CACHE_MAX_MB.name}={raw!r} is not a whole number of megabytes >= 1 "
                          f"(the default is {DEFAULT_MAX_MB}; {knobs.COMPILE_CACHE.name}=off disables the cache)")
    return mb << 20


def cache_dir() -> Path | None:
    """The active cache directory, as it was when configured (None: persistent caching is off)."""
    root = _root[0]
    return None if root is None else root.path


def configure(directory: str | os.PathLike | None, max_bytes: int | None = None) -> None:
    """Use ``directory`` for every cache level (each capped at ``max_bytes``, default
    :func:`default_max_bytes`), or disable persistent caching with None. A directory the trust
    policy refuses (module docstring) disables it too, with one warning saying why."""
    import jax
    from jax._src import compilation_cache

    _max_bytes[0] = default_max_bytes() if max_bytes is None else int(max_bytes)
    _levels.clear()
    _root[0] = _open_trusted(Path(directory).expanduser()) if directory is not None else None
    entries.reset_warnings()
    jax.config.update("jax_compilation_cache_max_size", _max_bytes[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", SLOW_COMPILE_SECS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")  # XLA's own caches would go by path
    if not getattr(compilation_cache.LRUCache, "checked", False):
        compilation_cache.LRUCache = jax_lru.checked_cache(_jax_directory, _on_write_error)  # get_file_cache()'s
    _point_jax_at(cache_dir())


def _point_jax_at(path: Path | None) -> None:
    import jax
    from jax._src import compilation_cache

    jax.config.update("jax_compilation_cache_dir", str(path / XLA_LEVEL) if path is not None else None)
    compilation_cache.reset_cache()  # JAX reads the directory once; make the change take effect


def _open_trusted(path: Path) -> Directory | None:
    """``path`` opened, with its ``executables/`` level, when the trust policy admits both."""
    try:
        root = trust.open_dir(path)
        executables = root.subdir(XLA_LEVEL, create=True)
    except trust.Untrusted as error:
        _warn_off(str(error))
        return None
    assert executables is not None  # created when missing
    _levels[XLA_LEVEL] = executables
    return root


def _jax_directory(path: str) -> Directory | None:
    """The open directory JAX's cache at ``path`` uses: the ``executables/`` level opened when the
    cache was configured, or (``jax_compilation_cache_dir`` set to another path directly) ``path``
    opened under the same policy; None when refused."""
    level = _levels.get(XLA_LEVEL)
    if level is not None and str(level.path) == path:
        return level
    try:
        return trust.open_dir(Path(path))
    except trust.Untrusted as error:
        _warn_off(str(error))
        return None


def _warn_off(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        _log.warning("compile cache off: %s; this job runs without the persistent compile cache "
                     "(TORCH_TPU_COMPILE_CACHE=<dir> chooses another, =off silences this)", reason)


def _disable(reason: str) -> None:
    """Turn the persistent cache off for the rest of this process, with one warning."""
    _warn_off(reason)
    if _root[0] is not None:
        _root[0] = None
        _levels.clear()
        _point_jax_at(None)


def _on_write_error(path: Path, error: OSError) -> None:
    _disable(f"writing {path} failed ({error.strerror or error})")


def _level(level: str, create: bool) -> Directory | None:
    """The open directory of ``level`` when the trust policy admits it (created ``0700`` when
    ``create``); None when the cache is off, or ``level`` was never created and not ``create``."""
    root = _root[0]
    if root is None:
        return None
    if level in _levels:
        return _levels[level]
    try:
        directory = root.subdir(level, create=create)
    except trust.Untrusted as error:
        _disable(str(error))
        return None
    if directory is not None:
        _levels[level] = directory
    return directory


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
    never stored, or not a valid entry for ``key`` (:mod:`xla_cache.entries`) or ``decode``
    raised: then it is removed with a warning naming it, so the caller compiles the program
    again and stores it anew."""
    directory = _level(level, create=False)
    if directory is None:
        return None
    name = f"{key}{ENTRY_SUFFIX}"
    payload = entries.load_checked(directory, name, f"{level}/{key}", _max_bytes[0])
    if payload is None:
        return None
    with contextlib.suppress(OSError):  # trimmed meanwhile
        os.utime(name, dir_fd=directory.fd, follow_symlinks=False)  # recently used: the cap removes it last
    try:
        return decode(payload)
    except Exception as error:  # noqa: BLE001  any decoding failure means a damaged entry
        entries.drop(directory, name, error)
        return None


def store(level: str, key: str, blob: bytes) -> None:
    """Store ``blob`` as entry ``key`` of ``level``, atomically (a concurrent reader in another
    process never sees a partial file); then trim the level to its cap, oldest use first. A
    failed write turns the cache off for this process with one warning."""
    directory = _level(level, create=True)
    if directory is None:
        return
    entry = entries.encode(f"{level}/{key}", blob)
    if len(entry) > _max_bytes[0]:  # bigger than the cap: never kept
        return
    name = f"{key}{ENTRY_SUFFIX}"
    try:
        entries.write_atomic(directory, name, entry)
        _trim(directory, ENTRY_SUFFIX, _max_bytes[0])
    except OSError as error:
        _disable(f"writing {directory.path / name} failed ({error.strerror or error})")


def _trim(directory: Directory, suffix: str, max_bytes: int) -> None:
    """Remove the least recently used entries of ``directory`` until they fit ``max_bytes``."""
    found = sorted((st.st_mtime, st.st_size, name) for name, st in entries.listing(directory, suffix))
    total = sum(size for _, size, _ in found)
    for _, size, name in found:
        if total <= max_bytes:
            break
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):  # trimmed by another process
            os.unlink(name, dir_fd=directory.fd)
        total -= size


def _on_compile(event: str, _secs: float, **_: object) -> None:
    if event == BACKEND_COMPILE_EVENT:
        _compiled[0] += 1


def _on_jax_event(event: str, **_: object) -> None:
    if event == "/jax/compilation_cache/cache_hits":  # inside a BACKEND_COMPILE_EVENT: not compiled
        _compiled[0] -= 1
    if not getattr(_local, "depth", 0):
        return
    if event == "/jax/compilation_cache/cache_hits":
        xla_counts["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        xla_counts["misses"] += 1


def install() -> None:
    """Count JAX cache events and apply the default location (once per process)."""
    if _installed[0]:
        return
    _installed[0] = True
    import jax

    jax.monitoring.register_event_listener(_on_jax_event)
    jax.monitoring.register_event_duration_secs_listener(_on_compile)
    configure(default_cache_dir())

