"""Source files in persistent-cache keys, by identity: inode, size, modification and change times.

A key must change whenever a source file the program came from does; reading and hashing every
file of a package cost 40-50 ms of each new process's first step. Writing a file sets its
modification and change times (the change time also when a tool sets the modification time back,
as ``cp -p`` or ``tar`` do), as make and Python's own bytecode cache rely on; a copy or checkout
elsewhere gets new ones, so its keys differ: a miss, never a stale program.
"""

from __future__ import annotations

import hashlib
import os


def file_identity(path: str | os.PathLike | None) -> str:
    """``path``'s inode, size, modification and change times (a missing file: its name)."""
    if not path:
        return ""
    try:
        st = os.stat(path)
    except OSError:
        return f"missing:{path}"
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def tree_identity(root: str | os.PathLike) -> str:
    """Every ``.py`` file under ``root`` (each relative path and :func:`file_identity`), hashed."""
    entries = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d != "__pycache__"]
        entries += [os.path.join(directory, name) for name in files if name.endswith(".py")]
    h = hashlib.sha256()
    for path in sorted(entries):
        h.update(f"{os.path.relpath(path, root)}={file_identity(path)};".encode())
    return h.hexdigest()
