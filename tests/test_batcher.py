"""The batch window, on a fake clock: rows count, the window opens at enqueue time, none is lost."""

from __future__ import annotations

import queue

import numpy as np
import pytest

from worker.answer.batcher import Batcher
from worker.errors import Rejected
from worker.items import Admitted, Item, Refused
from worker.model.schema import ValidRequest
from worker.redisio.cancels import CancelCheck
from worker.redisio.stream import RawEntry


class FakeTime:
    """A clock the test moves; ``get(timeout)`` on the queue advances it instead of waiting."""

    def __init__(self, wall_ms: float = 1_000_000.0) -> None:
        self.mono = 0.0
        self.wall = wall_ms

    def clock(self) -> float:
        return self.mono

    def wall_ms(self) -> float:
        return self.wall + self.mono * 1000.0


class TimedQueue(queue.Queue):
    """A queue whose blocking get advances the fake clock by the timeout when empty."""

    def __init__(self, time: FakeTime) -> None:
        super().__init__()
        self.time = time

    def put_item(self, item: Item) -> None:
        """Hand one item over, as a read of one entry."""
        self.put([item])

    def get(self, block: bool = True, timeout: float | None = None) -> list[Item]:
        try:
            return super().get(block=False)
        except queue.Empty:
            if block:
                self.time.mono += timeout or 0.0
            raise


def _item(seq: int, rows: int, enqueued_ms: float) -> Admitted:
    entry = RawEntry(f"{int(enqueued_ms)}-{seq}".encode(), {})
    request = ValidRequest({"x": np.zeros((rows, 1))}, rows, ((1,),), ("y",))
    return Admitted(entry, f"r{seq}", request, CancelCheck())


def _rejected(seq: int, enqueued_ms: float) -> Refused:
    entry = RawEntry(f"{int(enqueued_ms)}-{seq}".encode(), {})
    return Refused(entry, f"bad{seq}", Rejected("MALFORMED", "x"))


def _batcher(max_rows: int = 8, max_wait_ms: float = 10.0) -> tuple[Batcher, TimedQueue, FakeTime]:
    t = FakeTime()
    q = TimedQueue(t)
    return Batcher(q, max_rows, max_wait_ms, clock=t.clock, wall_ms=t.wall_ms), q, t


def test_full_batch_closes_at_once_without_waiting() -> None:
    batcher, q, t = _batcher(max_rows=8)
    for i in range(10):
        q.put_item(_item(i, 1, t.wall_ms()))
    batch = batcher.next_batch(1.0)
    assert [b.rid for b in batch] == [f"r{i}" for i in range(8)]
    assert t.mono == 0.0


def test_rows_not_requests_count_and_the_overflow_waits_for_the_next_batch() -> None:
    batcher, q, t = _batcher(max_rows=8)
    for i, rows in enumerate([3, 4, 2, 1]):
        q.put_item(_item(i, rows, t.wall_ms()))
    first = batcher.next_batch(1.0)
    assert [b.rows for b in first] == [3, 4]  # a third item of 2 rows would make 9
    second = batcher.next_batch(1.0)
    assert [b.rows for b in second] == [2, 1]


def test_partial_batch_waits_out_the_window_from_its_enqueue_time() -> None:
    batcher, q, t = _batcher(max_rows=8, max_wait_ms=10.0)
    q.put_item(_item(0, 1, t.wall_ms() - 4.0))  # it already waited 4 ms in the stream
    batch = batcher.next_batch(1.0)
    assert len(batch) == 1
    assert abs(t.mono * 1000.0 - 6.0) < 1e-6  # only the remaining 6 ms were spent


def test_backlogged_request_older_than_the_window_does_not_wait() -> None:
    batcher, q, t = _batcher(max_rows=8, max_wait_ms=10.0)
    q.put_item(_item(0, 1, t.wall_ms() - 500.0))
    batch = batcher.next_batch(1.0)
    assert len(batch) == 1
    assert t.mono == 0.0


def test_rejected_items_ride_along_without_opening_a_window() -> None:
    batcher, q, t = _batcher(max_rows=8, max_wait_ms=10.0)
    q.put_item(_rejected(0, t.wall_ms()))
    q.put_item(_rejected(1, t.wall_ms()))
    batch = batcher.next_batch(1.0)
    assert [b.rid for b in batch] == ["bad0", "bad1"]
    assert t.mono == 0.0


def test_empty_queue_returns_nothing_after_the_timeout() -> None:
    batcher, _, t = _batcher()
    assert batcher.next_batch(0.25) == []
    assert t.mono == 0.25


def test_lone_requests_stop_paying_for_the_window_once_waiting_brings_nothing() -> None:
    # Given one caller that sends the next request only after each answer
    batcher, q, t = _batcher(max_rows=8, max_wait_ms=10.0)
    spent = []
    for i in range(6):
        q.put_item(_item(i, 1, t.wall_ms()))
        before = t.mono
        assert len(batcher.next_batch(1.0)) == 1
        spent.append(round((t.mono - before) * 1000.0, 6))
    # Then the first batches wait out the window, and once waiting has shown no gain, none do
    assert spent[:3] == [10.0, 10.0, 10.0]
    assert spent[3:] == [0.0, 0.0, 0.0]


