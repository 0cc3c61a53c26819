"""Lanes: one per request stream this worker reads, each with its leases, claims and thread.

A worker serves every shard of its model (contract section 4), and every lane of each shard
(section 7): a stream per class and tenant, ``P:{T}:requests`` being the shard's default lane.
Entry ids, pending lists and consumers are per stream, so everything that names an entry stays
per stream: a lane is one stream's ``RequestStream``, its ``Leases``, the ``LeaseKeeper`` that
renews them, and the ``Reader`` that reads, admits and hands entries over (claims and reclaims
included). Every lane hands over to the same queue (the scheduler picks among them), so one
batch may mix lanes; the lanes enter each stream and its leases in the ``ShardMap``, under the
name its entries carry (``RawEntry.shard``: the shard's tag for a default lane, the stream's key
for any other), where the later stages find them for the cancel recheck, the finish step and the
release of leases.

The shard list and each shard's lane set are read again on every heartbeat (``sync``), and at
once when a lane set's size changed (``worker.intake.lanewatch``): a shard
or lane added gets a lane at once; a lane whose shard was retired (drained, then dropped from
``P:{M}:retiring``) or which left its lane set stops reading, and closes once what it holds is
answered. A lane set is untrusted (``worker.intake.laneset``: junk ignored, lanes bounded). A
lane other than a default one that stayed empty for ``lane_idle_s`` is removed from Redis
(``worker.redisio.lanegc``) and retired; one removed by another worker is noticed by its reads
(``RequestStream.vanished``) and retired too. A producer that sends to it again lists it again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis

from producer.protocol.lanes import Lane as LaneName
from producer.protocol.lanes import lanes_key
from producer.redisio.topology import Topology
from worker.intake.laneset import LaneSets
from worker.intake.lanewatch import LaneWatch
from worker.intake.leases import LeaseKeeper, Leases
from worker.intake.read import Reader
from worker.intake.reclaim import Reclaimer
from worker.intake.settings import IntakeSettings
from worker.intake.shardmap import ShardMap
from worker.redisio.claims import Claims
from worker.redisio.group import StreamStats
from worker.redisio.lanegc import LaneSweeper, remove_lane
from worker.redisio.stream import RequestStream

__all__ = ["Lane", "Lanes"]

log = logging.getLogger(__name__)


class Lane:
    """One lane stream as this worker serves it."""

    def __init__(self, stream: RequestStream, settings: IntakeSettings) -> None:
        self.tag = stream.tag  # its shard
        self.key = stream.shard  # its name in the ShardMap: the tag for a default lane
        self.name = stream.lane  # its class and tenant; None for the shard's default lane
        self.stream = stream
        self.leases = Leases()
        self.claims = Claims(stream)
        self.retired = threading.Event()  # set when its shard or lane is gone: stop reading
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
    def retiring(self) -> bool:
        """Retired here, or its stream removed under it (by another worker, as empty)."""
        return self.retired.is_set() or self.stream.vanished

    @property
    def done(self) -> bool:
        """Retired, no longer reading, and nothing it read is left to answer."""
        return (
            self.retiring
            and not self.reader.is_alive()
            and self.reader.failure is None  # kept, so that the worker raises it
            and not len(self.leases)
        )

    def threads(self) -> list[tuple[str, threading.Thread]]:
        return [(f"intake {self.key}", self.reader), (f"leases {self.key}", self.keeper)]


class Lanes:
    """The worker's lanes by ``ShardMap`` name; the first is the model's own shard's default
    lane, always there. ``max_lanes`` bounds the lanes read per shard, ``lane_idle_s`` is how
    long a lane stays empty before it is removed (``[scheduling]``)."""

    def __init__(
        self,
        topology: Topology,
        model: str,
        settings: IntakeSettings,
        shards: ShardMap,
        *,
        max_lanes: int = 64,
        lane_idle_s: float = 300.0,
    ) -> None:
        self.topology = topology
        self.model = model
        self.settings = settings
        self.shards = shards  # where each lane enters its stream and leases
        self.sets = LaneSets(settings.prefix, max_lanes)
        self.sweeper = LaneSweeper(lane_idle_s)
        self._lanes: dict[str, Lane] = {}
        self._lock = threading.Lock()
        self._refused: set[str] = set()  # listed lanes whose key holds another type, said once
        self.running = False  # lanes added once running start at once
        self.first = self._make(LaneName(model))

    def _make(self, name: LaneName, join: bool = False) -> Lane:
        """A lane for ``name``, in the map; with ``join``, only once its consumer group exists
        (one try: a failure is followed on the cluster and raised, the next sync tries again)."""
        s = self.settings
        stream = RequestStream(
            self.topology.client(name.tag),
            s.prefix,
            name.tag,
            s.consumer,
            s.events,
            s.max_request_bytes,
            lane=name,
        )
        lane = Lane(stream, s)
        if join:
            try:
                stream.ensure_group()
            except redis.RedisError as exc:
                self.topology.follow(exc)
                raise
        with self._lock:
            self._lanes[lane.key] = lane
        self.shards.add(lane.key, stream, lane.leases)
        return lane

    def __iter__(self):  # type: ignore[no-untyped-def]
        with self._lock:
            return iter(list(self._lanes.values()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._lanes)

    def tags(self) -> list[str]:
        """The shards served (their default lanes)."""
        return [lane.tag for lane in self if lane.name is None]

    def watch(self, on_change: Callable[[], None], interval_ms: float) -> LaneWatch:
        """A ``LaneWatch`` of the shards served, calling ``on_change`` (not started)."""
        return LaneWatch(
            self.topology,
            self.settings.prefix,
            self.tags,
            on_change,
            self.settings.stop,
            interval_s=interval_ms / 1000.0,
            max_lanes=self.sets.max_lanes,
        )

    def start(self) -> None:
        """Start every lane made so far (the first, and any ``sync`` added before start)."""
        self.running = True
        for lane in self:
            if not lane.started:
                lane.start()

    def sync(self, tags: Sequence[str]) -> list[str]:
        """Serve exactly ``tags`` (plus the model's own shard) and the lanes each one's lane set
        lists: a lane for each new one (its group created, then started when the worker runs),
        and retire the lanes gone. Returns the shard tags added."""
        self._close_done()  # a lane retired and answered goes first: listed again, it reopens
        wanted_tags = [self.model, *(t for t in tags if t != self.model)]
        with self._lock:
            current = dict(self._lanes)
        wanted: dict[str, LaneName] = {}
        for tag in wanted_tags:
            wanted[tag] = LaneName(tag)
            for name in self._listed(tag, current):
                wanted[name.stream(self.settings.prefix)] = name
        added = []
        for key, name in wanted.items():
            if key in current:  # served already (or retired and not yet answered: the next
                continue  # sync after it closes reopens it)
            if self._join(key, name) and name.is_default:
                added.append(name.tag)
        for key, lane in current.items():
            if key not in wanted and not lane.retiring:
                lane.retired.set()
                what = "shard" if lane.name is None else "lane"
                log.info("%s %s retired: stopping its reads once it is answered", what, key)
        self._close_done()
        return added

    def _listed(self, tag: str, current: dict[str, Lane]) -> list[LaneName]:
        """Shard ``tag``'s lanes from its lane set; the lanes served now when it cannot be read
        (its master away: none is retired for that)."""
        try:
            served = [key for key, lane in current.items() if lane.tag == tag and lane.name]
            listed = self.sets.read(self.topology.client(tag), tag, served)
        except redis.RedisError as exc:
            self.topology.follow(exc)
            log.warning("cannot read the lane set of shard %s yet (%s); next beat again", tag, exc)
            listed = None
        if listed is not None:
            return listed
        return [lane.name for lane in current.values() if lane.tag == tag and lane.name]

    def _join(self, key: str, name: LaneName) -> bool:
        """Make and start the lane ``name``; False when its group cannot be made now."""
        try:
            new = self._make(name, join=True)
        except redis.ResponseError as exc:
            if name.is_default or not str(exc).startswith("WRONGTYPE"):
                return self._not_yet(key, exc)
            if key not in self._refused:  # a listed key that is no stream: junk, said once
                self._refused.add(key)
                log.warning("ignoring lane %s: the key holds another type than a stream", key)
            return False
        except redis.RedisError as exc:
            return self._not_yet(key, exc)
        self._refused.discard(key)
        if self.running:
            new.start()
        what = "shard" if name.is_default else "lane"
        log.info("serving %s %s (%s)", what, name.tag if name.is_default else key, key)
        return True

    @staticmethod
    def _not_yet(key: str, exc: redis.RedisError) -> bool:
        """Its master away, or a refusal: the next beat tries again."""
        log.warning("cannot join %s yet (%s); trying again next beat", key, exc)
        return False

    def _close_done(self) -> None:
        for lane in self:
            if lane is not self.first and lane.done:
                lane.keeper.close()
                self.shards.drop(lane.key)
                self.sweeper.forget(lane.key)
                with self._lock:
                    self._lanes.pop(lane.key, None)

    def sample(
        self,
    ) -> tuple[list[tuple[LaneName, StreamStats]], list[dict[str, Any]], redis.RedisError | None]:
        """Each lane's stream sampled (one round trip a lane): the stats per lane, the streams'
        damage notes, and the first failure (that shard's master away: the others are
        sampled). A lane empty for ``lane_idle_s`` is removed here (and sampled no more)."""
        per_lane: list[tuple[LaneName, StreamStats]] = []
        damage: list[dict[str, Any]] = []
        failed: redis.RedisError | None = None
        for lane in self:
            try:
                stats = lane.stream.stats()
                sweep = lane.name is not None and not lane.retiring
                if sweep and self.sweeper.seen(lane.key, stats):
                    self._remove(lane)
            except redis.RedisError as exc:
                failed = failed or exc
                self.topology.follow(exc)
                continue
            per_lane.append((lane.name or LaneName(lane.tag), stats))
            damage += lane.stream.group.damage
        return per_lane, damage, failed

    def _remove(self, lane: Lane) -> None:
        """Remove an idle lane from Redis (when it is still empty) and retire it here."""
        self.sweeper.forget(lane.key)
        lanes = lanes_key(self.settings.prefix, lane.tag)
        if remove_lane(lane.stream.client, lane.key, lanes):
            lane.retired.set()
            log.info(
                "removed lane %s: empty with nothing pending for %g s (scheduling.lane_idle_s)",
                lane.key,
                self.sweeper.idle_s,
            )

    def idle(self) -> bool:
        """Burst mode: every lane's last read was empty and nothing waits elsewhere."""
        return all(lane.reader.idle.is_set() for lane in self if not lane.retiring)

    def reading(self) -> bool:
        return any(lane.reader.is_alive() for lane in self)

    def forget_self(self) -> None:
        """Leave each lane's group on a clean exit, so restarts do not pile up consumers."""
        consumer = self.settings.consumer
        for lane in self:
            try:
                if lane.claims.forget_self():
                    log.debug("removed consumer %s from %s's group", consumer, lane.key)
            except (redis.RedisError, OSError) as exc:
                log.warning("could not remove consumer %s from the group (%s)", consumer, exc)

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
