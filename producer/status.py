"""What a model's queue looks like right now: backlog, group, consumers, dead letters, workers.

``gather_status`` reads it from Redis into frozen dataclasses (its only side effect is removing
the names of workers whose validation record has expired from the registry set, as the contract's
registry requires); ``format_status`` renders it as a table a person reads; ``status_to_json``
gives the same data as plain JSON values. Both lead with Redis memory against ``maxmemory``: past
the producers' high watermark new work is refused (``RedisFull``), so operators must see it come.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import redis

from producer import core, keys
from producer.memory import MemoryReading, parse_info_memory
from producer.retry import RetryPolicy
from producer.statusformat import (
    INFO_REFUSED,
    ago,
    ago_or_dash,
    duration,
    memory_notes,
    memory_summary,
    printable,
    producers_refused,
    record_lines,
    show,
    table,
    tensor_spec,
)

__all__ = [
    "ConsumerInfo",
    "DeadLetter",
    "DeadLetters",
    "GroupInfo",
    "ModelStatus",
    "RequestsInfo",
    "WorkerInfo",
    "epoch_s",
    "format_status",
    "gather_status",
    "printable",
    "redis_where",
    "status_to_json",
    "tensor_spec",
]

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


@dataclass(frozen=True, slots=True)
class DeadLetters:
    """The dead-letter stream: how many entries, and the newest few (newest first)."""

    key: str
    count: int
    recent: tuple[DeadLetter, ...]


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
    """Everything ``redbatch status`` shows for one model."""

    model: str
    prefix: str
    observed_at: float
    requests: RequestsInfo
    dead: DeadLetters
    workers: tuple[WorkerInfo, ...]
    expired_workers: tuple[str, ...] = field(default=())
    memory: MemoryReading | None = None  # None: INFO refused to this user


# ---------------------------------------------------------------------------------------------
# Gathering


def gather_status(
    conn: redis.Redis,
    model: str,
    prefix: str = keys.DEFAULT_PREFIX,
    *,
    dead_limit: int = DEFAULT_DEAD_LIMIT,
    now_s: float | None = None,
    retry_s: float = 0.0,
) -> ModelStatus:
    """Read the model's queue state, retrying through an outage for up to ``retry_s``; raises
    ConnectionFailed when Redis cannot be asked."""
    now = time.time() if now_s is None else now_s
    call = RetryPolicy(redis_where(conn), retry_s).call
    memory = call(_memory, conn)
    requests = call(_requests_info, conn, keys.request_stream(prefix, model), now)
    dead = call(_dead_letters, conn, keys.dead_key(prefix, model), dead_limit, now)
    workers, expired = call(_live_workers, conn, prefix, model)
    return ModelStatus(
        model=model,
        prefix=prefix,
        observed_at=now,
        requests=requests,
        dead=dead,
        workers=workers,
        expired_workers=expired,
        memory=memory,
    )


def redis_where(conn: redis.Redis) -> str:
    """Where ``conn`` connects, without its password: the place a failed command's error names,
    so that an operator's command fails as ``Client`` does, saying which Redis it could not
    reach."""
    pool = conn.connection_pool
    tls = issubclass(pool.connection_class, redis.SSLConnection)
    return core.describe_connection(pool.connection_kwargs, tls)


def _memory(conn: redis.Redis) -> MemoryReading | None:
    """``INFO memory``; None when this user may not run INFO (ACL without ``+info``) or it lacks
    ``used_memory``: the rest of the status does not need it."""
    try:
        return parse_info_memory(conn.info("memory"))
    except (redis.exceptions.NoPermissionError, ValueError):
        return None


def _requests_info(conn: redis.Redis, key: str, now_s: float) -> RequestsInfo:
    if _text(conn.type(key)) != "stream":
        return RequestsInfo(key, exists=False, backlog=0, oldest_entry_age_s=None, group=None)
    backlog = int(conn.xlen(key))
    oldest = conn.xrange(key, "-", "+", count=1)
    oldest_age = _id_age_s(_text(oldest[0][0]), now_s) if oldest else None
    group = None
    for raw in conn.xinfo_groups(key):
        if _text(raw["name"]) == keys.CONSUMER_GROUP:
            consumers = tuple(
                ConsumerInfo(_text(c["name"]), int(c["pending"]), int(c["idle"]))
                for c in conn.xinfo_consumers(key, keys.CONSUMER_GROUP)
            )
            lag = raw.get("lag")
            group = GroupInfo(
                name=keys.CONSUMER_GROUP,
                pending=int(raw["pending"]),
                # Redis can report a lag from before a restart (an AOF replay) larger than the
                # stream; the entries waiting can never outnumber the entries there are.
                lag=None if lag is None else min(int(lag), backlog),
                last_delivered_id=_text(raw["last-delivered-id"]),
                consumers=tuple(sorted(consumers, key=lambda c: c.name)),
            )
    return RequestsInfo(
        key, exists=True, backlog=backlog, oldest_entry_age_s=oldest_age, group=group
    )


def _dead_letters(conn: redis.Redis, key: str, limit: int, now_s: float) -> DeadLetters:
    if _text(conn.type(key)) != "stream":
        return DeadLetters(key, count=0, recent=())
    recent = []
    for entry_id, fields in (conn.xrevrange(key, "+", "-", count=limit) or []) if limit else []:
        decoded = {_text(k): v for k, v in (fields or {}).items()}
        rid = decoded.get("rid")
        recent.append(
            DeadLetter(
                entry_id=_text(entry_id),
                rid=None if rid is None else _text(rid),
                reason=_text(decoded.get("reason", b"(no reason recorded)")),
                age_s=_id_age_s(_text(entry_id), now_s),
            )
        )
    return DeadLetters(key, count=int(conn.xlen(key)), recent=tuple(recent))


def _live_workers(
    conn: redis.Redis, prefix: str, model: str
) -> tuple[tuple[WorkerInfo, ...], tuple[str, ...]]:
    """Workers whose record is still there; names whose record expired are removed from the set."""
    set_key = keys.workers_key(prefix, model)
    members = sorted((_text(m), m) for m in conn.smembers(set_key))
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


def _text(value: Any) -> str:
    """Bytes from Redis as text; bytes that are not UTF-8 become ``\\xNN``, so that a report
    shows what is stored rather than a replacement character."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def _id_age_s(entry_id: str, now_s: float) -> float:
    """Age of a stream entry from the millisecond time in its id."""
    try:
        ms = int(entry_id.split("-", 1)[0])
    except ValueError:
        return 0.0
    return max(0.0, now_s - ms / 1000.0)


