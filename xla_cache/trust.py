"""Whether a directory may hold cached programs: what loads from it runs as code in this process.

The policy of ssh's StrictModes and of pip's and Inductor's per-user caches, applied to what is
actually opened: :func:`open_dir` walks the path from ``/`` one directory at a time, never
following a symbolic link, and checks each directory it opened (``fstat`` of its descriptor).
Every directory above must be owned by root or this user and writable by no one else (no group or
other write bit) unless it is sticky, as ``/tmp`` is; the directory itself must be owned by this
user and writable by this user alone. The result is a :class:`Directory`, an open descriptor:
the cache reaches every entry and level relative to it, so a directory renamed away and replaced
by another after the check is never followed. A directory this module creates is ``0700``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

_DIR_FLAGS = os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# the directories above are only walked through (search permission is enough), never read
_WALK_FLAGS = _DIR_FLAGS | getattr(os, "O_PATH", os.O_RDONLY)
_GROUP_OR_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


class Untrusted(Exception):
    """A directory the cache must not use; ``str()`` says why and how to fix it."""


class Directory:
    """An open directory that passed the trust policy, at ``path`` when it was opened; entries and
    subdirectories are reached relative to ``fd`` (closed when the object goes)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    def __del__(self, _close=os.close) -> None:  # os.close bound: at exit the module may be gone
        try:
            _close(self.fd)
        except OSError:
            pass

    def subdir(self, name: str, *, create: bool) -> Directory | None:
        """The trusted subdirectory ``name`` (created ``0700`` when missing and ``create``; else
        None when missing). Raises :class:`Untrusted` naming what is wrong."""
        return _open_private(self.fd, name, self.path / name, create)


def open_dir(path: Path) -> Directory:
    """``path`` (created ``0700`` when missing; symbolic links in it resolved once, here) opened as
    a directory this user alone controls. Raises :class:`Untrusted` naming what is wrong."""
    real = Path(os.path.realpath(path))
    if real == real.parent:
        raise Untrusted(f"{path} is the root directory: choose a directory of your own")
    parent, above = os.open("/", _WALK_FLAGS), Path("/")
    try:
        for name in real.parts[1:-1]:
            _check_above(parent, above, real)
            try:
                child = _open_in(parent, name, above / name, True, _WALK_FLAGS)
            except Untrusted as error:
                raise Untrusted(f"{real} cannot be created or opened: {error}") from None
            os.close(parent)
            parent, above = child, above / name
        _check_above(parent, above, real)
        directory = _open_private(parent, real.name, real, True)
    finally:
        os.close(parent)
    assert directory is not None  # created when missing
    return directory


def private_dir(path: Path) -> Path:
    """``path`` resolved, when it is (or was created as) a directory :func:`open_dir` admits."""
    return open_dir(path).path


def check_owned(path: Path, st: os.stat_result, fix: str) -> None:
    """Raise :class:`Untrusted` unless ``st`` (``path``'s stat) is owned by this user and not
    writable by group or others (``fix`` says how to repair the mode)."""
    uid = os.getuid()
    if st.st_uid != uid:
        raise Untrusted(f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid}): "
                        "use a directory of your own")
    if st.st_mode & _GROUP_OR_OTHER_WRITE:
        raise Untrusted(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):#o}): {fix}")


def _open_in(parent: int, name: str, path: Path, create: bool, flags: int) -> int | None:
    """The descriptor of directory ``name`` in ``parent`` (None: missing and not ``create``)."""
    try:
        try:
            return os.open(name, flags, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass  # made meanwhile by another process: checked as any other
        except OSError as error:
            raise Untrusted(f"{path} cannot be created ({error.strerror}): choose a writable path") from None
        return os.open(name, flags, dir_fd=parent)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):  # O_DIRECTORY refuses a symbolic link as ENOTDIR
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                    raise Untrusted(f"{path} is a symbolic link: remove it") from None
            raise Untrusted(f"{path} is not a directory: remove it or choose another path") from None
        raise Untrusted(f"{path} cannot be opened ({error.strerror})") from None


def _open_private(parent: int, name: str, path: Path, create: bool) -> Directory | None:
    fd = _open_in(parent, name, path, create, os.O_RDONLY | _DIR_FLAGS)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        check_owned(path, st, f"chmod go-w {path}")
        if not st.st_mode & stat.S_IWUSR or not os.access(".", os.W_OK | os.X_OK, dir_fd=fd):
            raise Untrusted(f"{path} is not writable (mode {stat.S_IMODE(st.st_mode):#o}{_read_only_fs(fd)}): "
                            "make it writable or choose another path")
    except BaseException:
        os.close(fd)
        raise
    return Directory(fd, path)


def _check_above(fd: int, above: Path, real: Path) -> None:
    """The directory ``above`` (open as ``fd``), which holds ``real``, lets no other user replace it."""
    st = os.fstat(fd)
    if st.st_uid not in (os.getuid(), 0):
        raise Untrusted(f"{real} lies in {above}, owned by uid {st.st_uid}: another user could replace it; "
                        "use a directory of your own")
    if st.st_mode & _GROUP_OR_OTHER_WRITE and not st.st_mode & stat.S_ISVTX:
        who = "others" if st.st_mode & stat.S_IWOTH else f"group gid {st.st_gid}"
        raise Untrusted(f"{real} lies in {above}, writable by {who} without the sticky bit "
                        f"(mode {stat.S_IMODE(st.st_mode):#o}): another user could replace it; "
                        "use a directory of your own")


def _read_only_fs(fd: int) -> str:
    try:
        return ", read-only file system" if os.fstatvfs(fd).f_flag & os.ST_RDONLY else ""
    except OSError:
        return ""
