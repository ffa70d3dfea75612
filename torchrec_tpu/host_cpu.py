"""The host's processor as people name it (``/proc/cpuinfo``'s model name), for lines that say
which machine a figure or a log came from."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The processor's marketing name (``AMD EPYC 9B14``); the architecture (``x86_64``) where
    the system does not say."""
    try:
        with open("/proc/cpuinfo") as info:
            name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        name = platform.processor()
    return name or platform.machine()
