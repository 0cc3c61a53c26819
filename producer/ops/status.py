"""What a model's queue looks like right now: backlog, group, consumers, dead letters, workers.

``gather_status`` reads it from Redis into frozen dataclasses (its only side effect is removing
the names of workers whose validation record has expired from the registry set, as the protocol's
registry requires); ``producer.ops.report`` renders them as text and JSON.

A model's queue may have several shards (``P:{M}:shards``, docs/protocol.md section 1), each on
its own cluster master. Each shard is read from its own node (``ShardAccess``:
``producer.redisio.topology`` routing, retried through outages and redirects) into a
``ShardStatus``; ``ModelStatus.requests`` and ``.dead`` are their sums, so that what reads one
number (a dashboard's ``.requests.backlog``) reads the whole queue. With one shard the sums are
that shard, and the report is as it always was; with more, the text report adds a table of
shards and a total line. Each shard's other lanes (classes and tenants, contract section 7)
are read by ``producer.ops.lanes`` into ``ShardStatus.lanes``; ``requests`` stays the default
lanes' sum, and ``producer.ops.lanes.queue_total`` adds the rest.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import redis

from producer.ops.damage import DamageNote, stream_damage, worker_damage
from producer.ops.entries import entry_age_s, redis_text
from producer.ops.lanes import LaneRead, read_lanes
from producer.protocol import keys
from producer.redisio.connection import describe_connection
from producer.redisio.memory import MemoryReading, parse_info_memory
from producer.redisio.retry import RetryPolicy
from producer.redisio.shards import Shards, read_shards
from producer.redisio.topology import REDIRECTS, Topology

__all__ = [
    "ConsumerInfo",
    "DeadLetter",
    "DeadLetters",
    "GroupInfo",
    "ModelStatus",
    "RequestsInfo",
    "ShardAccess",
    "ShardStatus",
    "WorkerInfo",
    "epoch_s",
    "gather_shard",
    "gather_status",
    "iso_age_s",
    "redis_where",
]

T = TypeVar("T")

#: How many of the newest dead letters ``gather_status`` reads by default.
DEFAULT_DEAD_LIMIT = 5


@dataclass(frozen=True, slots=True)
class ConsumerInfo:
    """One consumer of the group (XINFO CONSUMERS)."""

    name: str
    pending: int
    idle_ms: int


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """The ``workers`` consumer group (XINFO GROUPS); ``lag`` is None when Redis cannot tell."""

    name: str
    pending: int
    lag: int | None
    last_delivered_id: str
    consumers: tuple[ConsumerInfo, ...]


@dataclass(frozen=True, slots=True)
class RequestsInfo:
    """The request stream: its backlog (XLEN) and, when it exists, its group."""

    key: str
    exists: bool
    backlog: int
    oldest_entry_age_s: float | None
    group: GroupInfo | None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One dead-letter entry: its id, the request id it carried, and why it died."""

    entry_id: str
    rid: str | None
    reason: str
    age_s: float
    tag: str = ""  # the shard whose dead-letter stream holds it


@dataclass(frozen=True, slots=True)
class DeadLetters:
    """The dead-letter stream: how many entries, and the newest few (newest first)."""

    key: str
    count: int
    recent: tuple[DeadLetter, ...]


@dataclass(frozen=True, slots=True)
class ShardStatus:
    """One shard of the queue: whether producers still send to it (``send``) or it is being
    drained (``retiring``), the master serving it (None on a single Redis), its request stream
    (the default lane), its dead letters, and its other lanes (``producer.ops.lanes``)."""

    tag: str
    state: str
    node: str | None
    requests: RequestsInfo
    dead: DeadLetters
    damage: tuple[DamageNote, ...] = ()  # what its streams show now (producer.ops.damage)
    lanes: LaneRead = field(default_factory=LaneRead)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A live worker's validation record, as it published it, and its key's remaining TTL."""

    name: str
    ttl_s: int | None
    record: dict[str, Any]

    def get(self, *path: str) -> Any:
        """The record's value at ``path`` (nested keys), or None when any level is missing."""
        value: Any = self.record
        for key in path:
            if not isinstance(value, dict):
                return None
            value = value.get(key)
        return value


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """Everything ``redbatch status`` shows for one model; ``requests`` and ``dead`` are summed
    over ``shards`` (the one shard's own with one)."""

    model: str
    prefix: str
    observed_at: float
    requests: RequestsInfo
    dead: DeadLetters
    workers: tuple[WorkerInfo, ...]
    expired_workers: tuple[str, ...] = field(default=())
    memory: MemoryReading | None = None  # None: INFO refused to this user
    shards: tuple[ShardStatus, ...] = field(default=())
    cluster: bool = False
    memory_node: str | None = None  # on a cluster: the fullest master, whose reading ``memory`` is
    damage: tuple[
        DamageNote, ...
    ] = ()  # the shards' streams now, then workers' notes, newest first


