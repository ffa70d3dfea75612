"""Device traces inside ``torch.profiler``: ``profile(activities=[CPU, PrivateUse1])`` on tpu.

Why there is no Kineto plug-in: torch.profiler collects device activity only through C++ hooks,
a PrivateUse1 observer (``REGISTER_PRIVATEUSE1_OBSERVER``) or a libkineto ``IActivityProfiler``
factory registered with ``libkineto::api()``; neither can be registered from Python, and this
backend has no C++ extension. Selecting ``ProfilerActivity.PrivateUse1`` (shown as
``ProfilerActivity.TPU``) is accepted by torch but records nothing by itself.

What happens instead (installed by ``import torch_tpu``): a ``torch.profiler.profile`` whose
activities include PrivateUse1 runs ``jax.profiler`` (the PJRT/XLA profiler: TPU planes on a chip,
the XLA:CPU executor threads here) for exactly its recording windows (``start_trace`` /
``stop_trace``, so ``schedule=`` cycles too; the device is synchronized before a window closes).
Then

* ``prof.export_chrome_trace(path)`` -- and so ``torch.profiler.tensorboard_trace_handler`` --
  writes the device events into the same Chrome trace: one process per device plane (``TPU:0``
  here the XLA:CPU executor), one thread per XLA line, events of category ``kernel`` with their
  ``hlo_op`` / ``hlo_module`` as args, on torch's clock (both profilers stamp wall-clock
  nanoseconds; Kineto's ``ts`` counts microseconds from ``baseTimeNanoseconds``);
* :func:`tensorboard_trace_handler` (an ``on_trace_ready`` handler) writes one TensorBoard run:
  ``<dir>/plugins/profile/<run>/<worker>.xplane.pb`` (the XSpace the TensorBoard profile plugin,
  XProf, opens: trace viewer, op profile, ...) beside ``<worker>.pt.trace.json`` (the merged
  Chrome trace: host and device events; Perfetto, chrome://tracing, torch-tb-profiler).

``device_xspace(prof)`` is the path of the last window's XSpace. jax.profiler runs one trace per
process: while another one is active (``jax.profiler.trace``) the torch profile records host events
only, with a warning.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity
from torch.profiler.profiler import _KinetoProfile

from torch_tpu.runtime._jax import jax

_STATE = "_torch_tpu_device_trace"  # attribute of the profile: its device trace state
_DEVICE_PID = 1 << 20  # pid of the first device plane in the Chrome trace (Kineto uses OS pids)
_XLA_STATS = ("hlo_op", "hlo_module", "program_id", "run_id", "device_ordinal")
_installed: list[bool] = []


def _wants_device(prof: _KinetoProfile) -> bool:
    return ProfilerActivity.PrivateUse1 in (prof.activities or ())


class TpuProfilerConfig(torch.profiler._ExperimentalConfig):
    """``torch.profiler.profile(experimental_config=TpuProfilerConfig(...))``: the device trace's
    options (``torch.tpu.profiler.TpuProfilerConfig``, TorchTPU's name and XLA's defaults).
    ``host_tracer_level`` (0-3) and ``python_tracer_level`` (0/1) go to jax.profiler;
    ``device_tracer_level=0`` records no device trace; ``run_dir`` also gets each window's XSpace as
    ``<run_dir>/plugins/profile/<time>/<host>[_<worker_rank>].xplane.pb``;
    ``experimental_options`` are the profiler's advanced configuration (int, bool or str values;
    ``check_experimental_options`` checks that)."""

    def __init__(self, *, host_tracer_level: int = 2, device_tracer_level: int = 1, python_tracer_level: int = 0,
                 run_dir: os.PathLike[str] | str | None = None, worker_rank: str | None = None,
                 experimental_options: dict[str, int | bool | str] | None = None,
                 check_experimental_options: bool = True) -> None:
        super().__init__()
        for name, value, top in (("host_tracer_level", host_tracer_level, 3),
                                 ("device_tracer_level", device_tracer_level, 1),
                                 ("python_tracer_level", python_tracer_level, 1)):
            if not isinstance(value, int) or not 0 <= value <= top:
                raise ValueError(f"TpuProfilerConfig: {name} must be an int in [0, {top}], got {value!r}")
        if worker_rank is not None and (not isinstance(worker_rank, str) or "/" in worker_rank or "\\" in worker_rank):
            raise ValueError(f"TpuProfilerConfig: worker_rank must be a string without path separators, "
                             f"got {worker_rank!r}")
        options = dict(experimental_options or {})
        if check_experimental_options:
            for key, value in options.items():
                if not isinstance(key, str) or ":" in key or "," in key or not isinstance(value, (int, bool, str)):
                    raise ValueError(f"TpuProfilerConfig: experimental option {key!r}: {value!r} must be a key "
                                     "without ':' or ',' and an int, bool or str value")
        self.host_tracer_level, self.device_tracer_level = host_tracer_level, device_tracer_level
        self.python_tracer_level, self.run_dir, self.worker_rank = python_tracer_level, run_dir, worker_rank
        self.experimental_options = options


def _config(prof: _KinetoProfile) -> TpuProfilerConfig | None:
    config = getattr(prof, "experimental_config", None)
    return config if isinstance(config, TpuProfilerConfig) else None


def _start(prof: _KinetoProfile) -> None:
    state = getattr(prof, _STATE, None) or {"events": [], "xspace": None, "dir": None}
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # torch records the Python side
    config = _config(prof)
    if config is not None:
        if not config.device_tracer_level:
            return
        options.host_tracer_level, options.python_tracer_level = config.host_tracer_level, config.python_tracer_level
        if config.experimental_options:
            options.advanced_configuration = config.experimental_options
    trace_dir = tempfile.mkdtemp(prefix="torch_tpu_trace_")
    try:
        jax.profiler.start_trace(trace_dir, profiler_options=options)
    except RuntimeError as e:  # another jax trace is running
        shutil.rmtree(trace_dir, ignore_errors=True)
        warnings.warn(f"torch.profiler: no tpu device trace in this window ({e})", stacklevel=3)
        state["dir"] = None
    else:
        state["dir"] = trace_dir
    setattr(prof, _STATE, state)


def _stop(prof: _KinetoProfile) -> None:
    state = getattr(prof, _STATE, None)
    if not state or state["dir"] is None:
        return
    torch.tpu.synchronize()  # the window's device work is in it
    jax.profiler.stop_trace()
    found = sorted(Path(state["dir"]).rglob("*.xplane.pb"))
    if found:
        if state["xspace"] is not None:  # a later window of a schedule replaces the earlier one
            shutil.rmtree(state["xspace"].parent.parent.parent.parent, ignore_errors=True)
        state["xspace"] = found[-1]
        state["events"] = device_events(found[-1])
        config = _config(prof)
        if config is not None and config.run_dir is not None:
            run = Path(config.run_dir) / "plugins" / "profile" / time.strftime("%Y_%m_%d_%H_%M_%S")
            run.mkdir(parents=True, exist_ok=True)
            host = socket.gethostname() + (f"_{config.worker_rank}" if config.worker_rank else "")
            shutil.copyfile(found[-1], run / f"{host}.xplane.pb")
    else:
        shutil.rmtree(state["dir"], ignore_errors=True)
    state["dir"] = None


def device_xspace(prof: _KinetoProfile) -> Path | None:
    """The XSpace (``.xplane.pb``) jax.profiler wrote for ``prof``'s last recording window."""
    state = getattr(prof, _STATE, None)
    return state["xspace"] if state else None