def test_every_sixteenth_batch_still_waits_to_notice_more_traffic() -> None:
    batcher, q, t = _batcher(max_rows=8, max_wait_ms=10.0)
    waits = 0
    for i in range(3 + 32):
        q.put_item(_item(i, 1, t.wall_ms()))
        before = t.mono
        batcher.next_batch(1.0)
        waits += t.mono > before
    assert waits == 3 + 2  # the three that taught it, then one probe in each 16


def test_fixed_window_when_adaptive_waiting_is_off() -> None:
    t = FakeTime()
    q = TimedQueue(t)
    batcher = Batcher(q, 8, 10.0, clock=t.clock, wall_ms=t.wall_ms, adaptive=False)
    for i in range(6):
        q.put_item(_item(i, 1, t.wall_ms()))
        before = t.mono
        batcher.next_batch(1.0)
        assert round((t.mono - before) * 1000.0, 6) == 10.0


class ScheduledQueue(queue.Queue):
    """Items that arrive at set times on the fake clock; a blocking get advances the clock to
    the next arrival, or by the whole timeout when none comes within it."""

    def __init__(self, time: FakeTime) -> None:
        super().__init__()
        self.time = time
        self.arrivals: list[tuple[float, Item]] = []  # (monotonic time, item), in order

    def get(self, block: bool = True, timeout: float | None = None) -> list[Item]:
        now = self.time.mono
        due = [a for a in self.arrivals if a[0] <= now + 1e-12]
        if not due and block and self.arrivals and self.arrivals[0][0] <= now + (timeout or 0):
            self.time.mono = now = self.arrivals[0][0]
            due = [a for a in self.arrivals if a[0] <= now + 1e-12]
        if not due:
            if block:
                self.time.mono += timeout or 0.0
            raise queue.Empty
        self.arrivals = self.arrivals[len(due) :]
        return [item for _, item in due]


def _burst_rounds(adaptive: bool) -> list[float]:
    """Eight rounds of four closed-loop callers; the ms each round's batch took to close."""
    t = FakeTime()
    q = ScheduledQueue(t)
    batcher = Batcher(q, 32, 10.0, clock=t.clock, wall_ms=t.wall_ms, adaptive=adaptive)
    spent = []
    for round_no in range(8):
        start = t.mono
        for i in range(4):  # four requests 0.1 ms apart, and no fifth
            arrival = start + i * 0.0001
            item = _item(round_no * 4 + i, 1, t.wall + arrival * 1000.0)
            q.arrivals.append((arrival, item))
        assert len(batcher.next_batch(1.0)) == 4
        spent.append((t.mono - start) * 1000.0)
    return spent


def test_a_finished_burst_does_not_wait_out_the_window() -> None:
    """Once a burst's requests are in, its batch closes within a few of the burst's gaps,
    not 10 ms after its first request as a fixed window does."""
    assert _burst_rounds(adaptive=False) == pytest.approx([10.0] * 8)
    spent = _burst_rounds(adaptive=True)
    assert all(ms < 1.0 for ms in spent[4:]), spent  # 0.3 ms of burst, then the patience


def _poisson_mean_batch(adaptive: bool, rate_per_s: float = 1000.0, seconds: float = 3.0) -> float:
    """Mean requests per batch under Poisson arrivals (seeded), the batcher always ready."""
    t = FakeTime()
    q = ScheduledQueue(t)
    rng = np.random.default_rng(7)
    at = 0.0
    while at < seconds:
        at += rng.exponential(1.0 / rate_per_s)
        q.arrivals.append((at, _item(len(q.arrivals), 1, t.wall + at * 1000.0)))
    batcher = Batcher(q, 32, 5.0, clock=t.clock, wall_ms=t.wall_ms, adaptive=adaptive)
    sizes = []
    while q.arrivals or batcher.holding:
        batch = batcher.next_batch(1.0)
        if batch:
            sizes.append(len(batch))
    return sum(sizes) / len(sizes)


def test_poisson_batches_stay_about_as_full_as_a_fixed_windows() -> None:
    """Closing early must not turn steady random traffic into many small batches (more runs,
    more CPU per request): the gap is learnt from waits that brought a request, so it runs low,
    and the patience allows for that."""
    fixed = _poisson_mean_batch(adaptive=False)
    assert fixed > 4.5  # 1 + 5 ms x 1000/s, give or take
    assert _poisson_mean_batch(adaptive=True) >= 0.85 * fixed


class GivingBack(TimedQueue):
    """A source that takes back what did not fit a batch, as the lane scheduler does."""

    def __init__(self, time: FakeTime) -> None:
        super().__init__(time)
        self.returned: list[list[Item]] = []

    def putback(self, items: list[Item]) -> None:
        self.returned.append(items)


def test_leftovers_go_back_to_a_source_that_takes_them_when_the_batch_closes() -> None:
    t = FakeTime()
    q = GivingBack(t)
    batcher = Batcher(q, 8, 10.0, clock=t.clock, wall_ms=t.wall_ms)
    q.put([_item(i, 2, t.wall_ms()) for i in range(6)])  # 12 rows: 8 fit
    batch = batcher.next_batch(1.0)
    assert [b.rid for b in batch] == ["r0", "r1", "r2", "r3"]
    assert [[b.rid for b in back] for back in q.returned] == [["r4", "r5"]]
    assert not batcher.holding
