"""Whether a benchmark ran on a quiet box: the CPU time that processes OUTSIDE the benchmark's own
process tree used while it ran, from /proc, as a share of the box's capacity.

On this project's 2-core machines any other job distorts a ratio (other work slows torch's OpenMP
GEMMs far more than XLA:CPU's pool), so a figure taken beside other work does not count. Every
``bench/`` script runs its ``main`` through :func:`run`, which prints one line at the end::

    outside load: 0.8% of 2 cores over 63 s (quiet: the figures count)
    outside load: 37.5% of 2 cores over 63 s (NOT QUIET: the figures above do not count)

Nested bench processes (workers a benchmark starts) are part of its tree and print nothing.

Other processes are not the only thing that moves a figure: a VM's neighbours slow the whole host
without showing in /proc. So :func:`run` also times a fixed one-core sgemm before and after ``main``
(:class:`HostSpeed`) and says when the host's speed moved by more than 10% between the two::

    host speed: one-core sgemm 92.4 GFLOP/s at the start, 91.0 at the end (steady)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

QUIET_SHARE = 0.05  # above this share of the box used by others, a figure does not count
HOST_SPEED_TOLERANCE = 0.10  # a start-to-end change of the probe's rate above this, the host moved
_NESTED = "TORCHREC_TPU_BENCH_WATCHED"  # set for the processes a watched benchmark starts


def _busy_ticks() -> int:
    """CPU ticks the whole box spent busy since boot (``/proc/stat``'s first line)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return user + nice + system + irq + softirq + steal


def _process_ticks() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU ticks of the process and its reaped children) for every process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        out[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))  # utime stime cutime cstime
    return out


def _tree_ticks(root: int) -> int:
    """CPU ticks of ``root`` and every live descendant (exited ones are in their parents' counts)."""
    processes = _process_ticks()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += processes.get(pid, (0, 0))[1]
        todo.extend(children.get(pid, []))
    return total


@dataclass(frozen=True)
class OutsideLoad:
    """What processes outside the watched tree used: ``share`` of ``cores`` over ``seconds``."""

    share: float
    cores: int
    seconds: float

    @property
    def quiet(self) -> bool:
        return self.share <= QUIET_SHARE

    def line(self) -> str:
        verdict = "quiet: the figures count" if self.quiet else "NOT QUIET: the figures above do not count"
        return (f"outside load: {self.share:.1%} of {self.cores} cores over {self.seconds:.0f} s "
                f"(more than {QUIET_SHARE:.0%} is not quiet; {verdict})")


class Watch:
    """Measures :class:`OutsideLoad` from its creation to :meth:`stop` (this process's tree)."""

    def __init__(self) -> None:
        self._hz = os.sysconf("SC_CLK_TCK")
        self._cores = os.cpu_count() or 1
        self._start = time.monotonic(), _busy_ticks(), _tree_ticks(os.getpid())

    def stop(self) -> OutsideLoad:
        start_time, start_busy, start_own = self._start
        seconds = max(time.monotonic() - start_time, 1e-9)
        outside = (_busy_ticks() - start_busy) - (_tree_ticks(os.getpid()) - start_own)
        return OutsideLoad(max(outside, 0) / self._hz / (seconds * self._cores), self._cores, seconds)


# Best of 7 timings of 10 products of a 512 x 512 fp32 matrix on one thread, in GFLOP/s: a neighbour
# that slows the host slows every timing, so the best still shows it, while a preempted timing drops out.
_SGEMM_PROBE = """
import time, numpy as np
a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
best = float("inf")
for _ in range(7):
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    best = min(best, time.perf_counter() - start)
print(10 * 2 * 512 ** 3 / best / 1e9)
"""
_ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def sgemm_gflops() -> float:
    """This host's one-core sgemm rate now, in GFLOP/s (a fresh process, so the caller's threads and
    caches do not enter)."""
    probe = subprocess.run([sys.executable, "-c", _SGEMM_PROBE], env={**os.environ, **_ONE_THREAD},
                           capture_output=True, text=True, check=True)
    return float(probe.stdout)


@dataclass(frozen=True)
class HostSpeed:
    """The one-core sgemm rate at a benchmark's ``start`` and ``end``, in GFLOP/s."""

    start: float
    end: float

    @property
    def change(self) -> float:
        return self.end / self.start - 1

    @property
    def moved(self) -> bool:
        return abs(self.change) > HOST_SPEED_TOLERANCE

    def line(self) -> str:
        verdict = (f"HOST SPEED MOVED by {self.change:+.0%}: the figures above do not count" if self.moved
                   else "steady")
        return (f"host speed: one-core sgemm {self.start:.1f} GFLOP/s at the start, {self.end:.1f} at the end "
                f"(more than {HOST_SPEED_TOLERANCE:.0%} apart is not steady; {verdict})")


def run(main: Callable[[], object]) -> None:
    """``main()``, then (in the outermost benchmark process only) its :class:`OutsideLoad` line and
    its :class:`HostSpeed` line."""
    if os.environ.get(_NESTED) or {"-h", "--help"} & set(sys.argv[1:]):
        main()  # a worker of the benchmark, or only its help: no run to judge
        return
    os.environ[_NESTED] = "1"  # inherited by every process the benchmark starts
    speed_at_start = sgemm_gflops()
    watch = Watch()
    try:
        main()
    finally:
        print(watch.stop().line(), flush=True)
        print(HostSpeed(speed_at_start, sgemm_gflops()).line(), flush=True)
