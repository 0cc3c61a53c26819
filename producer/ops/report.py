"""``redbatch status`` as a table a person reads (``format_status``) and as plain JSON values
(``status_to_json``), from what ``producer.ops.status`` gathered. Both lead with Redis memory
against ``maxmemory``: past the producers' high watermark new work is refused (``RedisFull``), so
operators must see it come. With one shard the text has no shard table; with more, it adds a
table of shards and a total line. The text fits 80 columns as ``--watch`` does (the workers'
part: ``producer.ops.reportworkers``); the JSON is every field as it is.
"""

from __future__ import annotations

from typing import Any

from producer.ops.damage import damage_json, damage_lines
from producer.ops.lanetotals import has_lanes
from producer.ops.reportlanes import (
    class_line,
    classes_json,
    lane_notes,
    lane_table,
    lanes_json,
    tenant_table,
    tenants_json,
)
from producer.ops.reportworkers import worker_section
from producer.ops.status import DeadLetters, ModelStatus, RequestsInfo, iso_age_s
from producer.ops.textformat import (
    INFO_REFUSED,
    ago,
    duration,
    memory_notes,
    memory_split,
    narrow_table,
    printable,
    producers_refused,
    table,
)
from producer.ops.words import WIDTH, fit
from producer.protocol import keys
from producer.redisio.memory import MemoryReading

__all__ = ["format_status", "status_to_json"]


# ---------------------------------------------------------------------------------------------
# JSON


def status_to_json(status: ModelStatus) -> dict[str, Any]:
    """The status as JSON values: the dataclasses' fields, with each worker's full record;
    ``requests`` and ``dead`` are the totals (``requests``: of the default lanes), ``shards``
    each shard's own with its ``lanes`` (the default first), ``classes`` and ``tenants`` the
    lanes summed by class and by tenant over the shards."""
    return {
        "model": status.model,
        "prefix": status.prefix,
        "observed_at": status.observed_at,
        "cluster": status.cluster,
        "requests": _requests_json(status.requests),
        "dead": _dead_json(status.dead),
        "shards": [
            {
                "tag": s.tag,
                "state": s.state,
                "node": s.node,
                "requests": _requests_json(s.requests),
                "dead": _dead_json(s.dead),
                "lanes": lanes_json(s),
                "lanes_ignored": s.lanes.ignored,
                "lanes_over_bound": s.lanes.over,
                "lanes_refused": s.lanes.refused,
            }
            for s in status.shards
        ],
        "classes": classes_json(status),
        "tenants": tenants_json(status),
        "workers": [
            {
                "name": w.name,
                "ttl_s": w.ttl_s,
                "heartbeat_age_s": iso_age_s(w.get("heartbeat_at"), status.observed_at),
                "record": w.record,
            }
            for w in status.workers
        ],
        "expired_workers": list(status.expired_workers),
        "redis": _memory_json(status.memory, status.memory_node),
        "damage": damage_json(status.damage),
    }


def _requests_json(req: RequestsInfo) -> dict[str, Any]:
    group = req.group
    return {
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
    }


def _dead_json(dead: DeadLetters) -> dict[str, Any]:
    return {
        "key": dead.key,
        "count": dead.count,
        "recent": [
            {
                "entry_id": d.entry_id,
                "rid": d.rid,
                "reason": d.reason,
                "age_s": d.age_s,
                "shard": d.tag or None,
            }
            for d in dead.recent
        ],
    }


