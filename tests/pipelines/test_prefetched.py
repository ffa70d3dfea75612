"""``pipelines.streams.prefetched``: a consumer that stops early. In lock-step (each item's
production runs collectives with the other ranks) every rank's producer must then stop after the
same item, however far its thread had got: a resumed 2-rank run stalled at its last step when one
rank's producer started an input dist the other rank's never joined."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable, Iterator

import pytest

from pipelines.streams import abandoning, prefetched

DEPTH = 2
TAKEN = 3


class Gated:
    """Items 0, 1, ...; producing each one takes a permit. Counts the items started."""

    def __init__(self, permits: int) -> None:
        self.started = 0
        self.permits = threading.Semaphore(permits)

    def __iter__(self) -> Iterator[int]:
        for index in itertools.count():
            self.started += 1
            self.permits.acquire()
            yield index

    def release_all(self) -> None:
        self.permits.release(1000)


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "the producer never got there"
        time.sleep(0.01)


def _items_started(permits: int, at: int, lockstep: bool, abandon: bool = False) -> int:
    """Take TAKEN items, wait until the producer has started ``at`` items, close the stream
    (the rest of the permits come a second later: a close that waits for more items gets them
    only then); the items started in all."""
    source = Gated(permits)
    stream = prefetched(iter(source), DEPTH, lockstep=lockstep)
    assert [next(stream) for _ in range(TAKEN)] == list(range(TAKEN))
    _until(lambda: source.started == at)
    threading.Timer(1.0, source.release_all).start()
    if abandon:
        with abandoning():
            stream.close()
    else:
        stream.close()
    assert not [t for t in threading.enumerate() if t.name == "prefetch"], "the producer outlived its stream"
    return source.started


# A producer can be at most DEPTH + 1 items past the consumer: DEPTH queued, one in hand.
MOST = TAKEN + DEPTH + 1


@pytest.mark.parametrize("permits, at", [(MOST - 2, MOST - 1), (MOST - 1, MOST), (100, MOST)],
                         ids=["producer-mid-item", "producer-mid-its-last-item", "producer-blocked-on-a-full-queue"])
def test_a_lockstep_close_starts_the_same_items_however_far_the_producer_got(permits, at):
    assert _items_started(permits, at, lockstep=True) == MOST


@pytest.mark.parametrize("lockstep, abandon", [(False, False), (True, True)], ids=["plain", "abandoned"])
def test_a_plain_or_abandoned_close_starts_no_item_after_the_one_in_hand(lockstep, abandon):
    assert _items_started(permits=MOST - 2, at=MOST - 1, lockstep=lockstep, abandon=abandon) == MOST - 1


def test_a_lockstep_close_stops_at_the_end_of_the_items():
    stream = prefetched(iter(range(4)), DEPTH, lockstep=True)
    assert next(stream) == 0
    stream.close()  # fewer items left than DEPTH + 1: the producer ends with them
    assert list(prefetched(iter(range(4)), DEPTH, lockstep=True)) == [0, 1, 2, 3]


def test_producer_errors_reach_the_consumer():
    def failing() -> Iterator[int]:
        yield 1
        raise ValueError("row 7: bad id")

    stream = prefetched(failing(), DEPTH, lockstep=True)
    assert next(stream) == 1
    with pytest.raises(ValueError, match="row 7: bad id"):
        next(stream)
