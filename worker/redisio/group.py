"""The consumer group of one shard's request stream: creating it, recreating it, sampling it.

Workers create the ``workers`` group at 0 when it is missing, so requests sent before any
worker existed are served, and recreate it when it disappears under them (a Redis restarted
without persistence, a ``FLUSHALL``, an operator's ``DEL`` of the stream or ``XGROUP
DESTROY``). The heartbeat samples each stream here for metrics, the log and ``status``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis

from producer.protocol.keys import CONSUMER_GROUP
from producer.redisio.memory import MemoryReading, parse_info_memory
from worker.events import NO_EVENTS, Events

__all__ = ["StreamGroup", "StreamStats"]

log = logging.getLogger(__name__)

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
    """

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        dead_key: str,
        tag: str,
        events: Events = NO_EVENTS,
    ) -> None:
        self.client = client
        self.key = key
        self.dead_key = dead_key
        self.tag = tag
        self.events = events
        self.damage: list[dict[str, Any]] = []
        self._ensure = client.register_script(_ENSURE_GROUP_LUA)

    def ensure(self) -> bool:
        """Create the group at 0 (so earlier requests are served) unless it exists; on a full
        Redis too (a script flagged allow-oom). True when it was created."""
        created = self._ensure(keys=[self.key], args=[CONSUMER_GROUP]) == 1
        if created:
            log.info("created consumer group %s on %s", CONSUMER_GROUP, self.key)
        return created

    def gone(self, exc: redis.ResponseError) -> None:
        """A read's error: recreate the group if it is gone (NOGROUP), or the stream was deleted
        under a blocked read (UNBLOCKED); raise any other."""
        if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
            raise exc
        log.warning(
            "stream or consumer group gone on %s (Redis restarted or flushed); recreating it",
            self.key,
        )
        self.ensure()

    def stats(self) -> StreamStats:
        """Backlog, pending and lag of the group, the oldest entry, dead letters and Redis
        memory: one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(self.key)
        pipe.xinfo_groups(self.key)
        pipe.xlen(self.dead_key)
        pipe.xrange(self.key, "-", "+", count=1)
        pipe.info("memory")
        backlog, groups, dead, oldest, info = pipe.execute(raise_on_error=False)
        group = (
            next(
                (g for g in groups if g.get("name") in (CONSUMER_GROUP, CONSUMER_GROUP.encode())),
                None,
            )
            if isinstance(groups, list)
            else None
        )
        backlog = int(backlog) if isinstance(backlog, int) else 0
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
        )
