"""One ordered worker thread per process group: runs collectives in issue order, off the caller.

Each submission returns a :class:`FutureWork` (a c10d ``Work``) over a ``torch.futures.Future``,
so callers (DDP's reducer, FSDP2, DTensor) overlap communication with compute as with NCCL. A failed
collective poisons the group: later submissions fail at once with the first error instead of
running on a transport whose peers may be gone.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_STOP = object()


class CollectiveError(RuntimeError):
    """A collective failed: a peer exited or stalled past the timeout, or ranks disagreed."""


class FutureWork(dist.Work):
    """c10d Work over a future whose ``wait`` raises the collective's error.

    (torch's ``_create_work_from_future`` Work returns True from ``wait()`` even when the future
    failed, so a synchronous collective with a dead peer would silently "succeed".)
    """

    def __init__(self, future: torch.futures.Future, collective: str) -> None:
        super().__init__()
        self._future = future
        self._collective = collective

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout and timeout.total_seconds() > 0 and not self._done_within(timeout):
            raise CollectiveError(
                f"tpu_dist {self._collective}: Work.wait timed out after "
                f"{timeout.total_seconds():g}s"
            )
        self._future.wait()  # raises the collective's CollectiveError
        return True

    def _done_within(self, timeout: datetime.timedelta) -> bool:
        done = threading.Event()
        self._future.add_done_callback(lambda _: done.set())
        return done.wait(timeout.total_seconds())

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except CollectiveError:
            return False
        return True

    def result(self) -> Any:
        return self._future.wait()


class Failure:
    """The first failure of a group's collectives, shared by the workers of its lanes."""

    def __init__(self) -> None:
        self.error: CollectiveError | None = None


class OrderedWorker:
    """Runs submitted jobs one at a time on a daemon thread, in submission order; after a job
    fails (here or on a worker sharing ``failure``) every later one fails with that error."""

    def __init__(self, name: str, failure: Failure | None = None) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._failure = failure or Failure()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, collective: str, job: Callable[[], Any], describe: Callable[[BaseException], str]
    ) -> FutureWork:
        """Queue ``job``; its return value becomes the Work's result."""
        future: torch.futures.Future = torch.futures.Future()
        if self._failure.error is not None:
            future.set_exception(self._failure.error)
        else:
            self._queue.put((job, describe, future))
        return FutureWork(future, collective)

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
            if self._failure.error is not None:
                future.set_exception(self._failure.error)
                continue
            try:
                result = job()
            except Exception as exc:  # noqa: BLE001 -- every failure must reach the waiter
                error = CollectiveError(describe(exc))
                error.__cause__ = exc
                self._failure.error = self._failure.error or error
                future.set_exception(error)
            else:
                future.set_result(result)
