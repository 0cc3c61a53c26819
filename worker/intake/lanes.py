"""Lanes: one per shard of the model, each with its stream, leases, claims and reading thread.

A worker serves every shard of its model (contract section 4). Entry ids, pending lists and
consumers are per stream, so everything that names an entry stays per shard: a lane is one
shard's ``RequestStream``, its ``Leases``, the ``LeaseKeeper`` that renews them, and the
``Reader`` that reads, admits and hands entries over. Every lane hands over to the same queue,
so one batch may mix shards' requests; each finish step and cancel check then goes to the shard
its entry came from (``Finish.shard``, ``RawEntry.shard``), one script per shard.

With one shard (any single Redis, and every model until ``redbatch shards`` adds one) there is
one lane, and the worker's path is what it was. The shard list is read again on every heartbeat:
a shard added gets a lane at once; a lane whose shard was retired (drained, then dropped from
``P:{M}:retiring``) stops reading, and closes once what it holds is answered.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import redis

from producer.redisio.topology import Topology
from worker.errors import WorkerError
from worker.events import Events
from worker.intake.leases import LeaseKeeper, Leases
from worker.intake.read import Handoff, Reader
from worker.intake.reclaim import Reclaimer
from worker.model.schema import Schema
from worker.redisio.claims import Claims
from worker.redisio.stream import Finish, FinishInFlight, RequestStream

__all__ = ["Lane", "LaneSettings", "Lanes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LaneSettings:
    """What every lane is built with: the worker's settings and its shared parts."""

    prefix: str
    consumer: str
    schema: Schema
    max_request_bytes: int
    max_element_bytes: int | None
    read_count: int
    claim_idle_ms: int
    max_deliveries: int
    out: Handoff
    stop: threading.Event
    events: Events
    burst: bool
    is_stuck: Callable[[], bool]
    on_retry: Callable[[BaseException], object] | None = None


class Lane:
    """One shard as this worker serves it."""

    def __init__(self, tag: str, stream: RequestStream, settings: LaneSettings) -> None:
        self.tag = tag
        self.stream = stream
        self.leases = Leases()
        self.claims = Claims(stream)
        self.retired = threading.Event()  # set when its shard is gone: stop reading
        self.keeper = LeaseKeeper(
            self.claims,
            self.leases,
            settings.claim_idle_ms,
            settings.events,
            stop=settings.stop,
            is_stuck=settings.is_stuck,
        )
        self.reader = Reader(
            stream,
            settings.schema,
            settings.max_request_bytes,
            settings.out,
            settings.stop,
            read_count=settings.read_count,
            leases=self.leases,
            reclaimer=Reclaimer(
                self.claims,
                self.leases,
                settings.claim_idle_ms,
                settings.max_deliveries,
                settings.events,
            ),
            events=settings.events,
            burst=settings.burst,
            max_element_bytes=settings.max_element_bytes,
            retired=self.retired,
            on_retry=settings.on_retry,
        )
        self.started = False

    def start(self) -> None:
        self.keeper.start()
        self.reader.start()
        self.started = True

    @property
    def done(self) -> bool:
        """Retired, no longer reading, and nothing it read is left to answer."""
        return (
            self.retired.is_set()
            and not self.reader.is_alive()
            and self.reader.failure is None  # kept, so that the worker raises it
            and not len(self.leases)
        )

    def threads(self) -> list[tuple[str, threading.Thread]]:
        return [(f"intake {self.tag}", self.reader), (f"leases {self.tag}", self.keeper)]


