"""Dynamic batching: gather admitted requests until the batch is full or its window closes.

The window is kept on this process's monotonic clock, not on Redis blocking timeouts, which have a
100 ms floor (FACTS.md). It opens when the oldest gathered request was enqueued (its stream id
time), so a request that already waited in the stream does not wait again; with a backlog the
batch fills at once and never waits.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

from worker.intake import WorkItem

__all__ = ["Batcher"]


class Batcher:
    """Takes WorkItems from the intake queue and hands out batches of at most ``max_rows`` rows."""

    def __init__(
        self,
        source: queue.Queue[WorkItem],
        max_rows: int,
        max_wait_ms: float,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], float] = lambda: time.time() * 1000.0,
    ) -> None:
        self.source = source
        self.max_rows = max_rows
        self.max_wait_ms = max_wait_ms
        self.clock = clock
        self.wall_ms = wall_ms
        self._held: WorkItem | None = None

    @property
    def holding(self) -> bool:
        """True while an item that did not fit the last batch waits for the next one."""
        return self._held is not None

    def next_batch(self, timeout_s: float) -> list[WorkItem]:
        """Block up to ``timeout_s`` for a first item, then gather; [] when none came."""
        first = self._take(timeout_s)
        if first is None:
            return []
        batch, rows = [first], first.rows
        deadline = self._deadline(first) if rows else None
        while rows < self.max_rows:
            wait_s = 0.0 if deadline is None else deadline - self.clock()
            item = self._take(wait_s)
            if item is None:
                break
            if rows + item.rows > self.max_rows:
                self._held = item
                break
            batch.append(item)
            rows += item.rows
            if deadline is None and item.rows:
                deadline = self._deadline(item)
        return batch

    def _deadline(self, oldest: WorkItem) -> float:
        """Monotonic time at which the window opened by ``oldest`` closes."""
        age_ms = min(max(self.wall_ms() - oldest.entry.id_ms, 0.0), self.max_wait_ms)
        return self.clock() + (self.max_wait_ms - age_ms) / 1000.0

    def _take(self, timeout_s: float) -> WorkItem | None:
        if self._held is not None:
            item, self._held = self._held, None
            return item
        try:
            if timeout_s <= 0:
                return self.source.get_nowait()
            return self.source.get(timeout=timeout_s)
        except queue.Empty:
            return None
