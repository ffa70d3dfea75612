"""The jobs' progress: tqdm bars on a terminal, else a plain line at least every 30 s.

``disable=None`` is tqdm's "no bar unless the output is a terminal": a log redirected to a file gets
no carriage-return redraws. There the jobs (``infer``, ``data convert``, ``train`` and its Ray
workers) log :class:`ProgressLine`'s lines instead: rows done, rows/s and the time left, at most
every :func:`progress_interval` seconds, so a long part of a job is never silent.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from tpu_facts import knobs


def progress_bar(iterable: Any = None, *, enabled: bool = True, **kwargs: Any) -> Any:
    """``tqdm(iterable, **kwargs)``, shown when ``enabled`` and stderr is a terminal."""
    from tqdm import tqdm

    return tqdm(iterable, disable=None if enabled else True, **kwargs)


def progress_interval() -> float:
    """Seconds between progress lines: ``$TORCHREC_TPU_PROGRESS_SECONDS`` (``knobs.PROGRESS_SECONDS``), else 30."""
    return knobs.PROGRESS_SECONDS.number()


def duration_text(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h07m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def eta_text(elapsed: float, fraction: float) -> str:
    """``ETA 1m10s`` for work ``fraction`` (0..1) done in ``elapsed`` seconds at the same pace;
    ``ETA ?`` before anything is done."""
    if fraction <= 0 or elapsed <= 0:
        return "ETA ?"
    return f"ETA {duration_text(elapsed * (1 - min(fraction, 1.0)) / fraction)}"


class ProgressLine:
    """Lines of ``what: 1,234/5,678 rows (21%)  456 rows/s  ETA 9s``, passed to ``emit`` at most
    every ``interval`` seconds (default :func:`progress_interval`) as :meth:`update` is called.

    ``total`` None (rows not known ahead, e.g. text read by bytes): ``update`` takes the fraction
    of the work done instead, for the ETA."""

    def __init__(self, emit: Callable[[str], None], what: str, total: int | None = None, unit: str = "rows",
                 interval: float | None = None) -> None:
        self.emit, self.what, self.total, self.unit = emit, what, total, unit
        self.interval = progress_interval() if interval is None else interval
        self.start = self.last = time.perf_counter()

    def due(self) -> bool:
        """Whether ``interval`` seconds have passed since the last line (or the start)."""
        return time.perf_counter() - self.last >= self.interval

    def mark(self) -> None:
        """Count a line the caller logged itself (of its own form) as the last line."""
        self.last = time.perf_counter()

    def update(self, done: int, fraction: float | None = None) -> None:
        """Emit :meth:`line` for ``done`` rows when one is :meth:`due`."""
        if self.due():
            self.emit(self.line(done, fraction))

    def line(self, done: int, fraction: float | None = None) -> str:
        """The progress line for ``done`` rows (``fraction`` of the work, when there is no total)."""
        self.mark()
        elapsed = self.last - self.start
        if self.total:
            fraction = done / self.total
            count = f"{done:,}/{self.total:,} {self.unit} ({fraction:.0%})"
        else:
            count = f"{done:,} {self.unit}" + (f" ({fraction:.0%})" if fraction is not None else "")
        rate = done / elapsed if elapsed > 0 else 0.0
        return f"{self.what}: {count}  {rate:,.0f} {self.unit}/s  {eta_text(elapsed, fraction or 0.0)}"