def epoch_s(stamp: Any) -> float | None:
    """An ISO-8601 timestamp with a zone as epoch seconds; None for anything else."""
    if not isinstance(stamp, str):
        return None
    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when.timestamp() if when.tzinfo is not None else None


def _iso_age_s(stamp: Any, now_s: float) -> float | None:
    at = epoch_s(stamp)
    return None if at is None else max(0.0, now_s - at)


# ---------------------------------------------------------------------------------------------
# JSON


def status_to_json(status: ModelStatus) -> dict[str, Any]:
    """The status as JSON values: the dataclasses' fields, with each worker's full record."""
    req = status.requests
    group = req.group
    return {
        "model": status.model,
        "prefix": status.prefix,
        "observed_at": status.observed_at,
        "requests": {
            "key": req.key,
            "exists": req.exists,
            "backlog": req.backlog,
            "oldest_entry_age_s": req.oldest_entry_age_s,
            "group": None
            if group is None
            else {
                "name": group.name,
                "pending": group.pending,
                "lag": group.lag,
                "last_delivered_id": group.last_delivered_id,
                "consumers": [
                    {"name": c.name, "pending": c.pending, "idle_ms": c.idle_ms}
                    for c in group.consumers
                ],
            },
        },
        "dead": {
            "key": status.dead.key,
            "count": status.dead.count,
            "recent": [
                {"entry_id": d.entry_id, "rid": d.rid, "reason": d.reason, "age_s": d.age_s}
                for d in status.dead.recent
            ],
        },
        "workers": [
            {
                "name": w.name,
                "ttl_s": w.ttl_s,
                "heartbeat_age_s": _iso_age_s(w.get("heartbeat_at"), status.observed_at),
                "record": w.record,
            }
            for w in status.workers
        ],
        "expired_workers": list(status.expired_workers),
        "redis": _memory_json(status.memory),
    }


def _memory_json(reading: MemoryReading | None) -> dict[str, Any] | None:
    if reading is None:
        return None
    return {
        "used_memory": reading.used_bytes,
        "maxmemory": reading.max_bytes,
        "maxmemory_policy": reading.policy,
        "used_fraction": reading.used_fraction,
        "headroom_bytes": reading.headroom_bytes,
        "producers_refused": producers_refused(reading),
    }


