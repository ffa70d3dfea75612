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
