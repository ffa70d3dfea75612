"""On XLA:CPU the tpu device keeps large freed blocks in the heap (``torch_tpu.runtime.host_heap``):
a block malloc'd after one of its size was freed reuses its pages instead of mapping (and the kernel
zeroing) fresh ones, as XLA:CPU's per-run temporaries are. Counted with the process's minor page
faults, in a fresh interpreter each (malloc settings are process-wide)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BLOCK = 48 << 20  # above glibc's 32 MiB mmap ceiling
SCRIPT = f"""
import ctypes, ctypes.util, resource, torch, torch_tpu
torch.ones(1, device="tpu")  # the device's first storage
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for i in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc({BLOCK})
    ctypes.memset(block, 1, {BLOCK})
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
torch.tpu.empty_cache()  # hands the kept block back
print(max(faults[1:]))
"""


def faults_per_block(heap: str) -> int:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TORCH_TPU_HOST_HEAP": heap, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_large_block_is_reused_not_mapped_afresh():
    pages = BLOCK // os.sysconf("SC_PAGE_SIZE")
    unmapped, kept = faults_per_block("0"), faults_per_block("1")
    assert unmapped > pages // 2  # as malloc does by default: every block faulted in afresh
    assert kept < pages // 50, (kept, unmapped)
