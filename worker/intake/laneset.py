"""Lane discovery: which lanes of each served shard to read, from its lane set, and the weights.

Producers list the lane streams they send to in ``P:{T}:lanes`` (contract section 7), and a
producer role confined to its tenant may write that set, so its members are untrusted: a member
that ``parse_lane`` does not accept for the shard it is listed in (another shard's stream, a key
that is no request stream, a malformed name) is ignored, and at most ``max_lanes`` lanes are read
per shard, the shard's default lane ``P:{T}:requests`` included (the others sorted high first,
then normal, then low, then by name: the bound keeps the higher classes). Junk is logged when
new junk appears (a count and a few examples, not a line per member: a set may hold 100,000),
and once when a shard's set first holds more lanes than the bound. Junk costs one ``SMEMBERS``
per shard and heartbeat, nothing more.

A member is read only once its stream exists: a tenant's ACL role lets it create streams of its
own lanes alone, but it may write any name into the set, so only existing streams count toward
the bound, and names of streams that do not exist cannot push real lanes out. Each beat looks
for the stream (``TYPE``, pipelined a thousand at a time) of every name it has not looked for
before, and looks again for ``RECHECK_PER_BEAT`` of the names it found without one, the least
recently looked for first (a lane whose name was listed before its first request). So junk costs
a worker what it cost the producer who wrote it, once; a flood of 100,000 names costs the first
beat after it about a hundred round trips, and never stops or delays the lanes already served or
a new lane's discovery, except a lane whose name was written before its stream existed: that
one is found within (names without a stream) / ``RECHECK_PER_BEAT`` beats. Members are parsed
once per shard and remembered while they stay in the set.

Tenant weights (``P:{M}:weights``) are read on the same beat: integers from 1 to 1,000,000 by
tenant name; anything else is ignored and logged once per (tenant, value).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Any

import redis

from producer.protocol.lanes import (
    CLASSES,
    Lane,
    is_valid_tenant,
    lanes_key,
    parse_lane,
    weights_key,
)

__all__ = ["LaneSets", "Weights", "lane_order"]

log = logging.getLogger(__name__)

_EXAMPLES = 3  # junk members named in a log line
_SEEN_MOST = 1024  # junk weights remembered for logging once
#: Names found without a stream that are looked for again per beat (the longest unseen first).
RECHECK_PER_BEAT = 1024
_PIPELINE = 1000  # TYPE commands per round trip
_ABSENT_MOST = 1_000_000  # names without a stream remembered (about 100 MB at the most)


def lane_order(lane: Lane) -> tuple[int, str, str]:
    """Sort key: class high first, then normal, then low; then by tenant ("" first)."""
    return CLASSES.index(lane.cls), lane.tenant or "", lane.tag


class LaneSets:
    """The lanes to read per shard, from the shards' lane sets."""

    def __init__(self, prefix: str, max_lanes: int) -> None:
        self.prefix = prefix
        self.max_lanes = max_lanes
        # lane stream keys found without a stream, the longest unseen first
        self._absent: OrderedDict[str, None] = OrderedDict()
        self._parsed: dict[str, dict[bytes | str, Lane | None]] = {}  # per shard, by member
        self._junk: dict[str, int] = {}  # per shard: junk members at the last log line
        self._over: set[str] = set()  # shards whose set is over the bound, said once
        self._refused: set[str] = set()  # shards whose set the ACL refused, said once

    def read(
        self, client: redis.Redis, tag: str, served: Collection[str] = ()
    ) -> list[Lane] | None:
        """Shard ``tag``'s lanes other than its default one whose streams exist (``served``:
        the lane stream keys read now, known to), at most ``max_lanes - 1``; None when the
        worker may not read the set (said once: it then serves the default lane)."""
        key = lanes_key(self.prefix, tag)
        try:
            members: Any = client.smembers(key)
        except redis.exceptions.NoPermissionError as exc:
            if tag not in self._refused:
                self._refused.add(tag)
                log.warning(
                    "Redis refused reading the lane set %s (%s): this worker serves only %s "
                    "until its ACL user gets (%%R~%s:{*}:lanes +smembers) (docs/security.md)",
                    key,
                    exc,
                    Lane(tag).stream(self.prefix),
                    self.prefix,
                )
            return None
        self._refused.discard(tag)
        listed = self.select(tag, members, bound=False)
        return self._bounded(tag, self._existing(client, listed, served))

    def _existing(
        self, client: redis.Redis, lanes: list[Lane], served: Collection[str]
    ) -> list[Lane]:
        """``lanes`` (sorted) whose streams exist: those served, and those a ``TYPE`` finds a
        stream among the names never looked for and the ``RECHECK_PER_BEAT`` least recently
        looked for of those found without one."""
        keys = [lane.stream(self.prefix) for lane in lanes]
        unserved = [k for k in keys if k not in served]
        new = [k for k in unserved if k not in self._absent]
        listed = set(unserved)
        again = list(itertools.islice((k for k in self._absent if k in listed), RECHECK_PER_BEAT))
        found = self._streams(client, [*new, *again])
        return [
            lane for lane, key in zip(lanes, keys, strict=True) if key in served or key in found
        ]

    def _streams(self, client: redis.Redis, names: list[str]) -> set[str]:
        """Which of ``names`` hold a stream; the others are remembered as absent (last)."""
        found: set[str] = set()
        for start in range(0, len(names), _PIPELINE):
            chunk = names[start : start + _PIPELINE]
            pipe = client.pipeline(transaction=False)
            for key in chunk:
                pipe.type(key)
            for key, kind in zip(chunk, pipe.execute(), strict=True):
                if _text(kind) == "stream":
                    found.add(key)
                    self._absent.pop(key, None)
                else:  # none yet, or another type (junk): looked for again in its turn
                    self._absent[key] = None
                    self._absent.move_to_end(key)
        while len(self._absent) > _ABSENT_MOST:
            self._absent.popitem(last=False)
        return found

    def select(self, tag: str, members: Iterable[bytes | str], bound: bool = True) -> list[Lane]:
        """The lanes among ``members`` to read for shard ``tag``, sorted (and bounded)."""
        lanes: set[Lane] = set()
        junk: list[bytes | str] = []
        before = self._parsed.get(tag, {})
        parsed: dict[bytes | str, Lane | None] = {}
        for member in members:
            lane = before[member] if member in before else parse_lane(self.prefix, tag, member)
            parsed[member] = lane
            if lane is None:
                junk.append(member)
            elif not lane.is_default:  # the default lane is always read, listed or not
                lanes.add(lane)
        self._parsed[tag] = parsed
        self._say_junk(tag, junk)
        ordered = sorted(lanes, key=lane_order)
        return self._bounded(tag, ordered) if bound else ordered

    def _bounded(self, tag: str, ordered: list[Lane]) -> list[Lane]:
        """The first ``max_lanes - 1`` of ``ordered``; going over the bound is said once."""
        room = max(self.max_lanes - 1, 0)
        if len(ordered) > room:
            if tag not in self._over:
                self._over.add(tag)
                log.warning(
                    "the lane set %s lists %d lanes; a worker reads at most %d per shard "
                    "(scheduling.max_lanes, the default lane included): ignoring %d, from %s",
                    lanes_key(self.prefix, tag),
                    len(ordered),
                    self.max_lanes,
                    len(ordered) - room,
                    ordered[room].stream(self.prefix),
                )
            return ordered[:room]
        self._over.discard(tag)
        return ordered

    def _say_junk(self, tag: str, junk: list[bytes | str]) -> None:
        """Log when the set holds more junk than at the last line; forget it once it is gone."""
        if len(junk) <= self._junk.get(tag, 0):
            if not junk:
                self._junk.pop(tag, None)
            return
        self._junk[tag] = len(junk)
        shown = ", ".join(repr(_text(m)[:120]) for m in junk[:_EXAMPLES])
        log.warning(
            "ignoring %d members of the lane set %s that name no lane stream of shard %s "
            "(e.g. %s): a producer wrote them; SREM them",
            len(junk),
            lanes_key(self.prefix, tag),
            tag,
            shown,
        )


