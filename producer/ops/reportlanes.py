"""Lanes and classes in ``redbatch status`` and its ``--watch`` view: a compact line of backlog
per class (each class's oldest entry: how long its head has waited, the queue wait now), a
table of lanes when a shard has more than its default lane, tenants summed over shards, notes
on lane sets that hold junk or cannot be read, and the same as JSON values. Every text line
fits 80 columns (``producer.ops.words.fit`` folds the rest where the caller applies it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from producer.ops.lanes import MAX_LANES, ClassSummary, LaneStatus, classes, tenants
from producer.ops.lanetotals import has_lanes, model_lanes, shard_lanes
from producer.ops.status import ModelStatus, ShardStatus
from producer.ops.textformat import duration, narrow_table
from producer.ops.words import count, under

__all__ = [
    "WATCH_ROWS",
    "class_line",
    "classes_json",
    "lane_notes",
    "lane_table",
    "lanes_json",
    "tenant_table",
    "tenants_json",
]

#: Lanes the watch view lists at most (the report lists all).
WATCH_ROWS = 12


# ---------------------------------------------------------------------------------------------
# JSON


def lanes_json(shard: ShardStatus) -> list[dict[str, Any]]:
    """Every lane of ``shard``, its default lane first."""
    return [_lane_json(ln) for ln in shard_lanes(shard)]


def _lane_json(ln: LaneStatus) -> dict[str, Any]:
    return {
        "key": ln.key,
        "class": ln.lane.cls,
        "tenant": ln.lane.tenant,
        "exists": ln.exists,
        "backlog": ln.backlog,
        "pending": ln.pending,
        "oldest_entry_age_s": ln.oldest_entry_age_s,
    }


def classes_json(status: ModelStatus) -> dict[str, dict[str, Any]]:
    """Each class over every lane and shard: lanes, backlog, pending, oldest entry's age."""
    return {c.cls: _summary_json(c) for c in classes(model_lanes(status))}


def _summary_json(c: ClassSummary) -> dict[str, Any]:
    return {
        "lanes": c.lanes,
        "backlog": c.backlog,
        "pending": c.pending,
        "oldest_entry_age_s": c.oldest_entry_age_s,
    }


def tenants_json(status: ModelStatus) -> list[dict[str, Any]]:
    """Each tenant of each class over every shard."""
    return [
        {
            "tenant": t.tenant,
            "class": t.cls,
            "backlog": t.backlog,
            "pending": t.pending,
            "oldest_entry_age_s": t.oldest_entry_age_s,
        }
        for t in tenants(model_lanes(status))
    ]


# ---------------------------------------------------------------------------------------------
# Text


def class_line(
    status: ModelStatus, label: str, when: Callable[[float], str] = duration
) -> list[str]:
    """``label`` then each class's backlog and its oldest entry's age, folded under the label:
    ``high 12 (oldest 3.0 s), normal 0, low 1,000,000 (oldest 2.0 h)``."""
    parts = []
    for c in classes(model_lanes(status)):
        oldest = "" if c.oldest_entry_age_s is None else f" (oldest {when(c.oldest_entry_age_s)})"
        parts.append(f"{c.cls} {c.backlog:,}{oldest}")
    return under(label, ", ".join(parts))


def lane_table(
    status: ModelStatus, *, title: str, held: str = "PENDING", limit: int | None = None
) -> list[str]:
    """A row per lane of every shard (defaults included), when any shard has more than its
    default lane; none otherwise. ``limit`` rows at most, then how many more there are."""
    if not has_lanes(status):
        return []
    lanes = model_lanes(status)
    shown = lanes if limit is None else lanes[:limit]
    rows = [["LANE", "CLASS", "BACKLOG", held, "OLDEST"]]
    for ln in shown:
        rows.append(
            [
                ln.key,
                ln.lane.cls,
                f"{ln.backlog:,}" if ln.exists else "-",
                "-" if ln.pending is None else f"{_held(ln, clamp=held != 'PENDING'):,}",
                "-" if ln.oldest_entry_age_s is None else duration(ln.oldest_entry_age_s),
            ]
        )
    lines = [title, *narrow_table(rows, indent="  ", right=frozenset({2, 3, 4}))]
    if len(shown) < len(lanes):
        lines.append(f"  and {count(len(lanes) - len(shown), 'more lane')} (--json lists all)")
    return lines


def _held(ln: LaneStatus, *, clamp: bool) -> int:
    """Pending entries; clamped to the backlog in the live view, where XLEN and XINFO GROUPS
    are read a moment apart (an entry answered between them is counted as held)."""
    pending = ln.pending or 0
    return min(pending, ln.backlog) if clamp else pending


def tenant_table(status: ModelStatus) -> list[str]:
    """With several shards: each tenant's lanes summed over them (one shard: the lane table
    says it already)."""
    found = tenants(model_lanes(status))
    if len(status.shards) < 2 or not found:
        return []
    rows = [["TENANT", "CLASS", "BACKLOG", "PENDING", "OLDEST"]]
    for t in found:
        oldest = "-" if t.oldest_entry_age_s is None else duration(t.oldest_entry_age_s)
        rows.append([t.tenant, t.cls, f"{t.backlog:,}", f"{t.pending:,}", oldest])
    title = "Tenants, over all shards (weights: HGETALL P:{M}:weights)"
    return [title, *narrow_table(rows, indent="  ", right=frozenset({2, 3, 4}))]


def lane_notes(status: ModelStatus, indent: str = "  ") -> list[str]:
    """What a lane set holds that workers skip, or that this user may not read it."""
    lines = []
    for shard in status.shards:
        read = shard.lanes
        where = f"{status.prefix}:{{{shard.tag}}}:lanes"
        if read.refused:
            lines.append(
                f"{indent}lanes of {shard.tag} unknown: this user may not read {where} or its "
                "lane streams (grant them as docs/security.md's operator role does)"
            )
        if read.ignored:
            lines.append(
                f"{indent}{where}: {count(read.ignored, 'member')} ignored (not lane streams "
                "of this shard; workers skip them too)"
            )
        if read.over:
            lines.append(
                f"{indent}{where}: {count(read.over, 'lane')} past the bound not shown "
                f"(workers read at most [scheduling] max_lanes, {MAX_LANES} by default, the "
                "default lane included)"
            )
    return lines
