"""The consumer group of one shard's request stream: creating it, recreating it, sampling it.

Workers create the ``workers`` group at 0 when it is missing, so requests sent before any
worker existed are served, and recreate it when it disappears under them (a Redis restarted
without persistence, a ``FLUSHALL``, an operator's ``DEL`` of the stream or ``XGROUP
DESTROY``). The heartbeat samples each stream here for metrics, the log and ``status``.

Damage under the workers is noticed here, logged once per incident and kept in ``damage`` for
the worker's record (docs/operations.md, "A damaged stream"). Measured on Redis 7.0: a trim
(``XADD ... MAXLEN``, ``XTRIM``) leaves the group's ``entries-read`` and the stream's
``entries-added`` as they were, so ``entries-added - entries-read - length`` is the number of
undelivered entries deleted (at least); a null ``lag`` is no sign of it, as acknowledgements out
of order make it null too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import redis

from producer.protocol.keys import CONSUMER_GROUP
from producer.redisio.memory import MemoryReading, parse_info_memory
from producer.redisio.streaminfo import MAX_ID, REPAIR, is_exhausted, undelivered_lost
from worker.events import NO_EVENTS, Events

__all__ = ["StreamGroup", "StreamStats", "merged"]

log = logging.getLogger(__name__)

_DAMAGE_KEPT = 10  # the newest damage notes a stream keeps for the worker's record

# XGROUP CREATE grows memory, so a full Redis refuses it outside a script flagged allow-oom,
# even when the group exists (BUSYGROUP comes after the memory check): a worker started on a
# full Redis would never get past start-up.
_ENSURE_GROUP_LUA = """#!lua flags=allow-oom
local made = redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
if type(made) == 'table' and made.err then
  if string.sub(made.err, 1, 9) == 'BUSYGROUP' then return 0 end
  return made
end
return 1
"""


@dataclass(frozen=True, slots=True)
class StreamStats:
    """The request stream as the group sees it, and Redis memory (None when INFO is refused)."""

    backlog: int
    pending: int
    lag: int | None
    dead: int
    oldest_ms: int | None = None  # the oldest entry's enqueue time, epoch ms
    memory: MemoryReading | None = None
    added: int | None = None  # entries-added: what ever entered the stream (None: unknown)


def _memory(info: Any) -> MemoryReading | None:
    """A reading from INFO memory's answer; None when it was refused (an ACL without +info)."""
    if isinstance(info, Exception):
        return None
    try:
        return parse_info_memory(info)
    except ValueError:
        return None


def _oldest_ms(oldest: Any) -> int | None:
    """The enqueue time (epoch ms) of XRANGE's one entry, None when there is none."""
    if not isinstance(oldest, list) or not oldest:
        return None
    entry_id = oldest[0][0]
    return int((entry_id if isinstance(entry_id, bytes) else entry_id.encode()).split(b"-")[0])


