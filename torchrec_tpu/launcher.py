"""How a command's process (a single one, or a rank of several under torchrun or a like launcher)
meets signals. Standard library only, so the CLI sets all of it before its slow imports:

- it dies with its launcher: ``PR_SET_PDEATHSIG`` asks the kernel for SIGTERM when torchrun
  exits (a launcher killed during the imports would otherwise leave the rank running with init
  as its parent);
- SIGTERM (torchrun stopping the job, the dead launcher, a scheduler) ends it at once with one
  line (with the way to resume where the job saved a checkpoint), wherever it is: waiting for
  the other ranks in the rendezvous, compiling or training. Python runs its signal handlers only
  between bytecodes of the main thread, and the main thread may sit for minutes in one C++ call
  (a store wait), so a thread woken through the signal wakeup fd leaves;
- a fatal signal (SIGSEGV, SIGABRT, ...) prints every thread's Python stack before the process
  dies, and SIGUSR1 prints them without stopping it (``kill -USR1 PID``: where is a hung rank?).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading

from tpu_facts import knobs

_PR_SET_PDEATHSIG = 1
_launcher: int | None = None  # the parent pid seen by the first call
_resume_hint = ""  # set_resume_hint's
SIGTERM_EXIT = 128 + signal.SIGTERM


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def is_rank() -> bool:
    """This process is one rank of several (torchrun's WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


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


def set_resume_hint(checkpoint_root: object, step: int) -> None:
    """Have the lines of a stop (Ctrl-C, SIGTERM) say how to continue from the checkpoint of
    ``step`` under ``checkpoint_root``; the job calls it after each checkpoint it saves."""
    global _resume_hint
    _resume_hint = f"to continue from step {step}, run the same command with --resume {checkpoint_root}"


def stop_line(prog: str, why: str) -> str:
    """``<prog>: <why>``, then the resume hint where the job saved a checkpoint."""
    return f"{prog}: {why}" + (f"; {_resume_hint}" if _resume_hint else "") + "\n"


def prepare_process(prog: str) -> None:
    """Stack dumps on fatal signals and SIGUSR1, and SIGTERM ending the process with the line
    ``<prog>: stopped by SIGTERM (rank R of N)`` (the rank where it is one of several; the resume
    hint where a checkpoint was saved), exit status 143. Call from the main thread of a command."""
    err = 2  # the process's stderr, not sys.stderr: a caller may have swapped that for an object without a file
    faulthandler.enable(file=err, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=err, all_threads=True)
    why = "stopped by SIGTERM" + (f" (rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')})"
                                  if is_rank() else "")
    leaving = threading.Lock()

    def leave(*_: object) -> None:  # from the handler or the watch, whichever runs first
        if leaving.acquire(blocking=False):
            os.write(err, stop_line(prog, why).encode())  # no buffered stream: another thread may hold its lock
            os._exit(SIGTERM_EXIT)

    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)  # the C-level handler writes each Python-handled signal here
    signal.signal(signal.SIGTERM, leave)

    def watch() -> None:
        while True:
            if signal.SIGTERM in os.read(wake_read, 64):
                leave()

    threading.Thread(target=watch, name="sigterm-watch", daemon=True).start()


# glibc's malloc as torch_tpu.runtime.host_heap sets it on XLA:CPU (one arena, no mmap'd blocks, 1 GiB
# of freed memory kept), here from the process's first allocation: set later, the arenas that
# libraries' threads took at import (pyarrow's) stay, and XLA's workers share them
XLA_CPU_MALLOC = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824"
# How long CPU torch's OpenMP workers (libgomp) spin after each parallel region before they sleep,
# where the user set neither this nor OMP_WAIT_POLICY. libgomp's default, 300,000 spins (~10 ms on
# this host), holds a core after every torch op; XLA:CPU's threads, running the process's programs
# beside CPU torch (the towers or STU layers on cpu, lookups and attention in XLA programs), then
# wait for it on a small host (bench_hstu, 2 cores, quiet: the step 1.04x and 1.22x of plain PyTorch
# with the default, 1.62x and 1.32x with 30,000, 1.50x and 1.48x with 3,000). 30,000 (~1 ms) still
# keeps the workers awake between one op and the next.
GOMP_SPINCOUNT = "30000"


def xla_cpu_env() -> dict[str, str]:
    """What the environment of a process that runs XLA:CPU programs lacks, to be set before it starts:
    glibc's malloc set up for XLA:CPU (:data:`XLA_CPU_MALLOC`; not where libc is not glibc or
    ``TORCH_TPU_HOST_HEAP=0``) and libgomp's spin (:data:`GOMP_SPINCOUNT`; Linux, where CPU torch's
    OpenMP is libgomp). Empty where the device is a TPU or the environment has both."""
    import importlib.util
    import platform

    if importlib.util.find_spec("libtpu") is not None:
        return {}
    env = {}
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if knobs.HOST_HEAP.on() and platform.libc_ver()[0] == "glibc" and XLA_CPU_MALLOC not in tunables:
        env["GLIBC_TUNABLES"] = f"{tunables}:{XLA_CPU_MALLOC}" if tunables else XLA_CPU_MALLOC
    if sys.platform.startswith("linux") and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        env["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT
    return env


def restart_with_xla_cpu_env() -> None:
    """Run this command again in this process (``exec``) with :func:`xla_cpu_env`, once."""
    env = xla_cpu_env()
    if env:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **env})
