"""JAX's file cache of compiled executables (level ``executables/``), made safe to share and to trust.

JAX 0.10's ``LRUCache`` reads and writes ``jax_compilation_cache_dir`` by path on every call (a
directory swapped under a running job is followed), names an entry by its key (the module name and
a hash of everything the executable depends on) and stores the bare executable: a file copied over
another key's name would be served for that key, a FIFO in an entry's place blocks the read
forever, and its eviction reads every entry's ``-atime`` file unguarded. The class here takes its
place in ``jax._src.compilation_cache`` (JAX builds its cache through that name): it opens the
directory once under the trust policy (the caller's ``directory_for``, :mod:`xla_cache.trust`)
and reaches every entry relative to that descriptor; each entry carries the header of
:mod:`xla_cache.entries` (the key it belongs to, its length and digest) and is read only when it
is a regular file of this user's, up to the cap; writes are atomic (a symbolic link in an entry's
place is replaced, never written through), and eviction counts an entry without a readable atime
as the oldest.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import xla_cache.entries as entries
from xla_cache.trust import Directory

LEVEL = "executables"
_LOCK_FILE = ".lockfile"  # JAX's name: processes of raw JAX on the same directory take the same lock


def checked_cache(directory_for: Callable[[str], Directory | None],
                  on_write_error: Callable[[Path, OSError], None]) -> type:
    """A cache class built as JAX builds ``LRUCache(path, max_size=...)``, over the directory
    ``directory_for(path)`` opened (None: refused, the cache holds nothing); ``on_write_error``
    gets a write that failed."""
    from jax._src import compilation_cache, lru_cache
    from jax._src.compilation_cache_interface import CacheInterface

    cache_suffix, atime_suffix = lru_cache._CACHE_SUFFIX, lru_cache._ATIME_SUFFIX

    class CheckedCache(CacheInterface):
        checked = True

        def __init__(self, path: str, *, max_size: int, lock_timeout_secs: float | None = 10) -> None:
            self.path = self._path = Path(path)
            self.directory = directory_for(path)
            self.eviction_enabled = max_size != -1  # JAX's -1: no cap
            self.max_size = max_size
            self.lock_timeout_secs = lock_timeout_secs or 0.0

        def _limit(self) -> int:
            return self.max_size if self.eviction_enabled else 1 << 62

        @contextlib.contextmanager
        def _locked(self, directory: Directory) -> Iterator[None]:
            if not self.eviction_enabled:
                yield
                return
            with _flock(directory, self.lock_timeout_secs):
                yield

        def get(self, key: str) -> bytes | None:
            directory = self.directory
            if directory is None:
                return None
            name, atime = f"{key}{cache_suffix}", f"{key}{atime_suffix}"
            with self._locked(directory):
                blob = entries.load_checked(directory, name, f"{LEVEL}/{key}", self._limit())
                if blob is None:
                    return None
                try:
                    compilation_cache.decompress_executable(blob)
                except Exception as error:  # noqa: BLE001  zstd/zlib errors: damaged before it was stored
                    entries.drop(directory, name, error, atime)
                    return None
                if self.eviction_enabled:
                    _touch(directory, atime)
            return blob

        def put(self, key: str, value: bytes) -> None:
            directory = self.directory
            if directory is None or (self.eviction_enabled and len(value) > self.max_size):
                return  # JAX warns about a program bigger than the cap on every compile: it is not kept
            name = f"{key}{cache_suffix}"
            try:
                with self._locked(directory):
                    if _exists(directory, name):
                        return
                    self._evict_if_needed(directory, additional_size=len(value))
                    entries.write_atomic(directory, name, entries.encode(f"{LEVEL}/{key}", value))
                    if self.eviction_enabled:
                        _touch(directory, f"{key}{atime_suffix}")
            except OSError as error:
                on_write_error(directory.path / name, error)

        def _evict_if_needed(self, directory: Directory, *, additional_size: int = 0) -> None:
            found, total = [], 0
            for name, st in entries.listing(directory, cache_suffix):
                key = name.removesuffix(cache_suffix)
                try:
                    stamp = entries.read_entry(directory, f"{key}{atime_suffix}", 8)
                except (entries.BadEntry, OSError):
                    stamp = None
                found.append((int.from_bytes(stamp or b"", "little"), key, st.st_size))
                total += st.st_size
            for _, key, size in sorted(found):
                if total <= self.max_size - additional_size:
                    break
                for suffix in (cache_suffix, atime_suffix):
                    with contextlib.suppress(FileNotFoundError, IsADirectoryError):  # evicted by another process
                        os.unlink(f"{key}{suffix}", dir_fd=directory.fd)
                total -= size

    return CheckedCache


@contextlib.contextmanager
def _flock(directory: Directory, timeout: float) -> Iterator[None]:
    """The directory's lock held (as JAX's ``filelock`` takes it), or not after ``timeout`` seconds
    or when the lock file cannot be opened: every operation tolerates a concurrent writer, the lock
    only keeps the cap tight."""
    try:
        fd = os.open(_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600,
                     dir_fd=directory.fd)
    except OSError:
        fd = None
    try:
        deadline = time.monotonic() + timeout
        while fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _exists(directory: Directory, name: str) -> bool:
    try:
        os.stat(name, dir_fd=directory.fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _touch(directory: Directory, atime: str) -> None:
    """Record a use of the entry whose access-time file is ``atime`` (as JAX does)."""
    entries.write_atomic(directory, atime, time.time_ns().to_bytes(8, "little"))
