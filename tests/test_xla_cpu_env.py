"""A sparsecore job's process starts with glibc's malloc and libgomp's spin set up for XLA:CPU
(``torchrec_tpu.launcher``): the command execs itself once with ``GLIBC_TUNABLES``, the same settings
``torch_tpu.runtime.host_heap`` applies at import (there too late for the arenas other libraries'
threads took first), and ``GOMP_SPINCOUNT`` unless the user chose how OpenMP waits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_tpu.launcher import GOMP_SPINCOUNT, XLA_CPU_MALLOC

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import os
from torchrec_tpu.launcher import restart_with_xla_cpu_env
print("run", os.environ.get("GLIBC_TUNABLES", "-"), os.environ.get("GOMP_SPINCOUNT", "-"), flush=True)
restart_with_xla_cpu_env()
"""


_SET = ("GLIBC_TUNABLES", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def _runs(**env: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if k not in _SET}, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split("\n")[:-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_process_execs_itself_once_with_the_tunables_and_the_spin():
    assert _runs() == ["run - -", f"run {XLA_CPU_MALLOC} {GOMP_SPINCOUNT}"]
    assert _runs(GLIBC_TUNABLES="glibc.malloc.tcache_count=0") == [
        "run glibc.malloc.tcache_count=0 -", f"run glibc.malloc.tcache_count=0:{XLA_CPU_MALLOC} {GOMP_SPINCOUNT}"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp's spin")
def test_opting_out_keeps_malloc_as_it_is():
    assert _runs(TORCH_TPU_HOST_HEAP="0") == ["run - -", f"run - {GOMP_SPINCOUNT}"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_users_openmp_wait_is_kept():
    assert _runs(GOMP_SPINCOUNT="7") == ["run - 7", f"run {XLA_CPU_MALLOC} 7"]
    assert _runs(OMP_WAIT_POLICY="PASSIVE") == ["run - -", f"run {XLA_CPU_MALLOC} -"]


def test_the_tunables_are_host_heaps_settings():
    from torch_tpu.runtime import host_heap

    settings = dict(item.split("=") for item in XLA_CPU_MALLOC.split(":"))
    assert settings == {"glibc.malloc.arena_max": "1", "glibc.malloc.mmap_max": "0",
                        "glibc.malloc.trim_threshold": str(host_heap.KEPT_BYTES)}
