"""Lane watch: a new lane is learnt within a fraction of a second, not at the next heartbeat.

The heartbeat (every 5 s) reads each shard's lane set and serves the lanes it lists
(``worker.intake.lanes``). A caller whose first request opens a lane would wait for that beat,
up to 5 s. This thread asks each served shard for its lane set's size (``SCARD``, one small
command per shard) every ``lane_watch_ms`` and, when a size changed, has the heartbeat beat at
once (``Registry.beat_soon``), so lanes are still read and checked in one place, on one thread.

A lane set is untrusted (``worker.intake.laneset``). A set past ``4 x max_lanes`` members holds
junk (lanes the worker would not read anyway), and a producer who keeps adding junk must not make
the worker read it twice a second: above that size a change waits for the heartbeat. A worker
whose ACL user lacks ``SCARD`` says so once and learns lanes at the heartbeat.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from producer.protocol.lanes import lanes_key
from producer.redisio.topology import Topology

__all__ = ["LaneWatch"]

log = logging.getLogger(__name__)

_JUNK_FACTOR = 4  # a set past this many times max_lanes waits for the heartbeat


class LaneWatch(threading.Thread):
    """Polls the served shards' lane set sizes; calls ``on_change`` when one changed."""

    def __init__(
        self,
        topology: Topology,
        prefix: str,
        tags: Callable[[], list[str]],
        on_change: Callable[[], None],
        stop: threading.Event,
        *,
        interval_s: float,
        max_lanes: int,
    ) -> None:
        super().__init__(name="redbatch-lanewatch", daemon=True)
        self.topology = topology
        self.prefix = prefix
        self.tags = tags
        self.on_change = on_change
        self.stop = stop
        self.interval_s = interval_s
        self.most = _JUNK_FACTOR * max_lanes
        self.sizes: dict[str, int] = {}  # by shard tag, as last seen
        self._refused: set[str] = set()  # shards whose SCARD the ACL refused (said once)
        self.triggered = 0  # beats asked for (tests, the log)

    def run(self) -> None:
        while not self.stop.wait(self.interval_s):
            if self.poll():
                self.triggered += 1
                self.on_change()

    def poll(self) -> bool:
        """Read every served shard's lane set size; True when one changed and is small enough
        to read at once. A shard Redis cannot answer for now is skipped (the heartbeat rides
        out outages and says so)."""
        changed = False
        for tag in self.tags():
            if tag in self._refused:
                continue
            size = self._size(tag)
            if size is None:
                continue
            before = self.sizes.get(tag)
            self.sizes[tag] = size
            if before is not None and size != before and size <= self.most:
                changed = True
        return changed

    def _size(self, tag: str) -> int | None:
        key = lanes_key(self.prefix, tag)
        try:
            return int(self.topology.client(tag).scard(key))
        except redis.exceptions.NoPermissionError as exc:
            self._refused.add(tag)
            log.warning(
                "Redis refused SCARD of %s (%s): new lanes there are learnt at the heartbeat "
                "(up to 5 s) until the worker's ACL user gets +scard on %s:{*}:lanes "
                "(docs/security.md)",
                key,
                exc,
                self.prefix,
            )
        except (redis.RedisError, OSError):
            pass  # an outage: the heartbeat says so, and the next poll tries again
        return None