def _memory_json(reading: MemoryReading | None, node: str | None = None) -> dict[str, Any] | None:
    if reading is None:
        return None
    return {
        "node": node,
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
    """Render the status as the readable report ``redbatch status`` prints: with one shard its
    stream, group and dead letters; with more, a table of shards and their total first. Every
    line fits 80 columns: long names are cut in the middle in a table's first column (the full
    name is printed elsewhere), long text is folded under its label."""
    where = f" at {redis_url}" if redis_url else ""
    lines = [f"model {status.model!r}, prefix {status.prefix!r}{where}"]
    lines += [*_format_memory(status.memory, status.memory_node), ""]
    damage = damage_lines(status.damage, status.observed_at)
    lines += [*damage, ""] if damage else []
    if len(status.shards) > 1:
        lines += _format_shards(status)
        lines.append("")
        lines += _format_consumers(status.requests)
    else:
        lines += _format_requests(status.requests, other_lanes=has_lanes(status))
    lines.append("")
    lines += _format_lanes(status)
    lines += _format_dead(status.dead, sharded=len(status.shards) > 1)
    lines.append("")
    lines += worker_section(status)
    return "\n".join(fit(map(printable, lines), WIDTH))


def _format_lanes(status: ModelStatus) -> list[str]:
    """Backlog by class on a line; with lanes besides the defaults, a row per lane (and per
    tenant over several shards); what the lane sets hold that workers skip."""
    lines = class_line(status, "Backlog by class: ")
    lines += lane_table(status, title="Lanes (OLDEST: how long the lane's head has waited)")
    lines += tenant_table(status)
    return [*lines, *lane_notes(status), ""]


def _format_shards(status: ModelStatus) -> list[str]:
    """One row per shard and a total: backlog, pending, lag, dead, oldest; on a cluster, the
    master serving each shard on a line under its row."""
    sending = sum(s.state == "send" for s in status.shards)
    retiring = len(status.shards) - sending
    title = f"Shards: {len(status.shards)} ({sending} taking requests"
    title += f", {retiring} retiring: drained, no longer sent to)" if retiring else ")"
    rows = [["SHARD", "STATE", "BACKLOG", "PENDING", "LAG", "DEAD", "OLDEST"]]
    for s in status.shards:
        rows.append([s.tag, s.state, *_shard_cells(s.requests, s.dead)])
    rows.append(["total", "", *_shard_cells(status.requests, status.dead)])
    shown = narrow_table(rows, indent="  ", right=frozenset(range(2, 6)))
    lines = [title, shown[0]]
    for s, row in zip(status.shards, shown[1:], strict=False):
        lines += [row, *([f"    master {s.node or '-'}"] if status.cluster else [])]
    return [*lines, shown[-1]]


def _shard_cells(req: RequestsInfo, dead: DeadLetters) -> list[str]:
    group = req.group
    oldest = "-" if req.oldest_entry_age_s is None else ago(req.oldest_entry_age_s)
    return [
        f"{req.backlog:,}",
        "-" if group is None else f"{group.pending:,}",
        "-" if group is None or group.lag is None else f"{group.lag:,}",
        f"{dead.count:,}",
        oldest,
    ]


def _format_consumers(req: RequestsInfo) -> list[str]:
    """The group's consumers over all shards (a worker is one consumer on each)."""
    group = req.group
    if group is None:
        return [f"Consumers: no consumer group {keys.CONSUMER_GROUP!r} yet (no worker has started)"]
    if not group.consumers:
        return ["Consumers: none yet"]
    lines = [f"Consumers of group {group.name!r}, over all shards"]
    rows = [["CONSUMER", "PENDING", "IDLE"]]
    rows += [[c.name, f"{c.pending:,}", duration(c.idle_ms / 1000.0)] for c in group.consumers]
    return lines + narrow_table(rows, indent="  ", right=frozenset({1, 2}))


def _format_memory(reading: MemoryReading | None, node: str | None = None) -> list[str]:
    """How full Redis is on one line, headroom and policy (or that there is no maxmemory) on
    the next, then what it means for producers."""
    if reading is None:
        return [f"Redis memory {INFO_REFUSED}"]
    notes = [f"  {note}" for note in memory_notes(reading)]
    used, more = memory_split(reading)
    if node:
        return [f"Redis memory (fullest master): {used}", f"  {more}; master {node}", *notes]
    return [f"Redis memory: {used}", f"  {more}", *notes]


def _format_requests(req: RequestsInfo, *, other_lanes: bool = False) -> list[str]:
    lines = [f"Requests stream {req.key}"]
    if not req.exists and other_lanes:
        return [*lines, "  no requests stream yet (requests went to the other lanes below)"]
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
    rows += [[c.name, f"{c.pending:,}", duration(c.idle_ms / 1000.0)] for c in group.consumers]
    return lines + narrow_table(rows, indent="  ", right=frozenset({1, 2}))


def _format_dead(dead: DeadLetters, *, sharded: bool = False) -> list[str]:
    """The count, then a row per recent dead letter (entry, age, rid) with its reason under it
    (and the shard it is on, with several)."""
    if sharded:
        lines = [f"Dead letters: {dead.count:,} over all shards (P:{{T}}:dead)"]
    else:
        lines = [f"Dead letters {dead.key}: {dead.count:,}"]
    if not dead.recent:
        return lines
    rows = [["ENTRY", "AGE", "RID"]]
    rows += [[d.entry_id, ago(d.age_s), d.rid or "-"] for d in dead.recent]
    shown = table(rows, indent="  ")
    lines.append(shown[0])
    for d, row in zip(dead.recent, shown[1:], strict=True):
        where = f"shard {d.tag}: " if sharded else ""
        lines += [row, f"    {where}{d.reason}"]
    return lines