def device_events(xspace: str | os.PathLike) -> list[dict[str, Any]]:
    """The device events of an XSpace as ``{plane, line, name, start_ns (wall clock), duration_ns,
    args}``: every event of a ``/device:*`` plane (a TPU), and on ``/host:CPU`` the XLA executions
    (events naming an ``hlo_op`` / ``hlo_module``: XLA:CPU runs the device's programs on host threads)."""
    data = jax.profiler.ProfileData.from_file(str(xspace))
    planes = list(data.planes)
    start = next((int(dict(p.stats).get("profile_start_time", 0)) for p in planes
                  if "profile_start_time" in dict(p.stats)), 0)
    events = []
    for plane in planes:
        on_device = plane.name.startswith("/device:")
        if not (on_device or plane.name == "/host:CPU"):
            continue
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if not on_device and not ("hlo_op" in stats or "hlo_module" in stats):
                    continue
                args = {k: v for k, v in stats.items() if not k.startswith("_")}
                events.append({"plane": plane.name, "line": line.name, "name": event.name,
                               "start_ns": start + event.start_ns, "duration_ns": event.duration_ns,
                               "args": args if on_device else {k: args[k] for k in _XLA_STATS if k in args}})
    return events


def _device_label(plane: str) -> str:
    if plane.startswith("/device:"):
        return plane.removeprefix("/device:")
    return f"TPU:0 ({jax.local_devices()[0].platform.upper()} executor threads)"


