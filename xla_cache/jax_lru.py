"""JAX's file cache of compiled executables (level ``executables/``), made safe to share and to trust.

JAX 0.10's ``LRUCache`` names an entry by its key (the module name and a hash of everything the
executable depends on) and stores the bare executable: a file copied over another key's name would
be served for that key, a FIFO in an entry's place blocks the read forever, and its eviction reads
every entry's ``-atime`` file unguarded. The subclass here stores each entry with the header of
:mod:`xla_cache.entries` (the key it belongs to, its length and digest), reads only regular files
up to the cap, writes atomically (a symbolic link in an entry's place is replaced, never written
through), and on eviction counts an entry without a readable atime as the oldest.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import xla_cache.entries as entries

LEVEL = "executables"


def tolerant_lru_cache(on_write_error: Callable[[Path, OSError], None]) -> type:
    """JAX's ``LRUCache`` with checked entries; ``on_write_error`` gets a write that failed."""
    from jax._src import compilation_cache, lru_cache

    cache_suffix, atime_suffix = lru_cache._CACHE_SUFFIX, lru_cache._ATIME_SUFFIX

    class TolerantLRUCache(lru_cache.LRUCache):
        tolerant = True

        def _limit(self) -> int:
            return self.max_size if self.eviction_enabled else 1 << 62

        @contextlib.contextmanager
        def _locked(self) -> Iterator[None]:
            if not self.eviction_enabled:
                yield
                return
            self.lock.acquire(timeout=self.lock_timeout_secs)
            try:
                yield
            finally:
                self.lock.release()

        def get(self, key: str) -> bytes | None:
            path = Path(self.path) / f"{key}{cache_suffix}"
            atime = Path(self.path) / f"{key}{atime_suffix}"
            with self._locked():
                blob = entries.load_checked(path, f"{LEVEL}/{key}", self._limit())
                if blob is None:
                    return None
                try:
                    compilation_cache.decompress_executable(blob)
                except Exception as error:  # noqa: BLE001  zstd/zlib errors: damaged before it was stored
                    entries.drop(path, error, atime)
                    return None
                if self.eviction_enabled:
                    _touch(atime)
            return blob

        def put(self, key: str, value: bytes) -> None:
            if self.eviction_enabled and len(value) > self.max_size:
                return  # JAX warns about it on every compile; a program bigger than the cap is not kept
            path = Path(self.path) / f"{key}{cache_suffix}"
            try:
                with self._locked():
                    if os.path.lexists(path):
                        return
                    self._evict_if_needed(additional_size=len(value))
                    entries.write_atomic(path, entries.encode(f"{LEVEL}/{key}", value))
                    if self.eviction_enabled:
                        _touch(Path(self.path) / f"{key}{atime_suffix}")
            except OSError as error:
                on_write_error(path, error)

        def _evict_if_needed(self, *, additional_size: int = 0) -> None:
            if not self.eviction_enabled:
                return
            found, total = [], 0
            for cache_path in Path(self.path).glob(f"*{cache_suffix}"):
                key = cache_path.name.removesuffix(cache_suffix)
                try:
                    size = cache_path.lstat().st_size
                except FileNotFoundError:
                    continue  # another process evicted it
                try:
                    stamp = entries.read_entry(Path(self.path) / f"{key}{atime_suffix}", 8)
                except (entries.BadEntry, OSError):
                    stamp = None
                found.append((int.from_bytes(stamp or b"", "little"), key, size))
                total += size
            for _, key, size in sorted(found):
                if total <= self.max_size - additional_size:
                    break
                for suffix in (cache_suffix, atime_suffix):
                    with contextlib.suppress(IsADirectoryError):
                        (Path(self.path) / f"{key}{suffix}").unlink(missing_ok=True)
                total -= size

    return TolerantLRUCache



def _touch(atime: Path) -> None:
    """Record a use of the entry whose access-time file is ``atime`` (as JAX does)."""
    entries.write_atomic(atime, time.time_ns().to_bytes(8, "little"))
