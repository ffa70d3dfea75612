"""A rank started by torchrun dies with it: ``PR_SET_PDEATHSIG`` asks the kernel for SIGTERM when
the launcher exits. Standard library only, so the CLI sets it before its slow imports (a launcher
killed during them would otherwise leave the rank running with init as its parent).
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1
_launcher: int | None = None  # the parent pid seen by the first call


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def die_with_parent() -> None:
    """Have the kernel send SIGTERM to this process when its parent (torchrun) exits (Linux; a
    no-op elsewhere); exit at once when the parent first seen here is already gone."""
    global _launcher
    if _launcher is None:
        _launcher = os.getppid()
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            return
    if os.getppid() != _launcher:  # the launcher died before (or while) the signal was set
        os._exit(1)


# glibc's malloc as torch_tpu.runtime.host_heap sets it on XLA:CPU (one arena, no mmap'd blocks, 1 GiB
# of freed memory kept), here from the process's first allocation: set later, the arenas that
# libraries' threads took at import (pyarrow's) stay, and XLA's workers share them
XLA_CPU_MALLOC = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824"


def xla_cpu_malloc_env() -> dict[str, str]:
    """The environment a process that runs XLA:CPU programs starts with (empty where the device
    is a TPU, libc is not glibc, or ``TORCH_TPU_HOST_HEAP=0``)."""
    import importlib.util
    import platform

    if (os.environ.get("TORCH_TPU_HOST_HEAP", "1") == "0" or platform.libc_ver()[0] != "glibc"
            or importlib.util.find_spec("libtpu") is not None):
        return {}
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return {"GLIBC_TUNABLES": f"{tunables}:{XLA_CPU_MALLOC}" if tunables else XLA_CPU_MALLOC}


def restart_with_xla_cpu_malloc() -> None:
    """Run this command again in this process (``exec``) with :func:`xla_cpu_malloc_env`, once."""
    import sys

    env = xla_cpu_malloc_env()
    if env and XLA_CPU_MALLOC not in os.environ.get("GLIBC_TUNABLES", ""):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **env})
