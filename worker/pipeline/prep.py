"""The preprocessing stage: between the reading thread and the batcher, when a pipeline is set.

The reading thread hands each read here (``put``, in place of the batcher's queue); its admitted
requests are submitted to the hook pool at once, and this stage's thread hands the read on to
the batcher, in read order, once they are preprocessed. Reads in flight are bounded (two wait
here at most, as on the batcher's queue), so the worker still holds a few batches at most, and
preprocessing of the next reads overlaps the current run.

The batcher's queue holds reads per lane (``worker/answer/scheduler.py``): a read takes room in
its lane's share as it is put here (``reserve``), not when it is handed on, so the reader of a
full low lane waits on its own, and a high read behind it is never held up by that wait. A high
read can still wait behind the two reads being preprocessed ahead of it.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Protocol

from worker.errors import Rejected
from worker.items import Admitted, Item, Refused
from worker.pipeline.hooks import Pending, Pipeline

__all__ = ["PrepStage"]

log = logging.getLogger(__name__)


class LaneRoom(Protocol):
    """What this stage needs of the batcher's queue (``worker/answer/scheduler.LaneQueue``)."""

    def reserve(self, items: list[Item]) -> Any: ...

    def put_reserved(self, reservation: Any, items: list[Item]) -> None: ...


class PrepStage(threading.Thread):
    """Reads in, preprocessed reads out to ``out`` (the batcher's queue), in order."""

    def __init__(self, pipeline: Pipeline, out: LaneRoom) -> None:
        super().__init__(name="redbatch-prep", daemon=True)
        self.pipeline = pipeline
        self.out = out
        self._pending: queue.Queue[tuple[Any, Pending] | None] = queue.Queue(maxsize=2)
        self._lock = threading.Lock()
        self._in_flight = 0  # reads put and not yet handed on

    def put(self, items: list[Item]) -> None:
        """On the reading thread: take room in the read's lane (blocking while it is full), then
        submit its preprocessing; blocks while two wait."""
        reservation = self.out.reserve(items)
        with self._lock:
            self._in_flight += 1
        self._pending.put((reservation, self.pipeline.start_preprocess(items)))

    def idle(self) -> bool:
        """Nothing put here waits to be handed on."""
        with self._lock:
            return self._in_flight == 0

    def close(self) -> None:
        """End the thread once every read put before is handed on."""
        self._pending.put(None)
        self.join()

    def run(self) -> None:
        while (taken := self._pending.get()) is not None:
            reservation, pending = taken
            self.out.put_reserved(reservation, self._finish(pending))
            with self._lock:
                self._in_flight -= 1

    def _finish(self, pending: Pending) -> list[Item]:
        try:
            return self.pipeline.finish_preprocess(pending)
        except Exception:  # a bug here must fail these requests only, never stop the stage
            log.exception("preprocessing failed unexpectedly; answering its requests INTERNAL")
            error = Rejected(
                "INTERNAL", "the worker failed preprocessing this request; retry.", retryable=True
            )
            return [
                Refused(i.entry, i.rid, error, i.meta_raw, i.reply_ttl_s, i.decode_ms, i.deliveries)
                if type(i) is Admitted
                else i
                for i in pending.items
            ]
