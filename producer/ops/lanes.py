"""A shard's lanes as ``redbatch status`` sees them: which lanes its lane set lists, and each
one's backlog, pending entries and oldest entry (how long the head of that lane has waited: its
queue wait now). Contract section 7: backlog is reported per lane and per class.

The lane set ``P:{T}:lanes`` is written by producers, so it may hold junk: members are kept as a
worker keeps them (``pick_lanes``: only lane streams of this shard that ``parse_lane`` accepts,
at most ``MAX_LANES`` with the default one, high first, then normal, then low, then by name),
so status shows what workers serve. ``read_lanes`` reads them in one round trip per shard
(a pipeline: every key has the shard's tag, so one node answers). The shard's own
``P:{T}:requests`` (the default lane) is read by ``producer.ops.status`` as before, not here.

``classes`` and ``tenants`` sum a model's lanes (the default lanes included) over its shards.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from producer.ops.damage import DamageNote
from producer.ops.entries import entry_age_s, redis_text
from producer.protocol import keys
from producer.protocol.lanes import CLASSES, Lane, lanes_key, parse_lane

__all__ = [
    "MAX_LANES",
    "ClassSummary",
    "LaneRead",
    "LaneStatus",
    "TenantSummary",
    "classes",
    "pick_lanes",
    "read_lanes",
    "tenants",
]

#: Lanes read per shard, the default lane included: the workers' ``[scheduling] max_lanes``
#: default (``worker.intake.laneset``, which this mirrors: producer never imports worker).
MAX_LANES = 64

_RANK = {cls: i for i, cls in enumerate(CLASSES)}


@dataclass(frozen=True, slots=True)
class LaneStatus:
    """One lane stream: its backlog (XLEN), what the ``workers`` group holds (None: no group
    yet), and its oldest entry's age (None: empty)."""

    lane: Lane
    key: str
    exists: bool
    backlog: int
    pending: int | None
    oldest_entry_age_s: float | None


@dataclass(frozen=True, slots=True)
class LaneRead:
    """A shard's lanes besides the default; ``ignored``: lane set members that are not lane
    streams of the shard, ``over``: lanes past ``MAX_LANES``, ``refused``: this user may not
    read the lane set (an ACL without it: the lanes are unknown, not absent)."""

    lanes: tuple[LaneStatus, ...] = ()
    ignored: int = 0
    over: int = 0
    refused: bool = False
    damage: tuple[DamageNote, ...] = ()


@dataclass(frozen=True, slots=True)
class ClassSummary:
    """One class over every shard: its backlog, pending entries and oldest entry's age."""

    cls: str
    lanes: int
    backlog: int
    pending: int
    oldest_entry_age_s: float | None


@dataclass(frozen=True, slots=True)
class TenantSummary:
    """One tenant's lanes of one class over every shard."""

    tenant: str
    cls: str
    backlog: int
    pending: int
    oldest_entry_age_s: float | None


def pick_lanes(
    prefix: str, tag: str, members: Iterable[Any], limit: int = MAX_LANES
) -> tuple[list[Lane], int, int]:
    """The lanes a worker reads from shard ``tag``'s lane set ``members``: (lanes, junk
    members, lanes over the bound). The default lane is never among them (it is always read,
    and counts toward ``limit``, so at most ``limit - 1`` come from the set)."""
    lanes, junk = set(), 0
    for member in members:
        lane = parse_lane(prefix, tag, member)
        if lane is None or lane.is_default:
            junk += lane is None
            continue
        lanes.add(lane)
    ordered = sorted(lanes, key=lambda ln: (_RANK[ln.cls], ln.tenant or ""))
    room = max(limit - 1, 0)
    return ordered[:room], junk, max(len(ordered) - room, 0)


def read_lanes(conn: redis.Redis, prefix: str, tag: str, now_s: float) -> LaneRead:
    """Shard ``tag``'s lanes and what each holds, from the node that serves the shard."""
    try:
        members = conn.smembers(lanes_key(prefix, tag))
    except redis.exceptions.NoPermissionError:
        return LaneRead(refused=True)
    lanes, ignored, over = pick_lanes(prefix, tag, members)
    if not lanes:
        return LaneRead((), ignored, over)
    pipe = conn.pipeline(transaction=False)
    for lane in lanes:
        key = lane.stream(prefix)
        pipe.type(key)
        pipe.xlen(key)
        pipe.xrange(key, "-", "+", count=1)
        pipe.xinfo_groups(key)
    replies = pipe.execute(raise_on_error=False)
    if any(isinstance(r, redis.exceptions.NoPermissionError) for r in replies):
        return LaneRead((), ignored, over, refused=True)
    found, damage = [], []
    for i, lane in enumerate(lanes):
        kind, length, head, groups = replies[4 * i : 4 * i + 4]
        key = lane.stream(prefix)
        if redis_text(kind) not in ("stream", "none"):
            damage.append(_wrong_type(key, redis_text(kind)))
        found.append(
            _lane_status(lane, key, redis_text(kind) == "stream", length, head, groups, now_s)
        )
    return LaneRead(tuple(found), ignored, over, damage=tuple(damage))


def _lane_status(
    lane: Lane, key: str, exists: bool, length: Any, head: Any, groups: Any, now_s: float
) -> LaneStatus:
    if not exists:
        return LaneStatus(lane, key, False, 0, None, None)
    backlog = length if isinstance(length, int) else 0
    oldest = None
    if isinstance(head, list) and head:
        oldest = entry_age_s(redis_text(head[0][0]), now_s)
    pending = None
    for group in groups if isinstance(groups, list) else []:
        if redis_text(group.get("name")) == keys.CONSUMER_GROUP:
            pending = int(group.get("pending") or 0)
    return LaneStatus(lane, key, True, backlog, pending, oldest)


def _wrong_type(key: str, kind: str) -> DamageNote:
    return DamageNote(
        "wrong_type",
        key,
        None,
        f"the lane key holds a {kind}, not a stream: nothing can be queued in this lane until "
        "it is renamed or deleted (after saving what it holds)",
    )


# ---------------------------------------------------------------------------------------------
# Sums


def classes(lanes: Sequence[LaneStatus]) -> tuple[ClassSummary, ...]:
    """Every class, highest first, summed over ``lanes`` (a class without lanes: zeros)."""
    out = []
    for cls in CLASSES:
        mine = [ln for ln in lanes if ln.lane.cls == cls and ln.exists]
        out.append(
            ClassSummary(
                cls,
                len(mine),
                sum(ln.backlog for ln in mine),
                sum(ln.pending or 0 for ln in mine),
                _oldest(mine),
            )
        )
    return tuple(out)


def tenants(lanes: Sequence[LaneStatus]) -> tuple[TenantSummary, ...]:
    """Each (class, tenant) that has a lane, summed over shards: class order, then name."""
    groups: dict[tuple[str, str], list[LaneStatus]] = {}
    for ln in lanes:
        if ln.lane.tenant is not None:
            groups.setdefault((ln.lane.cls, ln.lane.tenant), []).append(ln)
    return tuple(
        TenantSummary(
            tenant,
            cls,
            sum(ln.backlog for ln in mine),
            sum(ln.pending or 0 for ln in mine),
            _oldest(mine),
        )
        for (cls, tenant), mine in sorted(
            groups.items(), key=lambda kv: (_RANK[kv[0][0]], kv[0][1])
        )
    )


def _oldest(lanes: Sequence[LaneStatus]) -> float | None:
    ages = [ln.oldest_entry_age_s for ln in lanes if ln.oldest_entry_age_s is not None]
    return max(ages) if ages else None
