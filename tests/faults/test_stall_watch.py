"""The heartbeat watch reports a neighbour rank silent for the collective timeout by itself (the
main thread may be blocked inside XLA for good, reading a step whose collectives wait for that
rank): two watches in one process over one store, rank 0's heartbeats stopped."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch.distributed as dist

from torchrec_tpu import rank_watch
from torchrec_tpu.errors import CollectiveError

TIMEOUT_S = 1.5


@pytest.fixture
def reported():
    """The errors the stall handler was given, and an event set on the first."""
    errors: list[CollectiveError] = []
    came = threading.Event()

    def handler(error: CollectiveError) -> None:
        errors.append(error)
        came.set()

    rank_watch.on_stall(handler)
    yield errors, came
    rank_watch.on_stall(None)


def _watches(store: dist.Store) -> tuple[rank_watch.RankWatch, rank_watch.RankWatch]:
    return (rank_watch.RankWatch(store, 0, 2, TIMEOUT_S).start(),
            rank_watch.RankWatch(store, 1, 2, TIMEOUT_S).start())


def test_a_silent_neighbour_is_reported_with_the_main_threads_last_label(reported) -> None:
    errors, came = reported
    with rank_watch.collectives("train step 7 (embedding all_to_all, dense gradient all_reduce)"):
        pass  # the label stays the main thread's last, as a host read after the step waits for it
    stalled, survivor = _watches(dist.HashStore())
    stalled.stop()  # as SIGSTOP: no more heartbeats, nothing posted
    started = time.monotonic()
    try:
        assert came.wait(TIMEOUT_S + 5), "the stall was never reported"
    finally:
        survivor.stop()
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 3
    assert len(errors) == 1
    assert re.fullmatch(r"train step 7 \(embedding all_to_all, dense gradient all_reduce\) timed out after 1\.5 s "
                        r"on rank 1: rank 0 is not responding \(no heartbeat for [23] s: stalled or dead\)",
                        str(errors[0])), errors


def test_a_label_another_thread_entered_later_is_named(reported) -> None:
    """After an evaluation the main thread waits for the prefetch thread, which waits in the next
    batch's input all_to_all: that one is named, not the evaluation."""
    errors, came = reported
    with rank_watch.collectives("the evaluation at step 12 (embedding all_to_all, metric all_gather)"):
        pass
    released = threading.Event()

    def prefetch() -> None:
        with rank_watch.collectives("the sparse input all_to_all of a prefetched batch (its ids)"):
            released.wait()

    thread = threading.Thread(target=prefetch)
    thread.start()
    stalled, survivor = _watches(dist.HashStore())
    stalled.stop()
    try:
        assert came.wait(TIMEOUT_S + 5)
    finally:
        survivor.stop()
        released.set()
        thread.join()
    assert str(errors[0]).startswith("the sparse input all_to_all of a prefetched batch (its ids) timed out after "
                                     "1.5 s on rank 1: rank 0 is not responding"), errors


def test_a_neighbour_that_failed_is_named_with_its_error(reported) -> None:
    errors, came = reported
    stalled, survivor = _watches(dist.HashStore())
    stalled.post_failure("bad row 70")
    stalled.stop()
    try:
        assert came.wait(TIMEOUT_S + 5)
    finally:
        survivor.stop()
    assert str(errors[0]).endswith("timed out after 1.5 s on rank 1: rank 0 failed: bad row 70")


@pytest.mark.parametrize("neighbour", ["beating", "finished"])
def test_a_beating_or_finished_neighbour_is_no_stall(reported, neighbour) -> None:
    errors, came = reported
    other, watch = _watches(dist.HashStore())
    if neighbour == "finished":
        other.finished()
    try:
        assert not came.wait(TIMEOUT_S + 2), errors
    finally:
        other.stop()
        watch.stop()
