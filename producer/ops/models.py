"""Every model a Redis holds, one line each: what ``redbatch status`` shows without ``--model``.

A model is known by its keys (docs/protocol.md, section 1): a request stream ``P:{M}:requests`` or
``P:{M~K}:requests``, a dead-letter stream, a shard list ``P:{M}:shards`` or a live worker's
record ``P:{M}:worker:NAME``. ``find_models`` looks for them with ``SCAN`` (``MATCH`` on the
prefix, ``TYPE`` so that reply lists and cancel keys stay on the server), on every master of a
Redis Cluster, each key pattern at most ``MAX_SCAN_CALLS`` calls of ``SCAN_COUNT`` keys a node:
a Redis of millions of reply keys costs a bounded few seconds, and a list cut short says so.
``gather_models`` then reads each model as ``redbatch status --model`` does (its shards, each
on its own node: backlog, pending, dead letters, the stream damage that blocks a queue) and
counts its live workers from the records found. A lane stream (``P:{T}:requests:C[:N]``,
contract section 7) belongs to its shard's model: its backlog counts in that model's line,
never as a model of its own.

``SCAN`` is the one command here that the operator's other commands never send: a user whose
ACL lacks it gets a ``UsageError`` naming the permission and ``--model``, which needs none.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from producer.ops.damage import DamageNote
from producer.ops.lanes import classes
from producer.ops.lanetotals import shard_lanes
from producer.ops.status import ShardAccess, gather_shard
from producer.ops.textformat import ago_or_dash, printable, table
from producer.ops.words import count
from producer.protocol import keys
from producer.protocol.errors import UsageError
from producer.protocol.lanes import CLASSES, parse_lane
from producer.redisio.shards import read_shards

__all__ = [
    "MAX_SCAN_CALLS",
    "SCAN_COUNT",
    "Found",
    "ModelSummary",
    "Overview",
    "find_live_models",
    "find_models",
    "format_overview",
    "gather_models",
    "overview_to_json",
]

#: Keys a ``SCAN`` call looks at (a hint to Redis), and the calls a pattern may take on a node.
SCAN_COUNT = 1000
MAX_SCAN_CALLS = 1000

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


@dataclass(frozen=True, slots=True)
class Found:
    """What the scans found: model names, live worker records per model, and whether a scan
    stopped at its bound before the end of a node's keys."""

    models: frozenset[str]
    workers: dict[str, int] = field(default_factory=dict)
    complete: bool = True


@dataclass(frozen=True, slots=True)
class ModelSummary:
    """One model's line: shards served (retiring ones included), backlog and pending summed
    over them, live workers, dead letters, the oldest entry's age, and the stream damage seen."""

    model: str
    shards: int
    retiring: int
    backlog: int
    pending: int
    workers: int
    dead: int
    oldest_entry_age_s: float | None
    damage: tuple[DamageNote, ...] = ()
    classes: tuple[tuple[str, int], ...] = ()  # (class, backlog) over every lane, high first

    @property
    def blocked(self) -> bool:
        """True when a stream of the model is blocked now (``DamageNote.blocking``)."""
        return any(note.blocking for note in self.damage)


@dataclass(frozen=True, slots=True)
class Overview:
    """Every model found, by name; ``complete`` is False when a scan stopped at its bound."""

    prefix: str
    models: tuple[ModelSummary, ...]
    complete: bool = True
    cluster: bool = False


# ---------------------------------------------------------------------------------------------
# Finding the models


def _patterns(prefix: str) -> list[tuple[str, str]]:
    """(MATCH pattern, TYPE) pairs: streams (requests, dead letters), shard lists, records."""
    p = _GLOB_SPECIAL.sub(r"\\\1", prefix)
    return [
        (f"{p}:{{*}}:*", "stream"),
        (f"{p}:{{*}}:shards", "list"),
        (f"{p}:{{*}}:worker:*", "string"),
    ]


