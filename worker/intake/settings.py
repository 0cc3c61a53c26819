"""What every lane is built with: one frozen settings object, passed through unchanged.

The service fills it once from the worker's configuration and its shared parts (the hand-over,
the stop flag, the events, the ``Stuck`` flag); each lane's reading thread, reclaimer and lease
keeper take what they need from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from worker.events import NO_EVENTS, Events
from worker.intake.leases import Stuck
from worker.items import Item
from worker.model.schema import Schema

__all__ = ["Handoff", "IntakeSettings"]


class Handoff(Protocol):
    """Where reads go: the batcher's queue, or the preprocessing stage (worker/pipeline/prep.py)."""

    def put(self, items: list[Item]) -> None: ...


@dataclass(frozen=True, slots=True)
class IntakeSettings:
    """The read side's settings: who reads, what is admitted, how much at a time, and where it
    goes."""

    prefix: str
    consumer: str
    schema: Schema
    max_request_bytes: int
    max_element_bytes: int | None
    read_count: int  # entries per read at most: max_batch_size
    claim_idle_ms: int
    max_deliveries: int
    out: Handoff
    stop: threading.Event
    stuck: Stuck  # the service's, which the answerer marks: a hung batch's leases lapse
    events: Events = NO_EVENTS
    burst: bool = False  # report the stream drained (``Reader.idle``), for a burst worker
    on_retry: Callable[[BaseException], object] | None = None  # told of each retried failure
    block_ms: int = 500  # how long a read blocks for its first entry
