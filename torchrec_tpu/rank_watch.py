"""Names what a failed collective waited for: the collective, and the rank that never joined it.

gloo reports a stalled peer as "Timed out waiting 10000ms for recv operation" and a dead one as
"Connection closed by peer", naming neither the collective nor the rank. While training runs on
several ranks, :class:`RankWatch` has every rank bump a heartbeat counter in the process group's
store once a second (a daemon thread; a stopped or dead rank stops bumping it), and a rank that
fails posts its error line there before it exits. Code running collectives labels them with
:func:`collectives`; a failed collective inside becomes a :class:`~torchrec_tpu.errors.CollectiveError`:

    train step 18 (embedding all_to_all, DDP gradient all_reduce) timed out after 10 s: rank 1
    is not responding (no heartbeat for 3 s: stalled or dead)

A wait no timeout bounds (a compiled step whose XLA collectives wait for a stopped peer: the
host blocks inside XLA reading its loss) is caught by the heartbeats themselves: a neighbour rank
silent for the collective timeout is reported by the handler :func:`on_stall` registers (the
CLI's one error line, then the rank exits), with the label entered last of those another thread
(the prefetch thread) is inside and the main thread's last one (whose results it may be reading).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from typing import Callable, Iterator

import torch.distributed as dist

from torchrec_tpu.errors import CollectiveError

_HEARTBEAT = "torchrec_tpu/heartbeat/{}"
_FAILED = "torchrec_tpu/failed/{}"
_DONE = "done"  # the heartbeat of a rank that left the watch normally
HEARTBEAT_S = 1.0
_SILENT_S = 3.0  # no heartbeat for this long: the rank is not responding
_active: "RankWatch | None" = None
_stall_handler: Callable[[CollectiveError], None] | None = None
_entries = itertools.count()
_inside: dict[int, list[tuple[int, str]]] = {}  # per thread: the labels it is inside, (entry number, label)
_main_last = (-1, "the run")  # the label the main thread entered last


def is_peer_failure(error: BaseException) -> bool:
    """A collective (tpu_dist's, or gloo's) that timed out or lost its peer."""
    text = str(error)
    return isinstance(error, RuntimeError) and not isinstance(error, CollectiveError) and (
        text.startswith("tpu_dist ") or "gloo" in text or "Timed out waiting" in text
        or "Connection closed by peer" in text)


class RankWatch:
    """Heartbeats of this rank into ``store``, and the explanation of a failed collective."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self._stop = threading.Event()
        self._beats = 0
        self._thread = threading.Thread(target=self._beat, name="rank-heartbeat", daemon=True)

    def start(self) -> "RankWatch":
        self._post(_HEARTBEAT.format(self.rank), "0")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def finished(self) -> None:
        """This rank leaves normally: its silence from now on is no stall."""
        self.stop()
        self._post(_HEARTBEAT.format(self.rank), _DONE)

    def _post(self, key: str, value: str) -> bool:
        try:
            self.store.set(key, value)
            return True
        except Exception:  # noqa: BLE001  the store is gone: nothing left to tell
            return False

    def _beat(self) -> None:
        # the ranks before and after this one: a stalled rank is reported by its neighbours, at
        # a cost per rank that does not grow with the world
        watched = sorted({(self.rank - 1) % self.world_size, (self.rank + 1) % self.world_size} - {self.rank})
        last_change = {r: (self._read(_HEARTBEAT.format(r)), time.monotonic()) for r in watched}
        while not self._stop.wait(HEARTBEAT_S):
            self._beats += 1
            if not self._post(_HEARTBEAT.format(self.rank), str(self._beats)):
                return
            stalled = self._silent(last_change)
            if stalled and _stall_handler is not None and not self._stop.is_set():
                _stall_handler(self._stall_error(stalled))
                return

    def _silent(self, last_change: dict[int, tuple[str | None, float]]) -> dict[int, float]:
        """The watched ranks whose heartbeat has not changed for the collective timeout (seconds
        silent); ``last_change`` is updated."""
        now, silent = time.monotonic(), {}
        for r, (value, since) in last_change.items():
            current = self._read(_HEARTBEAT.format(r))
            if current != value:
                last_change[r] = (current, now)
            elif current != _DONE and now - since >= self.timeout_s:
                silent[r] = now - since
        return silent

    def _stall_error(self, silent: dict[int, float]) -> CollectiveError:
        parts = []
        for r, seconds in sorted(silent.items()):
            failed = self._read(_FAILED.format(r))
            parts.append(f"rank {r} failed: {failed}" if failed is not None else
                         f"rank {r} is not responding (no heartbeat for {seconds:.0f} s: stalled or dead)")
        return CollectiveError(f"{_stalled_label()} timed out after {self.timeout_s:g} s on rank {self.rank}: "
                               + "; ".join(parts))

    def post_failure(self, message: str) -> None:
        """Tell the other ranks why this rank is leaving (read by their :meth:`explain`)."""
        self._post(_FAILED.format(self.rank), message)

    def _read(self, key: str) -> str | None:
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:  # noqa: BLE001
            return None

    def explain(self, label: str, error: BaseException) -> CollectiveError:
        """Which ranks failed (their posted error) or stopped responding (heartbeat unchanged for
        :data:`_SILENT_S`), in one message naming ``label``."""
        others = [r for r in range(self.world_size) if r != self.rank]
        failed = {r: m for r in others if (m := self._read(_FAILED.format(r))) is not None}
        before = {r: self._read(_HEARTBEAT.format(r)) for r in others if r not in failed}
        time.sleep(_SILENT_S)
        failed.update({r: m for r in before if (m := self._read(_FAILED.format(r))) is not None})
        silent = [r for r in before if r not in failed and self._read(_HEARTBEAT.format(r)) == before[r]]
        what = "timed out" if "Timed out" in str(error) or "did not finish within" in str(error) else "failed"
        parts = [f"rank {r} failed: {m}" for r, m in sorted(failed.items())]
        if silent:
            ranks = ", ".join(map(str, silent))
            parts.append(f"rank{'s' if len(silent) > 1 else ''} {ranks} "
                         f"{'are' if len(silent) > 1 else 'is'} not responding (no heartbeat for "
                         f"{_SILENT_S:.0f} s: stalled or dead)")
        if not parts:
            parts.append(f"every rank is alive; {' '.join(str(error).split())[:300]}")
        after = f" after {self.timeout_s:g} s" if what == "timed out" else ""
        return CollectiveError(f"{label} {what}{after} on rank {self.rank}: " + "; ".join(parts))


