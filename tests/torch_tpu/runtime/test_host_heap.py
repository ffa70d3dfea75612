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

def one_block(faults):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

for where in sys.argv[2:]:
    faults = []
    for i in range(4):
        if where == "thread":  # a thread of its own each time, as XLA's workers allocate
            worker = threading.Thread(target=one_block, args=(faults,))
            worker.start()
            worker.join()
        else:
            one_block(faults)
    torch.tpu.empty_cache()  # hands the kept block back
    print(max(faults[1:]))
"""

def faults_per_block(heap: str, size: int, where: tuple[str, ...]) -> dict[str, int]:
    """Per place in ``where``, run in turn in one fresh interpreter: the most minor page faults one
    block after the first took."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(size), *where], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "TORCH_TPU_HOST_HEAP": heap, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(zip(where, map(int, done.stdout.split()[-len(where):]), strict=True))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_large_block_is_reused_not_mapped_afresh():
    """On the main thread and on a thread of its own each time (one interpreter per heap setting:
    the kept block is handed back between the two)."""
    pages = BLOCK // os.sysconf("SC_PAGE_SIZE")
    places = ("main", "thread")
    unmapped, kept = faults_per_block("0", BLOCK, places), faults_per_block("1", BLOCK, places)
    for where in places:
        assert unmapped[where] > pages // 2, where  # as malloc does by default: every block faulted in afresh
        assert kept[where] < pages // 50, (where, kept, unmapped)
