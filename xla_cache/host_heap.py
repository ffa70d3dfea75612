"""The C heap's free pages handed back to the system (glibc's ``malloc_trim``; nothing elsewhere).

On XLA:CPU glibc serves every large block from its one heap (``torch_tpu.runtime.host_heap``), so a
big temporary that is freed stays resident as a hole the next, differently sized, one cannot reuse
whole: loading tables one at a time then grows the heap by a share of the tables. :func:`release`
returns those holes' pages (the addresses stay the heap's, so reuse is unchanged).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform


@functools.cache  # (find_library runs ldconfig: once, not at every release)
def glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc, else None."""
    if platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def release() -> None:
    """Return the heap's free memory to the system (glibc; elsewhere nothing)."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
