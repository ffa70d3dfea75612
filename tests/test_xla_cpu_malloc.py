"""A sparsecore job's process starts with glibc's malloc set up for XLA:CPU (``torchrec_tpu.launcher``):
the command execs itself once with ``GLIBC_TUNABLES``, the same settings ``torch_tpu.runtime.host_heap``
applies at import (there too late for the arenas other libraries' threads took first)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_tpu.launcher import XLA_CPU_MALLOC

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import os
from torchrec_tpu.launcher import restart_with_xla_cpu_malloc
print("run", os.environ.get("GLIBC_TUNABLES", "-"), flush=True)
restart_with_xla_cpu_malloc()
"""


def _runs(**env: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split("\n")[:-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_process_execs_itself_once_with_the_tunables():
    assert _runs() == ["run -", f"run {XLA_CPU_MALLOC}"]
    assert _runs(GLIBC_TUNABLES="glibc.malloc.tcache_count=0") == [
        "run glibc.malloc.tcache_count=0", f"run glibc.malloc.tcache_count=0:{XLA_CPU_MALLOC}"]


def test_opting_out_keeps_malloc_as_it_is():
    assert _runs(TORCH_TPU_HOST_HEAP="0") == ["run -"]


def test_the_tunables_are_host_heaps_settings():
    from torch_tpu.runtime import host_heap

    settings = dict(item.split("=") for item in XLA_CPU_MALLOC.split(":"))
    assert settings == {"glibc.malloc.arena_max": "1", "glibc.malloc.mmap_max": "0",
                        "glibc.malloc.trim_threshold": str(host_heap.KEPT_BYTES)}
