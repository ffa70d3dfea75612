"""One ordered worker thread per process group: runs collectives in issue order, off the caller.

Each submission returns a ``torch.futures.Future`` and a c10d ``Work`` built from it, so callers
(DDP's reducer, FSDP2, DTensor) overlap communication with compute exactly as with NCCL. A failed
collective poisons the group: later submissions fail at once with the first error instead of
running on a transport whose peers may be gone.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_c10d import _create_work_from_future

_STOP = object()


class CollectiveError(RuntimeError):
    """A collective failed: a peer exited or stalled past the timeout, or ranks disagreed."""


class OrderedWorker:
    """Runs submitted jobs one at a time on a daemon thread, in submission order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._failure: CollectiveError | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any], describe: Callable[[BaseException], str]) -> Any:
        """Queue ``job``; its return value becomes the Work's result. Returns the c10d Work."""
        future: torch.futures.Future = torch.futures.Future()
        if self._failure is not None:
            future.set_exception(self._failure)
        else:
            self._queue.put((job, describe, future))
        return _create_work_from_future(future)

    def close(self) -> None:
        """Finish queued jobs, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            if threading.current_thread() is not self._thread:
                self._thread.join()

    def _loop(self) -> None:
        # Transports write results into (possibly autograd-tracked) tensors in place.
        torch.set_grad_enabled(False)
        while (item := self._queue.get()) is not _STOP:
            job, describe, future = item
            if self._failure is not None:
                future.set_exception(self._failure)
                continue
            try:
                result = job()
            except Exception as exc:  # noqa: BLE001 -- every failure must reach the waiter
                self._failure = CollectiveError(describe(exc))
                self._failure.__cause__ = exc
                future.set_exception(self._failure)
            else:
                future.set_result(result)
