"""One profiling session: torch.profiler (host) and jax.profiler (device) into a TensorBoard dir.

Layout written under ``log_dir`` (what TensorBoard's profile plugin, XProf, reads)::

    plugins/profile/<run>/<host>.xplane.pb       jax.profiler: the XLA/PJRT side (device ops)
    plugins/profile/<run>/torch.pt.trace.json    torch.profiler chrome trace (Perfetto, chrome://tracing)

``<run>`` is the timestamped directory jax.profiler creates; the chrome trace is moved next to it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from torchrec_tpu.profiling.phases import TRAIN_STEP

TORCH_TRACE_NAME = "torch.pt.trace.json"
# Kineto's log level above its highest (5: the "USDT: profiler_start/stop" lines it prints on stderr)
KINETO_QUIET = "6"
STEP_NAME = "train"  # XProf's step marker name (jax.profiler.StepTraceAnnotation)


@dataclass
class TraceFiles:
    run_dir: Path | None = None
    chrome_trace: Path | None = None
    xplane: Path | None = None
    profiler: profile | None = None  # for the text summary


def _profile_runs(log_dir: Path) -> set[Path]:
    root = log_dir / "plugins" / "profile"
    return set(root.iterdir()) if root.is_dir() else set()


@contextlib.contextmanager
def traced_step(index: int) -> Iterator[None]:
    """Mark training step ``index`` for both profilers: XProf's step marker
    (``jax.profiler.StepTraceAnnotation``, what its overview and step-time graph count) and the
    torch.profiler range ``step#<index>``."""
    import jax

    with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=index), record_function(f"step#{index}"):
        yield


@contextlib.contextmanager
def program_range(program: str) -> Iterator[None]:
    """The step's ``train_step`` range and, inside it, one naming the program that runs it
    (``program: <name>``), for both profilers."""
    import jax

    name = f"program: {program}"
    with record_function(TRAIN_STEP), record_function(name), jax.profiler.TraceAnnotation(name):
        yield


@contextlib.contextmanager
def profiling(log_dir: str | Path, with_jax: bool = True) -> Iterator[TraceFiles]:
    """Profile the body; the returned :class:`TraceFiles` is filled in when the body exits."""
    import jax

    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)  # read as the profiler starts
    before = _profile_runs(log_dir)
    files = TraceFiles()
    with contextlib.ExitStack() as stack:
        if with_jax:
            stack.enter_context(jax.profiler.trace(str(log_dir)))
        prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU], record_shapes=False))
        yield files
    files.profiler = prof
    new_runs = sorted(_profile_runs(log_dir) - before)
    run_dir = new_runs[-1] if new_runs else log_dir / "plugins" / "profile" / "torch"
    run_dir.mkdir(parents=True, exist_ok=True)
    files.run_dir, files.chrome_trace = run_dir, run_dir / TORCH_TRACE_NAME
    prof.export_chrome_trace(str(files.chrome_trace))
    files.xplane = next(iter(sorted(run_dir.glob("*.xplane.pb"))), None)