def merge_into_chrome_trace(path: str | os.PathLike, events: list[dict[str, Any]]) -> None:
    """Add :func:`device_events` to the Chrome trace torch wrote at ``path`` (gzipped when it ends
    in ``.gz``), on its clock."""
    path = str(path)
    opener: Callable[..., Any] = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    base = int(trace.get("baseTimeNanoseconds", 0))
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    added = []
    for event in events:
        plane, line = event["plane"], event["line"]
        if plane not in pids:
            pid = pids[plane] = _DEVICE_PID + len(pids)
            added += [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": _device_label(plane)}},
                      {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0, "args": {"labels": "tpu"}},
                      {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
        if (plane, line) not in tids:
            tid = tids[plane, line] = len(tids) + 1
            added.append({"ph": "M", "name": "thread_name", "pid": pids[plane], "tid": tid, "args": {"name": line}})
        added.append({"ph": "X", "cat": "kernel", "name": event["name"], "pid": pids[plane],
                      "tid": tids[plane, line], "ts": (event["start_ns"] - base) / 1000.0,
                      "dur": event["duration_ns"] / 1000.0, "args": {**event["args"], "device": "tpu:0"}})
    trace.setdefault("traceEvents", []).extend(added)
    with opener(path, "wt") as f:
        json.dump(trace, f)


def tensorboard_trace_handler(dir_name: str | os.PathLike, worker_name: str | None = None) -> Callable[[Any], None]:
    """``on_trace_ready`` handler writing one TensorBoard run per trace: the device XSpace and the
    merged Chrome trace side by side in ``<dir_name>/plugins/profile/<run>/`` (see the module docstring)."""

    def handler(prof: _KinetoProfile) -> None:
        worker = worker_name or f"{socket.gethostname()}_{os.getpid()}"
        run = Path(dir_name) / "plugins" / "profile" / time.strftime("%Y_%m_%d_%H_%M_%S")
        suffix = 0
        while run.with_name(f"{run.name}_{suffix}" if suffix else run.name).exists():
            suffix += 1
        run = run.with_name(f"{run.name}_{suffix}" if suffix else run.name)
        run.mkdir(parents=True)
        xspace = device_xspace(prof)
        if xspace is not None:
            shutil.copyfile(xspace, run / f"{worker}.xplane.pb")
        prof.export_chrome_trace(str(run / f"{worker}.pt.trace.json"))

    return handler


def install() -> None:
    """Hook torch.profiler's recording windows and Chrome export (idempotent)."""
    if _installed:
        return
    start, stop, export = _KinetoProfile.start_trace, _KinetoProfile.stop_trace, _KinetoProfile.export_chrome_trace

    @functools.wraps(start)
    def start_trace(self: _KinetoProfile) -> None:
        start(self)
        if _wants_device(self):
            _start(self)

    @functools.wraps(stop)
    def stop_trace(self: _KinetoProfile) -> None:
        try:
            _stop(self)
        finally:
            stop(self)

    @functools.wraps(export)
    def export_chrome_trace(self: _KinetoProfile, path: str, *args: Any, **kwargs: Any) -> Any:
        out = export(self, path, *args, **kwargs)
        state = getattr(self, _STATE, None)
        if state and state["events"]:
            merge_into_chrome_trace(path, state["events"])
        return out

    _KinetoProfile.start_trace, _KinetoProfile.stop_trace = start_trace, stop_trace
    _KinetoProfile.export_chrome_trace = export_chrome_trace
    _installed.append(True)