def _scan(client: redis.Redis, match: str, kind: str, cursor: int) -> tuple[int, list[Any]]:
    try:
        return client.scan(cursor, match=match, count=SCAN_COUNT, _type=kind)  # type: ignore[no-any-return]
    except redis.exceptions.NoPermissionError as exc:
        raise UsageError(
            f"Listing the models needs SCAN, which this Redis user may not run ({exc}): grant "
            "it +scan (docs/security.md), or name the model with --model NAME."
        ) from exc


def _keys_of(access: ShardAccess, client: redis.Redis, match: str, kind: str) -> Iterator[Any]:
    """The keys ``match`` and ``kind`` find on ``client``'s node; stops after
    ``MAX_SCAN_CALLS`` calls by raising ``_CutShort`` after the last key."""
    cursor, calls = 0, 0
    while True:
        cursor, found = access.retry.call(_scan, client, match, kind, cursor)
        calls += 1
        yield from found
        if int(cursor) == 0:
            return
        if calls >= MAX_SCAN_CALLS:
            raise _CutShort


class _CutShort(Exception):
    """A scan reached its bound before the end of the node's keys."""


def find_models(access: ShardAccess, conn: redis.Redis, prefix: str) -> Found:
    """Scan every node (each master of a cluster; the one Redis else) for the keys a model
    leaves; the caller has refreshed ``access``'s slot map."""
    key_re = re.compile(
        re.escape(prefix) + r":\{([^{}]+)\}:(requests(?::.+)?|dead|shards|worker:.+)\Z"
    )
    models: set[str] = set()
    workers: dict[str, int] = {}
    complete = True
    for client in _node_clients(access, conn):
        try:
            for match, kind in _patterns(prefix):
                try:
                    for raw in _keys_of(access, client, match, kind):
                        _take(prefix, key_re, raw, models, workers)
                except _CutShort:
                    complete = False
        finally:
            if client is not conn:
                client.close()
                client.connection_pool.disconnect()
    return Found(frozenset(models), workers, complete)


def _take(
    prefix: str, key_re: re.Pattern[str], raw: Any, models: set[str], workers: dict[str, int]
) -> None:
    """Note the model a key names (a key of another layout is skipped); a lane stream
    (``P:{T}:requests:C[:N]``) names its shard's model, never a model of its own."""
    key = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    m = key_re.match(key)
    if m is None or not keys.is_valid_tag(m[1]):
        return
    tag, rest = m[1], m[2]
    model = keys.model_of(tag)
    if rest.startswith("worker:"):
        if tag != model or not keys.is_valid_name(rest[len("worker:") :]):
            return
        workers[model] = workers.get(model, 0) + 1
    elif rest == "shards" and tag != model:
        return
    elif rest.startswith("requests:") and parse_lane(prefix, tag, key) is None:
        return  # a key that only looks like a lane stream of the shard
    models.add(model)


def _node_clients(access: ShardAccess, conn: redis.Redis) -> list[redis.Redis]:
    """One client per master of a cluster, made from ``conn``'s settings; ``conn`` itself on a
    single Redis."""
    if not access.cluster:
        return [conn]
    pool = conn.connection_pool
    clients = []
    for node in access.topology.slots.masters():
        kwargs = {**pool.connection_kwargs, "host": node.host, "port": node.port}
        made = redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
        clients.append(redis.Redis(connection_pool=made))
    return clients


def find_live_models(conn: redis.Redis, prefix: str) -> Found | None:
    """The models under ``prefix`` and their live workers, without retries: what ``redbatch
    run`` lists when pointed at a model nobody serves; None when this user may not ``SCAN``
    (a producer's role need not) or Redis fails meanwhile."""
    access = ShardAccess(conn, 0.0)
    try:
        access.refresh()
        return find_models(access, conn, prefix)
    except (UsageError, redis.RedisError):
        return None
    finally:
        access.close()


# ---------------------------------------------------------------------------------------------
# Reading each model


