"""The device's memory on XLA:CPU is the process heap: keep what a program frees for the next run.

XLA:CPU allocates each run's temporaries (one block: a DLRM training step at batch 2048 takes
44 MB) with ``malloc``. Above glibc's mmap ceiling (32 MiB, the most its threshold adapts to)
every run maps fresh pages and unmaps them after: ~10k page faults and 44 MB zeroed by the
kernel per step, a fifth of the step's CPU time. A TPU's runtime keeps its HBM in a pool across
runs; here glibc is told to serve large blocks from its heap (``M_MMAP_MAX`` 0) and keep up to
:data:`KEPT_BYTES` of freed memory at its top (``M_TRIM_THRESHOLD``), so a step reuses the pages
of the last. :func:`release` hands what is kept back to the system (``torch.tpu.empty_cache()``).

Applied once, when the tpu device's first storage is made on a CPU platform under glibc;
``TORCH_TPU_HOST_HEAP=0`` leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

from torch_tpu.runtime import knobs
from torch_tpu.runtime._jax import jax

KEPT_BYTES = 1 << 27  # freed memory glibc keeps at the heap's top (128 MiB)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # <malloc.h>
_applied: list[bool] = []


@functools.cache  # (find_library runs ldconfig: once, not at every empty_cache())
def _glibc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def keep_freed_memory(device_platform: str) -> bool:
    """Make malloc keep large freed blocks for reuse, once per process, where ``device_platform``
    is ``cpu`` (XLA:CPU) and the C library is glibc. Returns whether it is in effect."""
    if not _applied:
        libc = _glibc() if device_platform == "cpu" and knobs.HOST_HEAP.on() else None
        _applied.append(bool(libc and libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, KEPT_BYTES)))
    return _applied[0]


def note_array(array: jax.Array) -> None:
    """:func:`keep_freed_memory` for the platform of the first device array (the first run's)."""
    if not _applied:
        keep_freed_memory(next(iter(array.devices())).platform)


def release() -> None:
    """Return the heap's free memory to the system (where :func:`keep_freed_memory` kept it)."""
    if _applied and _applied[0]:
        libc = _glibc()
        if libc is not None:
            libc.malloc_trim(0)