# ---------------------------------------------------------------------------------------------
# Text


def format_status(status: ModelStatus, *, redis_url: str | None = None) -> str:
    """Render the status as the readable report ``redbatch status`` prints."""
    where = f" at {redis_url}" if redis_url else ""
    lines = [f"model {status.model!r}, prefix {status.prefix!r}{where}"]
    lines += [*_format_memory(status.memory), ""]
    lines += _format_requests(status.requests)
    lines.append("")
    lines += _format_dead(status.dead)
    lines.append("")
    lines += _format_workers(status)
    return "\n".join(map(printable, lines))


def _format_memory(reading: MemoryReading | None) -> list[str]:
    if reading is None:
        return [f"Redis memory {INFO_REFUSED}"]
    notes = [f"  {note}" for note in memory_notes(reading)]
    return [f"Redis memory: {memory_summary(reading)}", *notes]


def _format_requests(req: RequestsInfo) -> list[str]:
    lines = [f"Requests stream {req.key}"]
    if not req.exists:
        return [*lines, "  no requests stream yet (no request sent and no worker started)"]
    oldest = (
        "" if req.oldest_entry_age_s is None else f", oldest entry {ago(req.oldest_entry_age_s)}"
    )
    lines.append(f"  backlog (XLEN): {req.backlog}{oldest}")
    group = req.group
    if group is None:
        return [*lines, f"  no consumer group {keys.CONSUMER_GROUP!r} yet (no worker has started)"]
    lag = "unknown" if group.lag is None else str(group.lag)
    lines.append(
        f"  group {group.name!r}: pending {group.pending}, lag {lag}, "
        f"last delivered {group.last_delivered_id}"
    )
    if not group.consumers:
        return [*lines, "  no consumers yet"]
    rows = [["CONSUMER", "PENDING", "IDLE"]]
    rows += [[c.name, str(c.pending), duration(c.idle_ms / 1000.0)] for c in group.consumers]
    return lines + table(rows, indent="  ", right=frozenset({1, 2}))


def _format_dead(dead: DeadLetters) -> list[str]:
    lines = [f"Dead letters {dead.key}: {dead.count}"]
    if dead.recent:
        rows = [["ENTRY", "AGE", "RID", "REASON"]]
        rows += [[d.entry_id, ago(d.age_s), d.rid or "-", d.reason] for d in dead.recent]
        lines += table(rows, indent="  ")
    return lines


def _format_workers(status: ModelStatus) -> list[str]:
    now = status.observed_at
    lines = [f"Workers: {len(status.workers)} live"]
    if status.expired_workers:
        lines.append(
            f"  removed {len(status.expired_workers)} expired from the registry: "
            + ", ".join(status.expired_workers)
        )
    if not status.workers:
        return [*lines, "  no live worker has registered for this model"]
    rows = [
        [
            "NAME",
            "STATE",
            "VERSION",
            "SHA256",
            "PROVIDERS",
            "BATCH",
            "ORT",
            "HOST:PID",
            "STARTED",
            "HEARTBEAT",
            "SERVED",
        ]
    ]
    for w in status.workers:
        providers = w.get("runtime", "providers") or []
        served_req, served_batches = w.get("served", "requests"), w.get("served", "batches")
        rows.append(
            [
                w.name,
                show(w.get("state")),
                show(w.get("model", "version")),
                show(w.get("model", "sha256"))[:12],
                ",".join(str(p).removesuffix("ExecutionProvider") for p in providers) or "-",
                f"{show(w.get('batching', 'max_batch_size'))} rows/"
                f"{show(w.get('batching', 'max_wait_ms'))} ms",
                show(w.get("runtime", "onnxruntime")),
                f"{show(w.get('host'))}:{show(w.get('pid'))}",
                ago_or_dash(_iso_age_s(w.get("started_at"), now)),
                ago_or_dash(_iso_age_s(w.get("heartbeat_at"), now)),
                f"{show(served_req)} req/{show(served_batches)} batches",
            ]
        )
    lines += table(rows, indent="  ")
    for w in status.workers:
        lines.append(f"  {w.name}:")
        if w.get("error"):
            lines.append(f"    {w.get('error')}")
        lines += [f"    {line}" for line in record_lines(w.record)]
    return lines