class StreamGroup:
    """The ``workers`` group of the stream ``key`` (shard ``tag``), with its dead letters.

    ``damage`` lists what went wrong with the stream under the workers (deleted, trimmed,
    exhausted, group recreated), newest last, for the worker's record; ``events`` hears of each.

    Without ``recreate`` (a lane other than the shard's default one) a stream found gone under
    a read is not made again: a worker removes such a lane once it stayed empty
    (``worker.redisio.lanegc``), and a stream made again here would be listed nowhere, so that
    nothing would ever remove it. ``vanished`` is set instead; the lane stops reading, and is
    served anew once a producer sends to it again (which lists it again).
    """

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        dead_key: str,
        tag: str,
        events: Events = NO_EVENTS,
        *,
        recreate: bool = True,
    ) -> None:
        self.client = client
        self.key = key
        self.dead_key = dead_key
        self.tag = tag
        self.events = events
        self.recreate = recreate
        self.vanished = False  # without ``recreate``: the stream was found gone
        self.damage: list[dict[str, Any]] = []
        self._ensure = client.register_script(_ENSURE_GROUP_LUA)
        self._lost_seen: int | None = None  # undelivered_lost at the last sample
        self._exhausted = False  # the last sample saw the largest id
        self._backlog = 0  # XLEN at the last sample: what a deleted stream lost, at least
        self._added: int | None = None  # entries-added at the last sample

    def ensure(self) -> bool:
        """Create the group at 0 (so earlier requests are served) unless it exists; on a full
        Redis too (a script flagged allow-oom). True when it was created."""
        created = self._ensure(keys=[self.key], args=[CONSUMER_GROUP]) == 1
        if created:
            log.info("created consumer group %s on %s", CONSUMER_GROUP, self.key)
        return created

    def gone(self, exc: redis.ResponseError) -> None:
        """A read's error: recreate the group if it is gone (NOGROUP), or the stream was deleted
        under a blocked read (UNBLOCKED), and report which; raise any other."""
        if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
            raise exc
        if not self.recreate and self._vanished():
            return
        log.warning(
            "stream or consumer group gone on %s (Redis restarted or flushed); recreating it",
            self.key,
        )
        info = self._probe()
        created = self.ensure()
        added = info.get("entries-added") if isinstance(info, dict) else None
        if info is None or (
            self._added is not None and isinstance(added, int) and added < self._added
        ):
            # Gone, or made anew by another worker's recreation since our last sample.
            self._report(
                "deleted",
                self._backlog,
                "Redis restarted without persistence, flushed, or the stream was deleted: the "
                f"{self._backlog} entries it held at the last sample (at least) are lost, "
                "held ones included; producers must resend requests with no reply by their "
                "deadline",
            )
        elif created:
            self._report(
                "group_recreated",
                0,
                f"the consumer group was destroyed and is recreated at 0: the {_length(info)} "
                "entries in the stream are delivered again from the start, so requests workers "
                "held run a second time",
            )
        self._lost_seen = None  # the counters start again
        self._added = added if isinstance(added, int) else None

    def _vanished(self) -> bool:
        """Whether the stream is gone (a lane removed as empty); a lost backlog is reported."""
        if self._probe() is not None:
            return False  # made again by a producer, or only the group is gone: recreate it
        self.vanished = True
        log.info("lane %s is gone (removed as empty); its reads stop", self.key)
        if self._backlog:
            self._report(
                "deleted",
                self._backlog,
                f"the lane's stream was deleted while it held {self._backlog} entries at the "
                "last sample; producers must resend requests with no reply by their deadline",
            )
        return True

    def _probe(self) -> dict[str, Any] | None:
        """XINFO STREAM of the stream (None: there is none); where the ACL refuses it, the
        length alone (XLEN answers 0 for a missing stream too, so an empty one counts as
        deleted)."""
        try:
            info = self.client.xinfo_stream(self.key)
        except redis.exceptions.NoPermissionError:
            length = int(self.client.xlen(self.key))
            return {"length": length} if length else None
        except redis.ResponseError:  # no such key
            return None
        return info if isinstance(info, dict) else None

    def stats(self) -> StreamStats:
        """Backlog, pending and lag of the group, the oldest entry, dead letters and Redis
        memory: one round trip. Damage it shows (a trim, an exhausted id) is reported."""
        pipe = self.client.pipeline(transaction=False)
        # XINFO STREAM before XINFO GROUPS: a read or an ack between them can only make the
        # loss computed from the two look smaller, never invent one.
        pipe.xinfo_stream(self.key)
        pipe.xinfo_groups(self.key)
        pipe.xlen(self.key)  # XINFO STREAM may be refused (an ACL without +xinfo|stream)
        pipe.xlen(self.dead_key)
        pipe.xrange(self.key, "-", "+", count=1)
        pipe.info("memory")
        stream, groups, backlog, dead, oldest, info = pipe.execute(raise_on_error=False)
        group = (
            next(
                (g for g in groups if g.get("name") in (CONSUMER_GROUP, CONSUMER_GROUP.encode())),
                None,
            )
            if isinstance(groups, list)
            else None
        )
        stream = stream if isinstance(stream, dict) else None
        backlog = int(backlog) if isinstance(backlog, int) else 0
        self._check(stream, group, backlog)
        lag = group.get("lag") if group else None
        return StreamStats(
            backlog=backlog,
            pending=int(group["pending"]) if group else 0,
            # Entries not yet read are still in the stream, so lag <= XLEN. Redis 7.0 loses the
            # group's entries-read on an AOF reload and then reports a stale, larger lag.
            lag=None if lag is None else min(int(lag), backlog),
            dead=int(dead) if isinstance(dead, int) else 0,
            oldest_ms=_oldest_ms(oldest),
            memory=_memory(info),
            added=_added(stream),
        )

    def _check(
        self, stream: dict[str, Any] | None, group: dict[str, Any] | None, backlog: int
    ) -> None:
        """Report what this sample shows that the last did not: undelivered entries deleted
        (trimmed), or the largest id reached (exhausted)."""
        lost = undelivered_lost(stream, group)
        seen = self._lost_seen or 0
        if lost is not None and lost > seen:
            since = "" if self._lost_seen is None else " since the last sample"
            self._report(
                "trimmed",
                lost - seen,
                f"undelivered entries were deleted{since} (XTRIM, XADD with MAXLEN or MINID, or "
                "XDEL): no worker will answer them; producers must resend requests with no "
                "reply by their deadline",
            )
        # The count reads low by the held entries still in the stream, so it dips and comes
        # back as they are read and acknowledged: keep the highest, unless nothing is held,
        # when it is exact (and an operator's XGROUP SETID may have cleared it).
        pending = int(group.get("pending") or 0) if group else 0
        self._lost_seen = lost if lost is None or pending == 0 else max(seen, lost)
        exhausted = is_exhausted(stream)
        if exhausted and not self._exhausted:
            self._report(
                "exhausted",
                0,
                f"the stream holds the largest possible id ({MAX_ID}): every XADD * fails, so "
                "producers get StreamExhausted and nothing new is queued until it is repaired",
            )
        self._exhausted = exhausted
        self._backlog = backlog
        added = stream.get("entries-added") if stream else None
        self._added = added if isinstance(added, int) else self._added

    def _report(self, kind: str, lost: int, detail: str) -> None:
        """One damage: a warning, the event (metrics), and a note for the worker's record."""
        log.warning(
            "stream %s damaged (%s): at least %d request%s lost; %s. Repair: %s",
            self.key,
            kind,
            lost,
            "" if lost == 1 else "s",
            detail,
            REPAIR,
        )
        self.events.stream_damaged(self.tag, kind, lost)
        note = {"kind": kind, "stream": self.key, "at": time.time(), "lost": lost, "detail": detail}
        self.damage = [*self.damage, note][-_DAMAGE_KEPT:]


