"""One inference at a time per device, with turns given by class, then in arrival order.

A worker serving several models runs each model's path on a thread of its own, so one model's
reading, batching, pre- and post-processing overlap another's run; only the runs themselves
take turns here. A turn goes to the waiting batch of the highest class (0: high), and among
batches of one class to the one that asked first. Each model asks for one turn at a time (its
path is one thread), so a batch waits behind at most the run in progress and one batch of each
other model of its class or higher, whatever their backlogs (contract section 8).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = ["Device", "Turned"]


class Device:
    """The turns of one device's runs (a GPU, or the CPU the sessions share)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._waiting: list[tuple[int, int]] = []  # (class rank, ticket), a heap
        self._tickets = itertools.count()
        self._busy = False

    @contextmanager
    def turn(self, rank: int) -> Iterator[None]:
        """Hold the device for one run of a batch whose highest class has ``rank``."""
        self.acquire(lambda: rank)
        try:
            yield
        finally:
            self.release()

    def acquire(self, rank: Callable[[], int]) -> None:
        """Wait for a turn; ``rank()`` (the batch's highest class) is asked only when another
        run holds the device or waits: alone, a turn costs a lock and a flag."""
        with self._cond:
            if not self._busy and not self._waiting:
                self._busy = True
                return
            ticket = (rank(), next(self._tickets))
            heapq.heappush(self._waiting, ticket)
            while self._busy or self._waiting[0] != ticket:
                self._cond.wait()
            heapq.heappop(self._waiting)
            self._busy = True

    def release(self) -> None:
        with self._cond:
            self._busy = False
            if self._waiting:
                self._cond.notify_all()

    @property
    def waiting(self) -> int:
        """Runs waiting for a turn now."""
        with self._cond:
            return len(self._waiting)


class Turned:
    """A session whose runs take turns on ``device`` (class normal): warmup runs, and the
    shrinking run after them, of a model loaded while others serve."""

    def __init__(self, session: Any, device: Device) -> None:
        self.session = session
        self.inputs = session.inputs
        self.outputs = session.outputs
        self._device = device

    def run(self, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        with self._device.turn(1):
            return list(self.session.run(feeds, output_names))
