"""Whether a benchmark ran on a quiet box: the CPU time that processes OUTSIDE the benchmark's own
process tree used while it ran, from /proc, as a share of the box's capacity.

On this project's 2-core machines any other job distorts a ratio (other work slows torch's OpenMP
GEMMs far more than XLA:CPU's pool), so a figure taken beside other work does not count. Every
``bench/`` script runs its ``main`` through :func:`run`, which prints one line at the end::

    outside load: 0.8% of 2 cores over 63 s (quiet: the figures count)
    outside load: 37.5% of 2 cores over 63 s (NOT QUIET: the figures above do not count)

Nested bench processes (workers a benchmark starts) are part of its tree and print nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

QUIET_SHARE = 0.05  # above this share of the box used by others, a figure does not count
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


def run(main: Callable[[], object]) -> None:
    """``main()``, then (in the outermost benchmark process only) its :class:`OutsideLoad` line."""
    if os.environ.get(_NESTED):
        main()
        return
    os.environ[_NESTED] = "1"  # inherited by every process the benchmark starts
    watch = Watch()
    try:
        main()
    finally:
        print(watch.stop().line(), flush=True)
