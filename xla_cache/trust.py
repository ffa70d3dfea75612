"""Whether a directory may hold cached programs: what loads from it runs as code in this process.

The policy of ssh's StrictModes and of pip's and Inductor's per-user caches: a cache directory is
used only when it is a real directory owned by the current user, writable by that user and by no
one else (no group or other write bit), and no directory above it lets another user rename it
away (writable by others without the sticky bit, or owned by a user other than this one or root).
A directory this module creates is created ``0700``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class Untrusted(Exception):
    """A directory the cache must not use; ``str()`` says why and how to fix it."""


def private_dir(path: Path, *, create: bool = True, follow: bool = True) -> Path:
    """``path`` as a directory this user alone controls (created ``0700`` when missing and
    ``create``), resolved when ``follow`` (a symbolic link at ``path`` itself; else one is refused).
    Raises :class:`Untrusted` naming what is wrong."""
    if create:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError:
            raise Untrusted(f"{path} is not a directory: remove it or choose another path") from None
        except OSError as error:
            raise Untrusted(f"{path} cannot be created ({error.strerror}): choose a writable path") from None
    real = Path(os.path.realpath(path)) if follow else path
    try:
        st = os.lstat(real)
    except OSError as error:
        raise Untrusted(f"{path} cannot be read ({error.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise Untrusted(f"{path} is a symbolic link: remove it")
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{path} is not a directory: remove it or choose another path")
    check_owned(real, st, f"chmod go-w {real}")
    if not st.st_mode & stat.S_IWUSR or not os.access(real, os.W_OK | os.X_OK):
        raise Untrusted(f"{path} is not writable (mode {stat.S_IMODE(st.st_mode):#o}{_read_only_fs(real)}): "
                        "make it writable or choose another path")
    _check_ancestors(real)
    return real


def check_owned(path: Path, st: os.stat_result, fix: str) -> None:
    """Raise :class:`Untrusted` unless ``st`` (``path``'s lstat) is owned by this user and not
    writable by group or others (``fix`` says how to repair the mode)."""
    uid = os.getuid()
    if st.st_uid != uid:
        raise Untrusted(f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid}): "
                        "use a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Untrusted(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):#o}): {fix}")


def _check_ancestors(real: Path) -> None:
    """No directory above ``real`` lets another user replace it."""
    uid = os.getuid()
    for parent in real.parents:
        try:
            st = os.stat(parent)
        except OSError:
            continue  # unreadable from here: nobody can list it to swap entries through it either
        if st.st_uid not in (uid, 0):
            raise Untrusted(f"{real} lies in {parent}, owned by uid {st.st_uid}: another user could replace it; "
                            "use a directory of your own")
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise Untrusted(f"{real} lies in {parent}, writable by others without the sticky bit "
                            f"(mode {stat.S_IMODE(st.st_mode):#o}): another user could replace it; "
                            "use a directory of your own")


def _read_only_fs(path: Path) -> str:
    try:
        return ", read-only file system" if os.statvfs(path).f_flag & os.ST_RDONLY else ""
    except OSError:
        return ""
