"""tpu backward in a process whose autograd engine started before the tpu device registered.

The engine sizes its per-device worker queues once, on the first ``backward()`` of the process,
from the device count of every device guard registered at that moment. A CPU backward run before
``import torch_tpu`` fixes that count at 0 for tpu, and every later tpu backward fails the engine's
``device_ready_queues_`` assert (engine.cpp). PyTorch cannot resize the pool, but a backward run
with autograd multithreading disabled never uses it: its device nodes run on the calling thread,
as CPU nodes always do.

:func:`install` asks the engine itself: one backward of an empty, dataless tpu tensor (no device
work, about 5 ms). When it fails, every ``torch.autograd.backward`` / ``grad`` of the process runs
with multithreading disabled; otherwise nothing changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.graph


class _Probe(torch.Tensor):
    """An empty tpu tensor without data: enough for the engine to pick the tpu queue."""

    @staticmethod
    def __new__(cls) -> _Probe:
        return torch.Tensor._make_wrapper_subclass(cls, (0,), device=torch.device("tpu", 0))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # the probe's backward runs no op; were one added, an exception here (maybe on an engine
        # thread) would abort the process: answer with another empty probe
        return _Probe()


def engine_serves_tpu() -> bool:
    """Whether the autograd engine has a worker queue for the tpu device (False: it started
    before the device registered)."""
    leaf = _Probe().requires_grad_()
    try:
        torch.autograd.Variable._execution_engine.run_backward(
            (leaf,), (_Probe(),), False, False, (leaf,), False, False)
    except RuntimeError as e:
        if "device_ready_queues_" in str(e):
            return False
        raise
    return True


def _on_calling_thread(run: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(run)
    def run_backward(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.set_multithreading_enabled(False):
            return run(*args, **kwargs)

    run_backward._tpu_on_calling_thread = True  # type: ignore[attr-defined]
    return run_backward


def install() -> None:
    """Run every backward on its calling thread when the engine started without a tpu queue
    (idempotent; call after the device guard is registered)."""
    current = torch.autograd.graph._engine_run_backward
    if getattr(current, "_tpu_on_calling_thread", False) or engine_serves_tpu():
        return
    wrapped = _on_calling_thread(current)
    torch.autograd.graph._engine_run_backward = wrapped
    torch.autograd._engine_run_backward = wrapped
