"""One cache entry on disk: a plain header, then the payload's raw bytes (never a pickle).

Header (little endian): ``MAGIC`` (8 bytes), format version (u32), key length (u32), payload
length (u64), the payload's sha256 (32 bytes), then the key (UTF-8). :func:`decode` checks each
against the file and the key asked for, so an entry that is damaged, truncated, of another format
or copied from another key's name is refused. Entries are named relative to their open, trusted
directory (:class:`xla_cache.trust.Directory`), never by path. :func:`read_entry` reads only a
regular file, up to a size bound, without following a symbolic link or blocking on a FIFO or
device, and only one this user alone wrote: owned by the user, writable by no one else, one link.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import stat
import struct

from xla_cache.trust import Directory

MAGIC = b"TTPUXC\r\n"  # the CR LF catches a text-mode copy
VERSION = 1
_HEADER = struct.Struct("<8sIIQ32s")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
_log = logging.getLogger("xla_cache")
_foreign_warned = [False]


class BadEntry(ValueError):
    """A file that is not a valid entry for the key asked for; ``str()`` says what is wrong."""


class ForeignEntry(BadEntry):
    """An entry file this user alone may not have written; ``str()`` says why."""


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


def load_checked(directory: Directory, name: str, key: str, limit: int) -> bytes | None:
    """The payload of entry ``name`` of ``directory`` stored for ``key`` (None: there is none); an
    entry that is not valid for ``key``, or not this user's own, is removed with a warning and is
    None too (a miss)."""
    try:
        blob = read_entry(directory, name, limit)
        return None if blob is None else decode(key, blob)
    except (BadEntry, OSError) as error:  # OSError: unreadable (permissions, I/O error)
        drop(directory, name, error)
        return None


def drop(directory: Directory, name: str, error: BaseException, *companions: str) -> None:
    """Remove the bad cache entry ``name`` of ``directory`` (and its ``companions``), warning with
    its path: once per entry for damage, once per process (:func:`reset_warnings`) for entries that
    are not this user's own, however many there are."""
    for file in (name, *companions):
        try:
            os.unlink(file, dir_fd=directory.fd)
        except OSError:  # gone already, or a directory in an entry's place: refused again on the next read
            pass
    path = directory.path / name
    if isinstance(error, ForeignEntry):
        if _foreign_warned[0]:
            _log.debug("compile cache entry %s refused: %s", path, error)
            return
        _foreign_warned[0] = True
        _log.warning("compile cache entry %s is not this user's own (%s): refused and removed, the program is "
                     "compiled again (further such entries are refused without a warning)", path, error)
        return
    reason = " ".join(str(error).split())[:200] or type(error).__name__
    _log.warning("compile cache entry %s is corrupt (%s: %s): removed, the program is compiled again",
                 path, type(error).__name__, reason)


def reset_warnings() -> None:
    """Warn again about the next entry that is not this user's own (a newly configured cache)."""
    _foreign_warned[0] = False


def read_entry(directory: Directory, name: str, limit: int) -> bytes | None:
    """The bytes of the regular file ``name`` of ``directory`` (None: there is none); raises
    :class:`BadEntry` when it is something else (a symbolic link, FIFO, device, directory) or holds
    more than ``limit`` bytes, :class:`ForeignEntry` when it is not this user's own file (another
    owner, writable by group or others, a hard link)."""
    try:
        before = os.stat(name, dir_fd=directory.fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    _check_regular(before, limit)
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=directory.fd)
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
        _check_own(st)
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


def _check_own(st: os.stat_result) -> None:
    """Only a file this user alone wrote, with no other name (a hard link to a file elsewhere
    could be rewritten through that name), is read."""
    if st.st_uid != os.getuid():
        raise ForeignEntry(f"owned by uid {st.st_uid}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ForeignEntry(f"writable by group or others, mode {stat.S_IMODE(st.st_mode):#o}")
    if st.st_nlink != 1:
        raise ForeignEntry(f"{st.st_nlink} hard links")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def write_atomic(directory: Directory, name: str, data: bytes) -> None:
    """Write entry ``name`` of ``directory`` atomically (``0600``): a reader never sees part of it,
    and whatever was in its place (a symbolic link too) is replaced, never written through."""
    tmp = f".tmp-{secrets.token_hex(8)}"
    fd = os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=directory.fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=directory.fd, dst_dir_fd=directory.fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=directory.fd)
        raise


def listing(directory: Directory, suffix: str) -> list[tuple[str, os.stat_result]]:
    """The names ending in ``suffix`` in ``directory`` with their (not followed) stat; entries
    removed meanwhile by another process are left out."""
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC, dir_fd=directory.fd)
    found = []
    try:
        with os.scandir(fd) as it:
            for entry in it:
                if entry.name.endswith(suffix):
                    with contextlib.suppress(FileNotFoundError):
                        found.append((entry.name, entry.stat(follow_symlinks=False)))
    finally:
        os.close(fd)
    return found