def gather_models(
    conn: redis.Redis,
    prefix: str = keys.DEFAULT_PREFIX,
    *,
    retry_s: float = 0.0,
    now_s: float | None = None,
) -> Overview:
    """Find every model under ``prefix`` and read each one's summary, retrying through an
    outage for up to ``retry_s``; raises ``UsageError`` when ``SCAN`` is refused."""
    now = time.time() if now_s is None else now_s
    access = ShardAccess(conn, retry_s)
    try:
        access.refresh()
        found = find_models(access, conn, prefix)
        models = tuple(
            _summary(access, prefix, model, found.workers.get(model, 0), now)
            for model in sorted(found.models)
        )
    finally:
        access.close()
    return Overview(prefix, models, found.complete, access.cluster)


def _summary(
    access: ShardAccess, prefix: str, model: str, workers: int, now_s: float
) -> ModelSummary:
    shards = access.on(model, read_shards, prefix, model)
    parts = [
        gather_shard(access, prefix, tag, now_s, 0, retiring=tag in shards.retiring)
        for tag in shards.serve
    ]
    lanes = [ln for p in parts for ln in shard_lanes(p) if ln.exists]
    ages = [ln.oldest_entry_age_s for ln in lanes if ln.oldest_entry_age_s is not None]
    return ModelSummary(
        model=model,
        shards=len(parts),
        retiring=len(shards.retiring),
        backlog=sum(ln.backlog for ln in lanes),
        pending=sum(ln.pending or 0 for ln in lanes),
        workers=workers,
        dead=sum(p.dead.count for p in parts),
        oldest_entry_age_s=max(ages) if ages else None,
        damage=tuple(note for p in parts for note in p.damage),
        classes=tuple((c.cls, c.backlog) for c in classes(lanes)),
    )


# ---------------------------------------------------------------------------------------------
# Reports


def overview_to_json(overview: Overview) -> list[dict[str, Any]]:
    """The overview as a JSON list, one object per model."""
    return [
        {
            "model": m.model,
            "shards": m.shards,
            "retiring": m.retiring,
            "backlog": m.backlog,
            "pending": m.pending,
            "workers": m.workers,
            "dead": m.dead,
            "oldest_entry_age_s": m.oldest_entry_age_s,
            "classes": {cls: dict(m.classes).get(cls, 0) for cls in CLASSES},
            "blocked": m.blocked,
            "damage": [
                {"kind": n.kind, "stream": n.stream, "blocking": n.blocking} for n in m.damage
            ],
        }
        for m in overview.models
    ]


def format_overview(overview: Overview, where: str | None = None) -> str:
    """The overview as a person reads it: a title, a row per model, what needs a look."""
    at = f" at {where}" if where else ""
    cut = (
        []
        if overview.complete
        else [
            f"!! the list may be incomplete: a scan stopped after {MAX_SCAN_CALLS * SCAN_COUNT:,} "
            "keys of a node; name a model with --model"
        ]
    )
    if not overview.models:
        empty = (
            f"no models{at}, prefix {overview.prefix!r}: no request stream, shard list or worker "
            f"record under {overview.prefix}:{{MODEL}}: (workers with another prefix: --prefix)"
        )
        return "\n".join(map(printable, [empty, *cut]))
    rows = [["MODEL", "SHARDS", "BACKLOG", "PENDING", "WORKERS", "DEAD", "OLDEST"]]
    for m in overview.models:
        shards = str(m.shards) + (f" ({m.retiring} retiring)" if m.retiring else "")
        rows.append(
            [
                m.model,
                shards,
                f"{m.backlog:,}",
                f"{m.pending:,}",
                f"{m.workers:,}",
                f"{m.dead:,}",
                ago_or_dash(m.oldest_entry_age_s),
            ]
        )
    title = f"{count(len(overview.models), 'model')}{at}, prefix {overview.prefix!r}"
    lines = [title, *table(rows, indent="  ", right=frozenset({1, 2, 3, 4, 5}))]
    for m in overview.models:
        lines += [
            f"!! {m.model}: {note.kind} {note.stream}"
            + (" blocks the queue" if note.blocking else "")
            + f"; redbatch status --model {m.model} says how to repair it"
            for note in m.damage
        ]
    lines += cut
    lines.append("redbatch status --model NAME shows one model in full")
    return "\n".join(map(printable, lines))