class Lanes:
    """The worker's lanes by shard tag; the first is the model's own shard, always there."""

    def __init__(self, topology: Topology, model: str, settings: LaneSettings) -> None:
        self.topology = topology
        self.model = model
        self.settings = settings
        self._lanes: dict[str, Lane] = {}
        self._lock = threading.Lock()
        self.running = False  # lanes added once running start at once
        # A mixed batch's finish that failed on some shard: (its finishes, flags of the shards
        # that did finish), for the writer's retry (``finish_each``)
        self._partial: tuple[Sequence[Finish], dict[str, list[bool]]] | None = None
        self.first = self._make(model)

    def _make(self, tag: str, join: bool = False) -> Lane:
        """A lane for ``tag``, in the map; with ``join``, only once its consumer group exists
        (one try: a failure is followed on the cluster and raised, the next sync tries again)."""
        s = self.settings
        stream = RequestStream(self.topology.client(tag), s.prefix, tag, s.consumer)
        lane = Lane(tag, stream, s)
        if join:
            try:
                stream.ensure_group()
            except redis.RedisError as exc:
                self.topology.follow(exc)
                raise
        with self._lock:
            self._lanes[tag] = lane
        return lane

    def __iter__(self):  # type: ignore[no-untyped-def]
        with self._lock:
            return iter(list(self._lanes.values()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._lanes)

    def tags(self) -> list[str]:
        return [lane.tag for lane in self]

    def stream(self, tag: str) -> RequestStream:
        """The stream of shard ``tag`` ("" is the model's first shard)."""
        with self._lock:
            lane = self._lanes.get(tag or self.model)
        if lane is None:  # a lane closes only once what it read is answered (``Lane.done``)
            raise WorkerError(f"no lane serves shard {tag!r}")
        return lane.stream

    def start(self) -> None:
        """Start every lane made so far (the first, and any ``sync`` added before start)."""
        self.running = True
        for lane in self:
            if not lane.started:
                lane.start()

    def sync(self, tags: Sequence[str]) -> list[str]:
        """Serve exactly ``tags`` (plus the model's own shard): a lane for each new tag (its
        group created, then started when the worker runs), and retire the lanes of tags gone.
        Returns the tags added."""
        wanted = [self.model, *(t for t in tags if t != self.model)]
        added = []
        with self._lock:
            current = dict(self._lanes)
        for tag in wanted:
            if tag in current:  # served already (or retired and listed again: it finishes
                continue  # what it holds and closes; the next sync after that reopens it)
            try:
                new = self._make(tag, join=True)
            except redis.RedisError as exc:  # its master away, or a refusal: next beat again
                log.warning("cannot join shard %s yet (%s); trying again next beat", tag, exc)
                continue
            if self.running:
                new.start()
            added.append(tag)
            log.info("serving shard %s (%s)", tag, new.stream.key)
        for tag, lane in current.items():
            if tag not in wanted and not lane.retired.is_set():
                lane.retired.set()
                log.info("shard %s retired: stopping its reads once it is answered", tag)
        self._close_done()
        return added

    def _close_done(self) -> None:
        for lane in self:
            if lane.tag != self.model and lane.done:
                lane.keeper.close()
                with self._lock:
                    self._lanes.pop(lane.tag, None)

    def finish_each(self, finishes: Sequence[Finish]) -> list[bool]:
        """Each shard's finishes in one script on that shard, all sent before any answer is
        read (one round trip's time, whatever the shards); per finish, whether it was
        finished here (``RequestStream.finish_each``), in the order given.

        When one shard fails (its master failing over), the others' answers are still read
        (their steps ran) and kept, then the error is raised: the writer retries the batch, and
        the retry sends only the shards still to finish, so the others are neither run again
        nor miscounted as not finished here.
        """
        by_shard: dict[str, list[int]] = {}
        for i, finish in enumerate(finishes):
            by_shard.setdefault(finish.shard or self.model, []).append(i)
        if len(by_shard) == 1:
            [tag] = by_shard
            return self.stream(tag).finish_each(finishes)
        kept = self._partial[1] if self._partial and self._partial[0] is finishes else {}
        self._partial = None
        sent: list[tuple[str, RequestStream, FinishInFlight]] = []
        failure: BaseException | None = None
        for tag, indexes in by_shard.items():
            if tag in kept:
                continue
            stream = self.stream(tag)
            try:
                sent.append((tag, stream, stream.finish_start([finishes[i] for i in indexes])))
            except Exception as exc:
                failure = failure or exc
        for tag, stream, in_flight in sent:
            try:
                kept[tag] = stream.finish_end(in_flight)
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            self._partial = (finishes, kept)  # the writer's retry passes the same list
            raise failure
        done = [False] * len(finishes)
        for tag, indexes in by_shard.items():
            for i, flag in zip(indexes, kept[tag], strict=True):
                done[i] = flag
        return done

    def release(self, finishes: Iterable[Finish]) -> None:
        """Release the leases of written entries, each in its own shard's lane."""
        by_shard: dict[str, list[bytes]] = {}
        for finish in finishes:
            by_shard.setdefault(finish.shard or self.model, []).append(finish.entry_id)
        with self._lock:
            lanes = dict(self._lanes)
        for tag, ids in by_shard.items():
            lane = lanes.get(tag)
            if lane is not None:
                lane.leases.release(ids)

    def idle(self) -> bool:
        """Burst mode: every lane's last read was empty and nothing waits elsewhere."""
        return all(lane.reader.idle.is_set() for lane in self if not lane.retired.is_set())

    def reading(self) -> bool:
        return any(lane.reader.is_alive() for lane in self)

    def close_keepers(self) -> None:
        for lane in self:
            lane.keeper.close()

    def failures(self) -> list[tuple[str, BaseException]]:
        return [
            (name, thread.failure)  # type: ignore[attr-defined]
            for lane in self
            for name, thread in lane.threads()
            if thread.failure is not None  # type: ignore[attr-defined]
        ]
