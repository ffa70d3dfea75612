"""One ordered worker thread per process group: runs collectives in issue order, off the caller.

Each submission returns a :class:`FutureWork` (a c10d ``Work``) over a ``torch.futures.Future``,
so callers (DDP's reducer, FSDP2, DTensor) overlap communication with compute as with NCCL. A failed
collective poisons the group: later submissions fail at once with the first error instead of
running on a transport whose peers may be gone. A worker given a ``deadline`` fails the running
job's Work when it runs past it (for transports whose calls can block forever, such as an XLA
collective whose peer stalled): a watchdog thread checks the job it runs in place, so a call costs
no extra thread hop.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_STOP = object()


class CollectiveError(RuntimeError):
    """A collective failed: a peer exited or stalled past the timeout, or ranks disagreed."""


class RefusedError(ValueError):
    """A job refused its input after an exchange that kept the ranks in step (a receive buffer
    unlike the message sent): its Work fails with this one line, the group stays usable."""


class FutureWork(dist.Work):
    """c10d Work over a future whose ``wait`` raises the collective's error.

    (torch's ``_create_work_from_future`` Work returns True from ``wait()`` even when the future
    failed, so a synchronous collective with a dead peer would silently "succeed".)
    """

    def __init__(self, future: torch.futures.Future, collective: str) -> None:
        super().__init__()
        self._future = future
        self._collective = collective
        self._c10d_future: torch.futures.Future | None = None

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
        """The collective's future as C++ reads it (DDP's reducer): a failure is a C++ error.

        ``Future.set_exception`` stores the error as the future's *value* (Python unwraps it on
        ``wait``); C++ sees a success holding an exception object, and DDP's reducer took it for
        its tensor list and crashed (SIGSEGV). The future chained by ``then`` fails in C++.
        """
        if self._c10d_future is None:
            self._c10d_future = self._future.then(_value)
        return self._c10d_future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except (CollectiveError, RefusedError):
            return False
        return True

    def result(self) -> Any:
        return self._future.wait()


def _value(future: torch.futures.Future) -> Any:
    return future.value()  # raises the collective's error


class Failure:
    """The first failure of a group's collectives, shared by the workers of its lanes."""

    def __init__(self) -> None:
        self.error: CollectiveError | None = None


@dataclass(frozen=True)
class Deadline:
    """At most ``timeout`` per job; a job past it fails with "``what`` did not finish within ..."."""

    timeout: datetime.timedelta
    what: str


@dataclass
class _Running:
    started: float
    future: torch.futures.Future
    describe: Callable[[BaseException], str]


class OrderedWorker:
    """Runs submitted jobs one at a time on a daemon thread, in submission order; after a job
    fails (here or on a worker sharing ``failure``) every later one fails with that error. With a
    ``deadline``, a job still running past it fails its Work and the group; the stuck thread is
    abandoned."""

    def __init__(self, name: str, failure: Failure | None = None, deadline: Deadline | None = None) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._failure = failure or Failure()
        self._deadline = deadline
        self._lock = threading.Lock()
        self._running: _Running | None = None
        self._closed = threading.Event()
        self._abandoned = False  # the thread is stuck in a job the watchdog failed
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        if deadline is not None:
            threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True).start()

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
        """Finish queued jobs, then stop the thread (one stuck past the deadline is left behind)."""
        self._closed.set()
        if self._thread.is_alive():
            self._queue.put(_STOP)
            if threading.current_thread() is not self._thread and not self._abandoned:
                self._thread.join()

    def _fail(self, future: torch.futures.Future, describe: Callable[[BaseException], str],
              exc: BaseException) -> None:
        error = CollectiveError(describe(exc))
        error.__cause__ = exc
        self._failure.error = self._failure.error or error
        future.set_exception(error)

    def _watch(self) -> None:
        assert self._deadline is not None
        limit = self._deadline.timeout.total_seconds()
        # a 1 Hz check at most: a hang is reported within the timeout plus one period
        while not self._closed.wait(min(max(limit / 20, 0.05), 1.0)):
            with self._lock:
                running = self._running
                if running is None or time.monotonic() - running.started < limit:
                    continue
                self._running = None  # the job's own completion, if it ever comes, is dropped
                self._abandoned = True
            self._fail(running.future, running.describe,
                       TimeoutError(f"{self._deadline.what} did not finish within {limit:g}s"))
            return

    def _loop(self) -> None:
        # Transports write results into (possibly autograd-tracked) tensors in place.
        torch.set_grad_enabled(False)
        while (item := self._queue.get()) is not _STOP:
            job, describe, future = item
            if self._failure.error is not None:
                future.set_exception(self._failure.error)
                continue
            with self._lock:
                self._running = _Running(time.monotonic(), future, describe)
            try:
                result, failed = job(), None
            except Exception as exc:  # noqa: BLE001 -- every failure must reach the waiter
                result, failed = None, exc
            with self._lock:
                timed_out = self._running is None
                self._running = None
            if timed_out:
                continue
            if isinstance(failed, RefusedError):
                future.set_exception(failed)
            elif failed is not None:
                self._fail(future, describe, failed)
            else:
                future.set_result(result)
