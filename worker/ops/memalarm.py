"""One log line when Redis passes ``maxmemory`` and one when it is back under: the operator's
cue that producers are refused and that the replies of a drained backlog hold the memory."""

from __future__ import annotations

import logging

from producer.protocol.units import format_bytes
from producer.redisio.memory import MemoryReading
from worker.answer.pressure import CEILING, COMPACT_TTL_S

__all__ = ["MemoryAlarm"]

log = logging.getLogger(__name__)


class MemoryAlarm:
    """Watches the heartbeat's memory readings; logs the crossings of ``maxmemory`` only."""

    def __init__(self) -> None:
        self.past = False

    def seen(self, reading: MemoryReading | None) -> None:
        """Take one reading (None: INFO refused, nothing known)."""
        if reading is None or not reading.limited:
            return
        past = reading.used_bytes > reading.max_bytes
        if past == self.past:
            return
        self.past = past
        used, limit = format_bytes(reading.used_bytes), format_bytes(reading.max_bytes)
        if past:
            log.warning(
                "Redis is past maxmemory (used_memory %s of %s): producers are refused and "
                "writes outside the workers' scripts fail; workers keep draining, and the "
                "replies they write hold memory until read or reply_ttl_s (error replies "
                "only %d s, and they wait while Redis is past %.2fx maxmemory) "
                "(docs/operations.md, 'A full Redis')",
                used,
                limit,
                COMPACT_TTL_S,
                CEILING,
            )
        else:
            log.warning("Redis is back under maxmemory (used_memory %s of %s)", used, limit)