# ---------------------------------------------------------------------------------------------
# Gathering


class ShardAccess:
    """Commands on each shard's own node: a ``Topology`` for routing (its own unless one is
    passed) and one ``RetryPolicy`` that rides out outages and cluster redirects (a ``MOVED``
    repoints the slot's client before the retry). What the operator's commands share."""

    def __init__(
        self, conn: redis.Redis, retry_s: float = 0.0, topology: Topology | None = None
    ) -> None:
        self.topology = topology if topology is not None else Topology(conn)
        self.retry = RetryPolicy(redis_where(conn), retry_s)
        self._owned = topology is None

    def refresh(self) -> bool:
        """Read the cluster's slot map (a single Redis: none); True on a cluster."""
        return self.retry.call(self.topology.refresh)

    @property
    def cluster(self) -> bool:
        return self.topology.cluster

    def node(self, tag: str) -> str | None:
        """The address of the master serving ``tag``; None on a single Redis."""
        found = self.topology.node_of(tag)
        return None if found is None else found.address

    def on(self, tag: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(client of tag, *args)``, retried as the policy says."""

        def attempt() -> T:
            try:
                return fn(self.topology.client(tag), *args)
            except REDIRECTS as exc:
                self.topology.follow(exc)
                raise

        return self.retry.call(attempt)

    def close(self) -> None:
        """Disconnect the node pools of a topology made here (not the seed's)."""
        if self._owned:
            self.topology.close()


def gather_status(
    conn: redis.Redis,
    model: str,
    prefix: str = keys.DEFAULT_PREFIX,
    *,
    dead_limit: int = DEFAULT_DEAD_LIMIT,
    now_s: float | None = None,
    retry_s: float = 0.0,
    topology: Topology | None = None,
) -> ModelStatus:
    """Read the model's queue state, every shard from its own node, retrying through an outage
    for up to ``retry_s``; raises ConnectionFailed when Redis cannot be asked. Without
    ``topology`` it finds out by itself whether ``conn`` is a cluster node; with one, the
    caller keeps its slot map fresh (``--watch`` reuses one)."""
    now = time.time() if now_s is None else now_s
    access = ShardAccess(conn, retry_s, topology)
    try:
        if topology is None:
            access.refresh()
        shards: Shards = access.on(model, read_shards, prefix, model)
        parts = tuple(
            gather_shard(access, prefix, tag, now, dead_limit, retiring=tag in shards.retiring)
            for tag in shards.serve
        )
        memory, memory_node = _fullest_memory(access, conn, parts)
        workers, expired = access.on(model, _live_workers, prefix, model)
    finally:
        access.close()
    return ModelStatus(
        model=model,
        prefix=prefix,
        observed_at=now,
        requests=_total_requests(parts),
        dead=_total_dead(parts, dead_limit),
        workers=workers,
        expired_workers=expired,
        memory=memory,
        shards=parts,
        cluster=access.cluster,
        memory_node=memory_node,
        damage=tuple(n for p in parts for n in p.damage) + worker_damage(workers),
    )


def gather_shard(
    access: ShardAccess,
    prefix: str,
    tag: str,
    now_s: float,
    dead_limit: int = DEFAULT_DEAD_LIMIT,
    *,
    retiring: bool = False,
) -> ShardStatus:
    """One shard's request stream, dead letters and other lanes, read from the node that
    serves it."""
    requests = access.on(tag, _requests_info, keys.request_stream(prefix, tag), now_s)
    dead = access.on(tag, _dead_letters, keys.dead_key(prefix, tag), dead_limit, now_s, tag)
    state = "retiring" if retiring else "send"
    damage = access.on(
        tag, stream_damage, keys.request_stream(prefix, tag), keys.dead_key(prefix, tag)
    )
    lanes = access.on(tag, read_lanes, prefix, tag, now_s)
    return ShardStatus(tag, state, access.node(tag), requests, dead, damage + lanes.damage, lanes)


def _fullest_memory(
    access: ShardAccess, conn: redis.Redis, parts: tuple[ShardStatus, ...]
) -> tuple[MemoryReading | None, str | None]:
    """``INFO memory`` of the one Redis, or on a cluster of each master serving a shard: the
    fullest reading (producers are refused by the fullest shard's node first) and its node."""
    if not access.cluster:
        return access.retry.call(_memory, conn), None
    fullest: tuple[MemoryReading | None, str | None] = (None, None)
    seen: set[str | None] = set()
    for part in parts:
        if part.node in seen:
            continue
        seen.add(part.node)
        reading = access.on(part.tag, _memory)
        if reading is not None and (
            fullest[0] is None or (reading.used_fraction or 0.0) > (fullest[0].used_fraction or 0.0)
        ):
            fullest = (reading, part.node)
    return fullest


def _total_requests(parts: tuple[ShardStatus, ...]) -> RequestsInfo:
    """The request streams summed; one shard's as it is."""
    if len(parts) == 1:
        return parts[0].requests
    reqs = [p.requests for p in parts]
    groups = [r.group for r in reqs if r.group is not None]
    ages = [r.oldest_entry_age_s for r in reqs if r.oldest_entry_age_s is not None]
    group = None
    if groups:
        consumers: dict[str, ConsumerInfo] = {}
        for g in groups:
            for c in g.consumers:  # a worker is one consumer name on every shard it serves
                seen = consumers.get(c.name)
                consumers[c.name] = (
                    c
                    if seen is None
                    else ConsumerInfo(
                        c.name, seen.pending + c.pending, min(seen.idle_ms, c.idle_ms)
                    )
                )
        lags = [g.lag for g in groups]
        group = GroupInfo(
            name=keys.CONSUMER_GROUP,
            pending=sum(g.pending for g in groups),
            lag=None if any(lag is None for lag in lags) else sum(lag or 0 for lag in lags),
            last_delivered_id=max((g.last_delivered_id for g in groups), key=_id_order),
            consumers=tuple(sorted(consumers.values(), key=lambda c: c.name)),
        )
    return RequestsInfo(
        key=", ".join(r.key for r in reqs),
        exists=any(r.exists for r in reqs),
        backlog=sum(r.backlog for r in reqs),
        oldest_entry_age_s=max(ages) if ages else None,
        group=group,
    )


def _total_dead(parts: tuple[ShardStatus, ...], limit: int) -> DeadLetters:
    """The dead-letter streams summed, with the newest few of all shards."""
    if len(parts) == 1:
        return parts[0].dead
    recent = sorted((d for p in parts for d in p.dead.recent), key=lambda d: d.age_s)
    return DeadLetters(
        key=", ".join(p.dead.key for p in parts),
        count=sum(p.dead.count for p in parts),
        recent=tuple(recent[:limit]),
    )


def _id_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return -1, -1


def redis_where(conn: redis.Redis) -> str:
    """Where ``conn`` connects, without its password: the place a failed command's error names,
    so that an operator's command fails as ``Client`` does, saying which Redis it could not
    reach."""
    pool = conn.connection_pool
    tls = issubclass(pool.connection_class, redis.SSLConnection)
    return describe_connection(pool.connection_kwargs, tls)


def _memory(conn: redis.Redis) -> MemoryReading | None:
    """``INFO memory``; None when this user may not run INFO (ACL without ``+info``) or it lacks
    ``used_memory``: the rest of the status does not need it."""
    try:
        return parse_info_memory(conn.info("memory"))
    except (redis.exceptions.NoPermissionError, ValueError):
        return None


def _requests_info(conn: redis.Redis, key: str, now_s: float) -> RequestsInfo:
    if redis_text(conn.type(key)) != "stream":
        return RequestsInfo(key, exists=False, backlog=0, oldest_entry_age_s=None, group=None)
    backlog = int(conn.xlen(key))
    oldest = conn.xrange(key, "-", "+", count=1)
    oldest_age = entry_age_s(redis_text(oldest[0][0]), now_s) if oldest else None
    group = None
    for raw in conn.xinfo_groups(key):
        if redis_text(raw["name"]) == keys.CONSUMER_GROUP:
            consumers = tuple(
                ConsumerInfo(redis_text(c["name"]), int(c["pending"]), int(c["idle"]))
                for c in conn.xinfo_consumers(key, keys.CONSUMER_GROUP)
            )
            lag = raw.get("lag")
            group = GroupInfo(
                name=keys.CONSUMER_GROUP,
                pending=int(raw["pending"]),
                # Redis can report a lag from before a restart (an AOF replay) larger than the
                # stream; the entries waiting can never outnumber the entries there are.
                lag=None if lag is None else min(int(lag), backlog),
                last_delivered_id=redis_text(raw["last-delivered-id"]),
                consumers=tuple(sorted(consumers, key=lambda c: c.name)),
            )
    return RequestsInfo(
        key, exists=True, backlog=backlog, oldest_entry_age_s=oldest_age, group=group
    )


def _dead_letters(
    conn: redis.Redis, key: str, limit: int, now_s: float, tag: str = ""
) -> DeadLetters:
    if redis_text(conn.type(key)) != "stream":
        return DeadLetters(key, count=0, recent=())
    recent = []
    for entry_id, fields in (conn.xrevrange(key, "+", "-", count=limit) or []) if limit else []:
        decoded = {redis_text(k): v for k, v in (fields or {}).items()}
        rid = decoded.get("rid")
        recent.append(
            DeadLetter(
                entry_id=redis_text(entry_id),
                rid=None if rid is None else redis_text(rid),
                reason=redis_text(decoded.get("reason", b"(no reason recorded)")),
                age_s=entry_age_s(redis_text(entry_id), now_s),
                tag=tag,
            )
        )
    return DeadLetters(key, count=int(conn.xlen(key)), recent=tuple(recent))


def _live_workers(
    conn: redis.Redis, prefix: str, model: str
) -> tuple[tuple[WorkerInfo, ...], tuple[str, ...]]:
    """Workers whose record is still there; names whose record expired are removed from the set."""
    set_key = keys.workers_key(prefix, model)
    members = sorted((redis_text(m), m) for m in conn.smembers(set_key))
    live: list[WorkerInfo] = []
    expired: list[tuple[str, Any]] = []  # removed as stored, so a name not UTF-8 goes too
    for name, raw_name in members:
        if not keys.is_valid_name(name):
            expired.append((name, raw_name))
            continue
        record_key = keys.worker_key(prefix, model, name)
        pipe = conn.pipeline(transaction=False)
        pipe.get(record_key)
        pipe.ttl(record_key)
        raw, ttl = pipe.execute()
        if raw is None:
            expired.append((name, raw_name))
            continue
        live.append(
            WorkerInfo(
                name, ttl_s=ttl if ttl is not None and ttl >= 0 else None, record=_parse_record(raw)
            )
        )
    if expired:
        conn.srem(set_key, *(raw_name for _, raw_name in expired))
    return tuple(live), tuple(name for name, _ in expired)


def _parse_record(raw: bytes | str) -> dict[str, Any]:
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return {"state": "unreadable", "error": f"record is not JSON: {exc}"}
    if not isinstance(record, dict):
        return {"state": "unreadable", "error": "record is not a JSON object"}
    return record


def epoch_s(stamp: Any) -> float | None:
    """An ISO-8601 timestamp with a zone as epoch seconds; None for anything else."""
    if not isinstance(stamp, str):
        return None
    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when.timestamp() if when.tzinfo is not None else None


def iso_age_s(stamp: Any, now_s: float) -> float | None:
    at = epoch_s(stamp)
    return None if at is None else max(0.0, now_s - at)
