"""The reply writer: finishes batches in Redis on its own thread, or on the caller's.

Writing a batch's replies is one round trip that mostly waits on Redis; on this thread it
overlaps with the next batch's inference instead of delaying it. The queue holds at most two
batches, so a slow Redis slows the worker down rather than letting answers pile up in memory.

When no batch waits to run, there is nothing to overlap with, and handing the write to this
thread only adds a wake-up and a turn of the GIL to the batch's path: with a small model, most
of the path. The caller then writes the batch itself (``submit(batch, here=True)``).

A batch of only error replies waits while Redis memory is past a ceiling over ``maxmemory``
(``worker.answer.pressure``), so that a flood of malformed requests cannot inflate a full Redis;
it is written on this thread, so that the serving thread goes on meanwhile.

A written batch is the end of the worker's path: its leases are released (``Finisher``), the
metrics told (``Events.batch_done``) and what was served counted in the worker's record.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from worker.answer.finisher import Finisher
from worker.answer.pressure import MemoryPressure
from worker.errors import WorkerError
from worker.events import NO_EVENTS, Events
from worker.redisio.retry import OutageRetry
from worker.redisio.stream import Finish

__all__ = ["Batch", "ReplyWriter"]

log = logging.getLogger(__name__)

_TYPICAL_WEIGHT = 0.25  # weight of the newest write in ``typical_s``


class Record(Protocol):
    """Where the count of what was served goes: the worker's record (worker/ops/record.py)."""

    def update(self, **changes: Any) -> None: ...


@dataclass(slots=True)
class Batch:
    """A batch's finish steps, with what metrics want to know once it is written."""

    finishes: Sequence[Finish]
    queued_s: list[float] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)  # each request's class, beside queued_s
    decode_s: list[float] = field(default_factory=list)
    runs: list[tuple[int, float]] = field(default_factory=list)
    # once written: per finish, whether it was finished here (its reply written, its entry
    # acked) rather than left to the consumer that holds it now
    finished: list[bool] = field(default_factory=list)


