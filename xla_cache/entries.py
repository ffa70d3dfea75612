"""One cache entry on disk: a plain header, then the payload's raw bytes (never a pickle).

Header (little endian): ``MAGIC`` (8 bytes), format version (u32), key length (u32), payload
length (u64), the payload's sha256 (32 bytes), then the key (UTF-8). :func:`decode` checks each
against the file and the key asked for, so an entry that is damaged, truncated, of another format
or copied from another key's name is refused. :func:`read_entry` reads only a regular file, up to
a size bound, without following a symbolic link or blocking on a FIFO or device.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import struct
import tempfile
from pathlib import Path

MAGIC = b"TTPUXC\r\n"  # the CR LF catches a text-mode copy
VERSION = 1
_HEADER = struct.Struct("<8sIIQ32s")
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_log = logging.getLogger("xla_cache")


class BadEntry(ValueError):
    """A file that is not a valid entry for the key asked for; ``str()`` says what is wrong."""


def encode(key: str, payload: bytes) -> bytes:
    """The file content storing ``payload`` under ``key``."""
    name = key.encode()
    return _HEADER.pack(MAGIC, VERSION, len(name), len(payload), hashlib.sha256(payload).digest()) + name + payload


def decode(key: str, blob: bytes) -> bytes:
    """The payload of ``blob``, an entry written by :func:`encode` for ``key``; raises
    :class:`BadEntry` otherwise."""
    if len(blob) < _HEADER.size:
        raise BadEntry(f"{len(blob)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, version, key_len, payload_len, digest = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise BadEntry("not a cache entry of this format (wrong magic bytes)")
    if version != VERSION:
        raise BadEntry(f"format version {version}, this reader knows {VERSION}")
    name = key.encode()
    start = _HEADER.size + key_len
    if blob[_HEADER.size:start] != name:
        raise BadEntry("it belongs to another key (copied or renamed)")
    if len(blob) - start != payload_len:
        raise BadEntry(f"payload of {len(blob) - start} bytes, its header says {payload_len}")
    payload = blob[start:]
    if hashlib.sha256(payload).digest() != digest:
        raise BadEntry("payload digest mismatch (damaged)")
    return payload


def load_checked(path: Path, key: str, limit: int) -> bytes | None:
    """The payload stored at ``path`` for ``key`` (None: there is none); an entry that is not
    valid for ``key`` is removed with one warning naming it, and is None too (a miss)."""
    try:
        blob = read_entry(path, limit)
        return None if blob is None else decode(key, blob)
    except (BadEntry, OSError) as error:  # OSError: unreadable (permissions, I/O error)
        drop(path, error)
        return None


def drop(path: Path, error: BaseException, *companions: Path) -> None:
    """Remove the bad cache entry ``path`` (and its ``companions``), warning once with its name."""
    for file in (path, *companions):
        try:
            file.unlink(missing_ok=True)
        except OSError:  # a directory in an entry's place: left, refused again on the next read
            pass
    reason = " ".join(str(error).split())[:200] or type(error).__name__
    _log.warning("compile cache entry %s is corrupt (%s: %s): removed, the program is compiled again",
                 path, type(error).__name__, reason)


def read_entry(path: Path, limit: int) -> bytes | None:
    """The bytes of the regular file ``path`` (None: there is none); raises :class:`BadEntry`
    when ``path`` is something else (a symbolic link, FIFO, device, directory) or holds more than
    ``limit`` bytes."""
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        return None
    _check_regular(before, limit)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:  # removed meanwhile (another process trimmed it)
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise BadEntry("a symbolic link, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        _check_regular(st, limit)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise BadEntry("replaced while it was opened")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise BadEntry(f"more than the size bound of {limit} bytes")
    return b"".join(chunks)


def _check_regular(st: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise BadEntry(f"a {_kind(st.st_mode)}, not a regular file")
    if st.st_size > limit:
        raise BadEntry(f"{st.st_size} bytes, over the size bound of {limit} bytes")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` atomically (``0600``): a reader never sees part of it, and whatever was in
    its place (a symbolic link too) is replaced, never written through."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
