"""The lane scheduler (worker/answer/scheduler.py): classes in order with minimum shares, tenants
by weight, capacity per lane, whole reads on one lane; batches formed through the real Batcher."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

import pytest

from producer.protocol.lanes import Lane
from worker.answer.batcher import Batcher
from worker.answer.scheduler import LaneQueue
from worker.config.settings import SchedulingConfig

HIGH = Lane("t", "high")
LOW = Lane("t", "low")
NORMAL = None  # the shard's default lane, as RawEntry.lane holds it
LOW_A = Lane("t", "low", "a")
LOW_B = Lane("t", "low", "b")


@dataclass
class FakeEntry:
    lane: Lane | None
    id_ms: int = 0  # long before the fake wall clock: no batch waits out a window


@dataclass
class FakeItem:
    entry: FakeEntry
    rows: int = 1
    deliveries: int = 1

    @property
    def alone(self) -> bool:
        return False


def _read(lane: Lane | None, n: int, rows: int = 1) -> list[Any]:
    return [FakeItem(FakeEntry(lane), rows) for _ in range(n)]


def _queue(max_rows: int = 32, per_lane: int = 2, normal: float = 0.1, low: float = 0.05) -> Any:
    return LaneQueue(
        SchedulingConfig(min_share_normal=normal, min_share_low=low), max_rows, per_lane
    )


def _batcher(source: Any, max_rows: int = 32) -> Batcher:
    return Batcher(source, max_rows, 5.0, wall_ms=lambda: 1e12)


def _fill(q: LaneQueue, lane: Lane | None, n: int, rows: int = 1) -> None:
    """Top ``lane`` up to its capacity: a backlog that never runs dry."""
    try:
        while True:
            q.put(_read(lane, n, rows), block=False)
    except queue.Full:
        pass


def _rows_by(batch: list[Any], key: Any) -> dict[Any, int]:
    out: dict[Any, int] = {}
    for item in batch:
        out[key(item.entry.lane)] = out.get(key(item.entry.lane), 0) + item.rows
    return out


def test_a_high_read_put_after_a_low_backlog_comes_out_next() -> None:
    q = _queue()
    q.put(_read(LOW, 32))
    q.put(_read(LOW, 32))
    q.put(_read(HIGH, 1))
    assert [i.entry.lane for i in q.get()] == [HIGH]
    assert {i.entry.lane for i in q.get()} == {LOW}


def test_after_low_ran_alone_a_high_arrival_still_goes_first() -> None:
    # Given low alone for a while: its share of the window is everything, not starved
    q = _queue()
    batcher = _batcher(q)
    for _ in range(40):
        q.put(_read(LOW, 32))
        assert len(batcher.next_batch(1.0)) == 32
    _fill(q, LOW, 32)
    q.put(_read(HIGH, 3))
    assert [i.entry.lane for i in batcher.next_batch(1.0)[:3]] == [HIGH] * 3


@pytest.mark.parametrize("with_normal", [False, True])
def test_lower_classes_get_their_min_share_under_saturating_high_load(with_normal: bool) -> None:
    q = _queue(max_rows=32, normal=0.1, low=0.05)
    batcher = _batcher(q)
    rows = {"high": 0, "normal": 0, "low": 0}
    while sum(rows.values()) < 10_000:
        _fill(q, HIGH, 32)
        _fill(q, LOW, 32)
        if with_normal:
            _fill(q, NORMAL, 32)
        for cls, n in _rows_by(
            batcher.next_batch(1.0), lambda lane: lane.cls if lane else "normal"
        ).items():
            rows[cls] += n
    total = sum(rows.values())
    assert 0.04 <= rows["low"] / total <= 0.06, rows
    if with_normal:
        assert 0.08 <= rows["normal"] / total <= 0.12, rows
    assert rows["high"] / total >= 0.8, rows


@pytest.mark.parametrize("weight_a", [1, 3])
def test_backlogged_tenants_of_one_class_share_rows_by_weight_over_any_100_batches(
    weight_a: int,
) -> None:
    # Given tenant a reading 32 one-row requests at a time and b 8 two-row ones (a plain FIFO
    # would give a two rows for each of b's), b's weight unset (1)
    q = _queue(max_rows=32)
    q.set_weights({"a": weight_a, "c": 5})
    batcher = _batcher(q)
    per_batch: list[dict[Any, int]] = []
    for _ in range(400):
        _fill(q, LOW_A, 32)
        _fill(q, LOW_B, 8, rows=2)
        batch = batcher.next_batch(1.0)
        assert sum(i.rows for i in batch) == 32  # batches stay full
        per_batch.append(_rows_by(batch, lambda lane: lane.tenant))
    # Then every run of 100 batches splits its rows within 10% of the weights
    want_a = weight_a / (weight_a + 1)
    for start in range(len(per_batch) - 100 + 1):
        window = per_batch[start : start + 100]
        a = sum(b.get("a", 0) for b in window)
        b = sum(b.get("b", 0) for b in window)
        assert abs(a / (a + b) - want_a) <= 0.1 * want_a, (start, a, b)
        assert abs(b / (a + b) - (1 - want_a)) <= 0.1 * (1 - want_a), (start, a, b)


def test_a_full_low_lane_blocks_only_its_own_put() -> None:
    q = _queue(per_lane=2, normal=0.0, low=0.0)  # no minimum share: strictly high first
    q.put(_read(LOW, 32))
    q.put(_read(LOW, 32))
    with pytest.raises(queue.Full):
        q.put(_read(LOW, 1), block=False)
    with pytest.raises(queue.Full):
        q.put(_read(LOW, 1), timeout=0.01)
    # When a low reader blocks on its full lane
    put_low = threading.Thread(target=q.put, args=(_read(LOW, 1),), daemon=True)
    put_low.start()
    # Then a high read is still taken at once, and handed out first
    q.put(_read(HIGH, 1), block=False)
    q.put(_read(HIGH, 1), block=False)
    assert put_low.is_alive()
    assert q.get()[0].entry.lane == HIGH
    assert put_low.is_alive()  # a high read leaving frees no low room
    q.get()
    assert q.get()[0].entry.lane == LOW  # a low read leaving does
    put_low.join(timeout=10.0)
    assert not put_low.is_alive()
    assert q.qsize() == 2


def test_one_lane_hands_out_whole_reads_one_get_each() -> None:
    gets = 0

    class Counting(LaneQueue):
        def get(self, block: bool = True, timeout: float | None = None) -> Any:
            nonlocal gets
            gets += 1
            return super().get(block, timeout)

    q = Counting(SchedulingConfig(), 32)
    batcher = _batcher(q)
    for _ in range(50):
        read = _read(LOW_A, 32)
        q.put(read)
        batch = batcher.next_batch(1.0)
        assert list(map(id, batch)) == list(map(id, read))
    assert gets == 50


def test_the_batcher_holds_no_lower_class_leftovers_ahead_of_a_higher_arrival() -> None:
    # Given low reads of 8 two-row requests and batches of 8 rows: half a read fits
    q = _queue(max_rows=8)
    batcher = _batcher(q, max_rows=8)
    q.put(_read(LOW, 8, rows=2))
    q.put(_read(LOW, 8, rows=2))
    first = batcher.next_batch(1.0)
    assert [i.entry.lane for i in first] == [LOW] * 4
    assert not batcher.holding  # the rest went back to its lane
    # When a high request arrives while that batch runs
    q.put(_read(HIGH, 1))
    # Then it leads the very next batch, behind no low leftovers
    second = batcher.next_batch(1.0)
    assert second[0].entry.lane == HIGH
    assert sum(i.rows for i in second) <= 8
    assert sum(i.rows for i in second if i.entry.lane == LOW) <= 8 - 1


def test_get_times_out_empty_and_nothing_is_lost_across_lanes() -> None:
    q = _queue(max_rows=8)
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    sent = [_read(lane, 5, rows) for lane in (HIGH, LOW, LOW_A, LOW_B, NORMAL) for rows in (1, 3)]
    for read in sent:
        q.put(read)
    batcher = _batcher(q, max_rows=8)
    got: list[Any] = []
    while not q.empty():
        got += batcher.next_batch(0.01)
    assert sorted(map(id, got)) == sorted(id(i) for read in sent for i in read)


def test_room_reserved_for_a_read_in_preparation_counts_against_its_lane_only() -> None:
    # Given a low read being preprocessed that holds one of its lane's two places
    q = _queue(per_lane=2)
    low = q.reserve(_read(LOW, 4))
    q.put(_read(LOW, 4))
    with pytest.raises(queue.Full):
        q.reserve(_read(LOW, 1), block=False)
    high = q.reserve(_read(HIGH, 1), block=False)  # another lane's room is its own
    # When the prepared reads come, they queue without waiting, and are handed out in turn
    q.put_reserved(low, _read(LOW, 4))
    q.put_reserved(high, _read(HIGH, 1))
    assert q.qsize() == 3
    assert q.get()[0].entry.lane == HIGH
