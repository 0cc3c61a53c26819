"""Empty-lane removal: a lane that stayed empty, with nothing pending, leaves its shard's lane set.

Lanes are made by producers (a ``SADD`` of the lane set and an ``XADD`` to the lane, in one
``MULTI``: contract section 7), so a job's or a tenant's lanes would pile up in the set and in
every worker's reads once their traffic is gone. A worker that sees a lane other than the
shard's default one empty (``XLEN`` 0, nothing pending, nothing added since) for
``scheduling.lane_idle_s`` removes it with one script, which checks both again before its
``SREM`` and ``DEL``: the two keys share the shard's slot, so the step is atomic on a cluster
too. A producer's ``MULTI`` after that makes both again; every worker learns the lane at its
next sync and creates the group at 0, so nothing sent meanwhile is lost.

The timer is fed by the heartbeat's samples (``LaneSweeper.seen``): a lane counts as idle from
the first sample that saw it empty with the same ``entries-added`` as the one before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from producer.protocol.keys import CONSUMER_GROUP
from worker.redisio.group import StreamStats

__all__ = ["LaneSweeper", "remove_lane"]

log = logging.getLogger(__name__)

# KEYS: the lane stream, the shard's lane set. Removes the stream only while it is empty with
# nothing pending (a key of another type, or a group whose summary fails, is left alone).
_REMOVE_LUA = """#!lua flags=allow-oom
local stream, lanes, group = KEYS[1], KEYS[2], ARGV[1]
local length = redis.pcall('XLEN', stream)
if type(length) ~= 'number' or length ~= 0 then return 0 end
if redis.call('EXISTS', stream) == 1 then
  local summary = redis.pcall('XPENDING', stream, group)
  if type(summary) == 'table' and summary.err then
    if string.sub(summary.err, 1, 7) ~= 'NOGROUP' then return 0 end
  elseif summary[1] ~= 0 then
    return 0
  end
end
redis.call('SREM', lanes, stream)
redis.call('DEL', stream)
return 1
"""


def remove_lane(client: redis.Redis, stream: str, lanes: str) -> bool:
    """Remove lane ``stream`` from the set ``lanes`` and delete it, if it is still empty with
    nothing pending; True when it was removed."""
    script = client.register_script(_REMOVE_LUA)
    return script(keys=[stream, lanes], args=[CONSUMER_GROUP]) == 1


class LaneSweeper:
    """When each lane became idle (empty, nothing pending, nothing added), by stream key."""

    def __init__(self, idle_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self.clock = clock
        self._since: dict[str, tuple[float, int | None]] = {}  # key: (idle since, entries-added)

    def seen(self, key: str, stats: StreamStats) -> bool:
        """Note a sample of lane ``key``; True once it has been idle for ``idle_s``."""
        if stats.backlog or stats.pending:
            self._since.pop(key, None)
            return False
        now = self.clock()
        since = self._since.get(key)
        if since is None or since[1] != stats.added:
            self._since[key] = (now, stats.added)
            return False
        return now - since[0] >= self.idle_s

    def forget(self, key: str) -> None:
        self._since.pop(key, None)