@contextlib.contextmanager
def watching(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> Iterator[RankWatch]:
    """A started :class:`RankWatch` for the ``with`` body (the one :func:`collectives` uses)."""
    global _active
    watch = RankWatch(store, rank, world_size, timeout_s).start()
    _active = watch
    try:
        yield watch
        watch.finished()
    finally:
        _active = None
        watch.stop()


def on_stall(handler: Callable[[CollectiveError], None] | None) -> None:
    """Have ``handler`` (on the heartbeat thread) told of a neighbour rank silent for the
    collective timeout; it should report the error and end the process (the main thread may be
    blocked for good). None: no handler."""
    global _stall_handler
    _stall_handler = handler


@contextlib.contextmanager
def collectives(label: str) -> Iterator[None]:
    """Label the collectives of the ``with`` body: a peer failure inside is re-raised as a
    CollectiveError naming ``label`` and the ranks to blame (when a watch runs)."""
    global _main_last
    entry = (next(_entries), label)
    if threading.current_thread() is threading.main_thread():
        _main_last = entry
    else:
        _inside.setdefault(threading.get_ident(), []).append(entry)
    try:
        yield
    except RuntimeError as error:
        if _active is None or not is_peer_failure(error):
            raise
        raise _active.explain(label, error) from error
    finally:
        if threading.current_thread() is not threading.main_thread():
            _inside[threading.get_ident()].pop()


def _stalled_label() -> str:
    """What a stall holds up: the label entered last among those another thread is inside and the
    main thread's last (a host read after a step waits for that step's collectives)."""
    inside = [list(stack) for stack in list(_inside.values())]  # copies: the threads go on
    return max([_main_last, *(stack[-1] for stack in inside if stack)])[1]