def _length(stream: Any) -> int:
    """XINFO STREAM's length; 0 when the stream is missing or the answer an error."""
    length = stream.get("length") if isinstance(stream, dict) else None
    return int(length) if isinstance(length, int) else 0


def _added(stream: dict[str, Any] | None) -> int | None:
    """XINFO STREAM's entries-added; None when unknown."""
    added = stream.get("entries-added") if stream else None
    return added if isinstance(added, int) else None


def merged(samples: list[StreamStats]) -> StreamStats:
    """One shard's lanes sampled as one stream: backlogs and pending added up, the oldest entry
    of them all (the lanes share the shard's dead letters and Redis)."""
    if len(samples) == 1:
        return samples[0]
    lags = [s.lag for s in samples]
    oldest = [s.oldest_ms for s in samples if s.oldest_ms is not None]
    added = [s.added for s in samples]
    return StreamStats(
        backlog=sum(s.backlog for s in samples),
        pending=sum(s.pending for s in samples),
        lag=None if None in lags else sum(lag for lag in lags if lag is not None),
        dead=max(s.dead for s in samples),
        oldest_ms=min(oldest) if oldest else None,
        memory=next((s.memory for s in samples if s.memory is not None), None),
        added=None if None in added else sum(a for a in added if a is not None),
    )
