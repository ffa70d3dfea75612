"""``torch_tpu._internal.profiler``: TorchTPU's profiler entry points over the project's device
traces in ``torch.profiler`` (``torch_tpu.runtime.profiler``).

``profile(activities, on_trace_ready)`` records a ``torch.profiler`` window (``ProfilerActivity.TPU``:
the device trace through jax.profiler; ``CPU``: host events) and writes one TensorBoard run into
the directory ``on_trace_ready(None)`` returns (``xprof_trace_handler(dir)`` returns ``dir``):
``<dir>/plugins/profile/<time>/<host>[_<worker_rank>].xplane.pb`` (XProf) beside the merged
Chrome trace. ``start_server(port)`` / ``stop_server()``: jax.profiler's profiling server (one at a
time). ``register_kineto_backend()``: the device trace hooks (installed by ``import torch_tpu``).
"""

from __future__ import annotations

import contextlib
import enum
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torch_tpu.runtime import profiler as _device_trace
from torch_tpu.runtime._jax import jax
from torch_tpu.runtime.profiler import TpuProfilerConfig

__all__ = ["ProfilerActivity", "TpuProfilerConfig", "profile", "register_kineto_backend", "start_server",
           "stop_server", "xprof_trace_handler"]


class ProfilerActivity(enum.Enum):
    """What :func:`profile` records: host (``CPU``) and device (``TPU``) activity; ``GPU`` is refused."""

    CPU = 1
    TPU = 2
    GPU = 3


def xprof_trace_handler(dir_name: os.PathLike[str] | str, worker_rank: str | None = None) -> Callable[[Any], str]:
    """The ``on_trace_ready`` of :func:`profile`: the trace goes to ``dir_name`` (file names end in
    ``_<worker_rank>`` when given)."""
    if worker_rank is not None and ("/" in worker_rank or "\\" in worker_rank):
        raise ValueError(f"xprof_trace_handler: worker_rank cannot contain path separators: {worker_rank}")

    def handler(prof: Any) -> str:
        return str(dir_name)

    handler.worker_rank = worker_rank  # type: ignore[attr-defined]
    return handler


_TORCH_ACTIVITIES = {ProfilerActivity.CPU: torch.profiler.ProfilerActivity.CPU,
                     ProfilerActivity.TPU: torch.profiler.ProfilerActivity.PrivateUse1}


@contextlib.contextmanager
def profile(activities: list[ProfilerActivity] | None = None,
            on_trace_ready: Callable[[Any], str] | None = None) -> Iterator[None]:
    """Record the block (default activities: CPU and TPU) into the run directory
    ``on_trace_ready(None)`` names (module docstring)."""
    if not on_trace_ready:
        raise ValueError("on_trace_ready must be provided for profiler.profile.")
    activities = [ProfilerActivity.CPU, ProfilerActivity.TPU] if activities is None else list(activities)
    if ProfilerActivity.GPU in activities:
        raise ValueError("GPU profiling is not supported.")
    log_dir = on_trace_ready(None)
    rank = getattr(on_trace_ready, "worker_rank", None)
    worker = socket.gethostname() + (f"_{rank}" if rank else "")
    handler = _device_trace.tensorboard_trace_handler(log_dir, worker_name=worker)
    with torch.profiler.profile(activities=[_TORCH_ACTIVITIES[a] for a in activities], on_trace_ready=handler):
        yield None


def register_kineto_backend() -> None:
    """Install the device-trace hooks of ``torch.profiler`` (idempotent; ``import torch_tpu`` did)."""
    _device_trace.install()


_server: list[int] = []


def start_server(port: int) -> int:
    """Start jax.profiler's server on ``port`` (XProf/TensorBoard capture); returns the port."""
    if _server:
        raise ValueError("Only one profiler server can be active at a time.")
    jax.profiler.start_server(port)
    _server.append(port)
    return port


def stop_server() -> None:
    """Stop the server :func:`start_server` started."""
    if not _server:
        raise ValueError("No active profiler server.")
    _server.clear()
    jax.profiler.stop_server()
