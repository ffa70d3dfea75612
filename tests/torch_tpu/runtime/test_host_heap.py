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
SCRIPT = """
import ctypes, ctypes.util, resource, sys, threading, torch, torch_tpu
torch.ones(1, device="tpu")  # the device's first storage
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = int(sys.argv[1])
faults = []

def one_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

for i in range(4):
    if sys.argv[2] == "thread":  # a thread of its own each time, as XLA's workers allocate
        worker = threading.Thread(target=one_block)
        worker.start()
        worker.join()
    else:
        one_block()
torch.tpu.empty_cache()  # hands the kept block back
print(max(faults[1:]))
"""


def faults_per_block(heap: str, size: int, where: str) -> int:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(size), where], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "TORCH_TPU_HOST_HEAP": heap, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_freed_large_block_is_reused_not_mapped_afresh(where):
    pages = BLOCK // os.sysconf("SC_PAGE_SIZE")
    unmapped, kept = faults_per_block("0", BLOCK, where), faults_per_block("1", BLOCK, where)
    assert unmapped > pages // 2  # as malloc does by default: every block faulted in afresh
    assert kept < pages // 50, (kept, unmapped)