class ReplyWriter(threading.Thread):
    """Takes finished batches and writes them, retrying through Redis outages.

    Each batch, once in Redis, is counted in ``served`` (and the ``record``) on the thread that
    wrote it; a write that fails for good sets ``stop``, and the batches not written stay
    pending. ``give_up`` ends the retries of an outage: set by a stop signal that found the
    worker making no progress for a few seconds (``worker.ops.progress``), or by a second one.
    """

    def __init__(
        self,
        finisher: Finisher,
        give_up: threading.Event,
        stop: threading.Event,
        depth: int = 2,
        events: Events = NO_EVENTS,
        on_retry: Callable[[BaseException], object] | None = None,
        record: Record | None = None,
        pressure: MemoryPressure | None = None,
    ) -> None:
        super().__init__(name="redbatch-writer", daemon=True)
        self.finisher = finisher
        self.stop = stop
        self.events = events
        self.record = record
        self._queue: queue.Queue[Batch | None] = queue.Queue(maxsize=depth)
        self._outage = OutageRetry(
            "writing replies", give_up=give_up, events=events, on_retry=on_retry
        )
        self.failure: BaseException | None = None
        # Redis memory: a batch of only error replies waits while it is past the ceiling
        self.pressure = pressure or MemoryPressure(functools.partial(_client_of, finisher))
        self.held_s = 0.0  # seconds batches waited for memory in all (worker/answer/pressure.py)
        # Moving average of a write's seconds, over writes that needed no retry (an outage
        # says nothing about how long writes take); 0 until the first.
        self.typical_s = 0.0
        # The entries finished here and the batches that finished any: not those another
        # consumer holds now (a hung batch's, claimed meanwhile), which get their reply from
        # whoever finishes them
        self.served = {"requests": 0, "batches": 0}

    def submit(self, batch: Batch, *, here: bool = False) -> None:
        """Queue a batch for writing; blocks while two batches already wait. With ``here`` and
        nothing queued, write it on the calling thread instead, so batches are still written
        one at a time and in order. Called from one thread only (the serving thread's
        ``Worker.process``): that is what keeps a write here from overlapping one on the
        writer's thread (``Finisher``)."""
        if here and self.idle() and _has_ok(batch):  # one that may wait for memory waits there
            self._write_here(batch)
        else:
            self._put(batch)

    def idle(self) -> bool:
        """True when every submitted batch has been written."""
        return self._queue.unfinished_tasks == 0

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        if self.is_alive():
            self._put(None)
            self.join()

    def _put(self, item: Batch | None) -> None:
        while True:
            if self.failure is not None:
                raise WorkerError(f"the reply writer stopped: {self.failure}") from self.failure
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def run(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                self._write(batch)
            except BaseException as exc:  # surfaced by the service, which stops the worker
                self._failed(exc)
                return
            finally:
                self._queue.task_done()

    def _write_here(self, batch: Batch) -> None:
        if self.failure is not None:
            raise WorkerError(f"the reply writer stopped: {self.failure}") from self.failure
        try:
            self._write(batch)
        except BaseException as exc:
            self._failed(exc)
            self._queue.put_nowait(None)  # idle, so there is room: its thread ends as well
            raise WorkerError(f"the reply writer stopped: {exc}") from exc

    def _write(self, batch: Batch) -> None:
        if not _has_ok(batch):
            self._hold(batch)
        started = time.perf_counter()
        self.events.point("before_finish")
        self._outage.interrupted = False
        batch.finished = self._outage.call(
            functools.partial(self.finisher.finish_each, batch.finishes)
        )
        elapsed = time.perf_counter() - started
        if not self._outage.interrupted:
            self.typical_s += _TYPICAL_WEIGHT * (elapsed - self.typical_s)
        self.events.point("after_finish")
        self._written(batch, elapsed)

    def _hold(self, batch: Batch) -> None:
        """Wait while Redis is past the memory ceiling, for a batch of only error replies and
        dead letters: written now, they would grow a full Redis without bound. Its leases are
        renewed meanwhile (the lease keeper), so no other worker claims its entries. A stop
        ends the wait (what this worker holds is then written), and so does a batch with ok
        replies queued behind it: ok replies never wait for memory."""
        tags = {finish.shard or self.finisher.shards.model for finish in batch.finishes}
        give_up = self._outage.give_up
        stops = (self.stop,) if give_up is None else (self.stop, give_up)
        self.held_s += self.pressure.hold(tags, *stops, release=self._ok_waiting)

    def _ok_waiting(self) -> bool:
        """Whether a batch with an ok reply waits in the queue. Asked on every turn of a hold,
        which is the worker moving (Redis answers, memory is being watched), so /healthz and a
        stop's grace hear of it (``memory_hold``)."""
        self.events.point("memory_hold")
        with self._queue.mutex:
            waiting = list(self._queue.queue)
        return any(batch is not None and _has_ok(batch) for batch in waiting)

    def _written(self, batch: Batch, write_s: float) -> None:
        """A batch is in Redis: release its leases, tell the metrics, count what it served."""
        self.finisher.release(batch.finishes)
        codes = self.finisher.outcomes(batch.finishes, batch.finished)  # refused: DEAD_LETTER
        self.events.batch_done(
            codes=codes,
            queued_s=batch.queued_s,
            decode_s=batch.decode_s,
            runs=batch.runs,
            write_s=write_s,
            classes=batch.classes,
        )
        self.served["requests"] += len(codes)
        self.served["batches"] += 1 if codes else 0
        if self.record is not None:
            self.record.update(served=dict(self.served))

    def _failed(self, exc: BaseException) -> None:
        self.failure = exc
        told = self._outage.give_up is not None and self._outage.give_up.is_set()
        if told and isinstance(exc, redis.RedisError):
            # asked for (a stop signal during an outage): one line, not a traceback
            log.warning(
                "reply writer gave up on Redis as told (%s: %s); the unwritten entries stay "
                "pending, for a worker to claim",
                type(exc).__name__,
                exc,
            )
        else:
            log.exception("reply writer stopped; the unwritten entries stay pending")
        self.stop.set()


def _client_of(finisher: Finisher, tag: str) -> redis.Redis | None:
    """Shard ``tag``'s client, for memory readings; None once the shard was dropped."""
    shard = finisher.shards.get(tag)
    return None if shard is None else shard.stream.client


def _has_ok(batch: Batch) -> bool:
    """Whether ``batch`` answers any request with an ok reply (never held for memory)."""
    return any(finish.code == "OK" for finish in batch.finishes)
