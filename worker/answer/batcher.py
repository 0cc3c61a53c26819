"""Dynamic batching: gather admitted requests until the batch is full or its window closes.

The window is kept on this process's monotonic clock, not on Redis blocking timeouts, which have
a 100 ms floor (shared/FACTS.md). It opens when the oldest gathered request was enqueued (its
stream id time), so a request that already waited in the stream does not wait again; with a
backlog the batch fills at once and never waits.

Waiting is adaptive, in two ways:

- The batcher keeps an average of how many requests arrived while a batch waited. When waiting
  stops paying (a trickle, or one caller waiting on each answer before it sends the next) it
  closes batches at once, so a lone request costs the model's own time, not the window; every
  16th batch still waits, to notice when traffic picks up.
- While a batch waits, it waits for the next request only about five typical gaps between
  arrivals (learnt from the requests that did arrive during waits), not to the window's end: a
  burst that has ended (C callers who each sent their one request) closes its batch soon after
  its last request rather than waiting out the window for requests that are not coming.

A redelivered request (one a worker may have died on) always runs in a batch of its own. With
``split``, a request of a lower class than the batch holds that does not fit fills the batch with
its first rows, and the rest is first in line for the next batch (``worker.answer.parts``).

With lanes (``worker.answer.scheduler.LaneQueue``, which has ``putback``) the batcher holds
nothing between batches: what it took and did not fit the batch it formed goes back to its lane
when the batch closes, so that a higher class that arrives meanwhile is first in the next batch
rather than behind a batch of leftovers. With a plain queue it keeps them for the next batch.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from worker.answer.parts import class_of, split
from worker.events import NO_EVENTS, Events
from worker.items import Item

__all__ = ["Batcher", "Source"]

_GAIN_WEIGHT = 0.25  # weight of the newest batch in the moving average
_MIN_GAIN = 0.5  # below this many requests gained per wait, waiting is not worth it
_PROBE_EVERY = 16
_GAP_WEIGHT = 0.25  # weight of the newest gap between arrivals during a wait
# A waiting batch gives up after this many typical gaps without an arrival. The typical gap is
# learnt only from waits that brought a request, so it runs low (about half the true mean gap
# under Poisson arrivals); five of them keep Poisson batches as full as a fixed window's.
_PATIENCE_GAPS = 5.0
_MIN_PATIENCE_S = 0.0005  # a read, a cancel check and a thread hand-off on a busy small box


class Source(Protocol):
    """Where reads come from: a ``queue.Queue[list[Item]]`` or a ``LaneQueue``."""

    def get(self, block: bool = ..., timeout: float | None = ...) -> list[Item]: ...

    def get_nowait(self) -> list[Item]: ...


class Batcher:
    """Takes items from the reading thread's queue; hands out batches of at most ``max_rows``
    rows.

    Items come a read at a time (a list per XREADGROUP), which keeps the lock and thread
    hand-offs per batch rather than per request.
    """

    def __init__(
        self,
        source: Source,
        max_rows: int,
        max_wait_ms: float,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], float] = lambda: time.time() * 1000.0,
        adaptive: bool = True,
        split: bool = False,
        events: Events = NO_EVENTS,
    ) -> None:
        self.source = source
        self.split = split  # requests' rows may be split across batches (worker/answer/parts.py)
        self.splits = 0  # requests split so far
        self.events = events
        self.max_rows = max_rows
        self.max_wait_ms = max_wait_ms
        self.clock = clock
        self.wall_ms = wall_ms
        self.adaptive = adaptive
        self._buffer: deque[Item] = deque()
        # The source takes back what did not fit a batch (LaneQueue); None: keep it here.
        self._putback: Callable[[list[Item]], None] | None = getattr(source, "putback", None)
        self._gain = 1.0  # moving average of requests gained per batch that waited
        self._skips = 0
        # Moving average of the wait before a request arrived; it starts at the window over
        # _PATIENCE_GAPS, so that the first batches wait out the window as a fixed one would.
        self._gap_s = max_wait_ms / 1000.0 / _PATIENCE_GAPS

    @property
    def holding(self) -> bool:
        """True while items taken from the queue wait for a batch."""
        return bool(self._buffer)

    def next_batch(self, timeout_s: float) -> list[Item]:
        """Block up to ``timeout_s`` for a first item, then gather; [] when none came."""
        batch = self._gather(timeout_s)
        if self._buffer and self._putback is not None:
            self._putback(list(self._buffer))  # to the source, where classes are ordered
            self._buffer.clear()
        return batch

    def _gather(self, timeout_s: float) -> list[Item]:
        first = self._take(timeout_s)
        if first is None:
            return []
        if first.alone:
            return [first]
        batch, rows = [first], first.rows
        deadline = self._deadline(first) if rows else None
        waited, gained = False, 0
        while rows < self.max_rows:
            item = self._take(0.0)
            if item is None:
                wait_s = 0.0 if deadline is None else deadline - self.clock()
                if wait_s <= 0 or not self._worth_waiting():
                    break
                waited = True
                item = self._take_within(wait_s)
                if item is None:
                    break
                gained += 1
            if item.alone or rows + item.rows > self.max_rows:
                parts = split(batch, item, self.max_rows - rows) if self.split else None
                if parts is not None:  # a lower class's rows fill the room behind a higher one
                    batch.append(parts[0])
                    item = parts[1]
                    self.splits += 1
                    self.events.split(class_of(item))
                self._buffer.appendleft(item)  # first in line for the next batch
                break
            batch.append(item)
            rows += item.rows
            if deadline is None and item.rows:
                deadline = self._deadline(item)
        if waited:
            self._gain += _GAIN_WEIGHT * (gained - self._gain)
        return batch

    def _worth_waiting(self) -> bool:
        """Wait while waiting has been bringing requests; otherwise probe now and then."""
        if not self.adaptive or self._gain >= _MIN_GAIN:
            return True
        self._skips += 1
        if self._skips >= _PROBE_EVERY:
            self._skips = 0
            return True
        return False

    def _take_within(self, wait_s: float) -> Item | None:
        """Wait for the next item up to ``wait_s``, or less when arrivals have stopped."""
        if not self.adaptive:
            return self._take(wait_s)
        patience = max(_PATIENCE_GAPS * self._gap_s, _MIN_PATIENCE_S)
        started = self.clock()
        item = self._take(min(wait_s, patience))
        if item is not None:
            self._gap_s += _GAP_WEIGHT * ((self.clock() - started) - self._gap_s)
        return item

    def _deadline(self, oldest: Item) -> float:
        """Monotonic time at which the window opened by ``oldest`` closes."""
        age_ms = min(max(self.wall_ms() - oldest.entry.id_ms, 0.0), self.max_wait_ms)
        return self.clock() + (self.max_wait_ms - age_ms) / 1000.0

    def _take(self, timeout_s: float) -> Item | None:
        if not self._buffer:
            try:
                if timeout_s <= 0:
                    self._buffer.extend(self.source.get_nowait())
                else:
                    self._buffer.extend(self.source.get(timeout=timeout_s))
            except queue.Empty:
                return None
        return self._buffer.popleft() if self._buffer else None