class Weights:
    """Tenant weights from ``P:{M}:weights``: positive integers, junk ignored and said once."""

    def __init__(self) -> None:
        self._said: set[tuple[str, str]] = set()
        self._refused = False

    def read(self, client: redis.Redis, prefix: str, model: str) -> dict[str, int] | None:
        """The weights in ``P:{M}:weights``; None when the ACL refuses the read (said once:
        every tenant then weighs 1)."""
        key = weights_key(prefix, model)
        try:
            raw: Any = client.hgetall(key)
        except redis.exceptions.NoPermissionError as exc:
            if not self._refused:
                self._refused = True
                log.warning(
                    "Redis refused reading the tenant weights %s (%s): every tenant weighs 1 "
                    "until the worker's ACL user gets (%%R~%s:{*}:weights +hgetall) "
                    "(docs/security.md)",
                    key,
                    exc,
                    prefix,
                )
            return None
        self._refused = False
        return self.parse(raw)

    def parse(self, raw: dict[Any, Any]) -> dict[str, int]:
        weights: dict[str, int] = {}
        for name, value in raw.items():
            tenant, text = _text(name), _text(value)
            weight = _positive(text)
            if weight is not None and is_valid_tenant(tenant):
                weights[tenant] = weight
            elif (tenant, text) not in self._said and len(self._said) < _SEEN_MOST:
                self._said.add((tenant, text))
                log.warning(
                    "ignoring weight %r of tenant %r: a weight is a positive integer and a "
                    "tenant matches [A-Za-z0-9_-]{1,64}; HSET it again",
                    text[:64],
                    tenant[:64],
                )
        return weights


def _positive(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value <= 1_000_000 else None


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
