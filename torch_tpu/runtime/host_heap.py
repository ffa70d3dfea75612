"""The device's memory on XLA:CPU is the process heap: keep what a program frees for the next run.

XLA:CPU allocates each run's temporaries (one block: a DLRM training step at batch 2048 takes
44 MB) with ``malloc``. Above glibc's mmap ceiling (32 MiB, the most its threshold adapts to)
every run maps fresh pages and unmaps them after: ~10k page faults and 44 MB zeroed by the
kernel per step, a fifth of the step's CPU time. A TPU's runtime keeps its HBM in a pool across
runs; here glibc is told to serve large blocks from its heap (``M_MMAP_MAX`` 0), from one arena
(``M_ARENA_MAX`` 1: XLA's worker threads would otherwise allocate in arenas of their own, whose
heaps glibc unmaps whenever they fall empty, so every step faulted its temporaries in again: 134 MB
a step at MLPerf's DLRM-DCN, a fifth of its CPU time) and keep up to :data:`KEPT_BYTES` of freed
memory at its top (``M_TRIM_THRESHOLD``), so a step reuses the pages of the last. Kept memory is
what a step already used, so the peak resident size does not grow. :func:`release` hands what is
kept back to the system (``torch.tpu.empty_cache()``).

Applied once, when ``torch_tpu`` registers the device (before XLA starts threads that would take
arenas of their own), where the device will be XLA:CPU (no TPU runtime installed) and the C
library is glibc; ``TORCH_TPU_HOST_HEAP=0`` leaves malloc as it is.
"""

from __future__ import annotations

import importlib.util

from tpu_facts import knobs
from xla_cache import host_heap

KEPT_BYTES = 1 << 30  # freed memory glibc keeps at the heap's top (1 GiB)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # <malloc.h>
_applied: list[bool] = []


def keep_freed_memory() -> bool:
    """Make malloc keep large freed blocks for reuse, once per process, where the device runs on
    XLA:CPU (no ``libtpu``) and the C library is glibc. Returns whether it is in effect."""
    if not _applied:
        libc = host_heap.glibc() if importlib.util.find_spec("libtpu") is None and knobs.HOST_HEAP.on() else None
        _applied.append(bool(libc and libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_ARENA_MAX, 1)
                             and libc.mallopt(_M_TRIM_THRESHOLD, KEPT_BYTES)))
    return _applied[0]


def release() -> None:
    """Return the heap's free memory to the system (where :func:`keep_freed_memory` kept it)."""
    if _applied and _applied[0]:
        host_heap.release()
