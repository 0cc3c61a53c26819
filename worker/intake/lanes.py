"""Lanes: one per shard of the model, each with its stream, leases, claims and reading thread.

A worker serves every shard of its model (contract section 4). Entry ids, pending lists and
consumers are per stream, so everything that names an entry stays per shard: a lane is one
shard's ``RequestStream``, its ``Leases``, the ``LeaseKeeper`` that renews them, and the
``Reader`` that reads, admits and hands entries over. Every lane hands over to the same queue,
so one batch may mix shards' requests; the lanes enter each shard's stream and leases in the
``ShardMap``, where the later stages find the shard an entry came from (``RawEntry.shard``,
``Finish.shard``) for its cancel recheck, its finish step and the release of its lease.

With one shard (any single Redis, and every model until ``redbatch shards`` adds one) there is
one lane. The shard list is read again on every heartbeat: a shard added gets a lane at once; a
lane whose shard was retired (drained, then dropped from ``P:{M}:retiring``) stops reading, and
closes once what it holds is answered.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import redis

from producer.redisio.topology import Topology
from worker.intake.leases import LeaseKeeper, Leases
from worker.intake.read import Reader
from worker.intake.reclaim import Reclaimer
from worker.intake.settings import IntakeSettings
from worker.intake.shardmap import ShardMap
from worker.redisio.claims import Claims
from worker.redisio.stream import RequestStream

__all__ = ["Lane", "Lanes"]

log = logging.getLogger(__name__)


class Lane:
    """One shard as this worker serves it."""

    def __init__(self, tag: str, stream: RequestStream, settings: IntakeSettings) -> None:
        self.tag = tag
        self.stream = stream
        self.leases = Leases()
        self.claims = Claims(stream)
        self.retired = threading.Event()  # set when its shard is gone: stop reading
        self.keeper = LeaseKeeper(
            self.claims,
            self.leases,
            settings.claim_idle_ms,
            settings.stuck,
            settings.events,
            stop=settings.stop,
        )
        reclaimer = Reclaimer(
            self.claims,
            self.leases,
            settings.claim_idle_ms,
            settings.max_deliveries,
            settings.events,
        )
        self.reader = Reader(stream, self.leases, settings, reclaimer, self.retired)
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

    def __init__(
        self, topology: Topology, model: str, settings: IntakeSettings, shards: ShardMap
    ) -> None:
        self.topology = topology
        self.model = model
        self.settings = settings
        self.shards = shards  # where each lane enters its stream and leases
        self._lanes: dict[str, Lane] = {}
        self._lock = threading.Lock()
        self.running = False  # lanes added once running start at once
        self.first = self._make(model)

    def _make(self, tag: str, join: bool = False) -> Lane:
        """A lane for ``tag``, in the map; with ``join``, only once its consumer group exists
        (one try: a failure is followed on the cluster and raised, the next sync tries again)."""
        s = self.settings
        stream = RequestStream(
            self.topology.client(tag), s.prefix, tag, s.consumer, s.events, s.max_request_bytes
        )
        lane = Lane(tag, stream, s)
        if join:
            try:
                stream.ensure_group()
            except redis.RedisError as exc:
                self.topology.follow(exc)
                raise
        with self._lock:
            self._lanes[tag] = lane
        self.shards.add(tag, stream, lane.leases)
        return lane

    def __iter__(self):  # type: ignore[no-untyped-def]
        with self._lock:
            return iter(list(self._lanes.values()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._lanes)

    def tags(self) -> list[str]:
        return [lane.tag for lane in self]

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
                self.shards.drop(lane.tag)
                with self._lock:
                    self._lanes.pop(lane.tag, None)

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
