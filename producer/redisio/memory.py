"""Redis memory as producers and operators see it: readings, the high watermark, and the gate.

Under ``maxmemory`` with ``noeviction`` a full Redis refuses every write that may grow memory.
Workers finish requests with scripts flagged ``allow-oom`` (each deletes the requests it
answers), so they keep draining; producers must stop first, or nothing frees memory (contract
section 4). A producer therefore refuses new work once ``used_memory`` reaches a high
watermark, a fraction of ``maxmemory`` (``DEFAULT_HIGH_WATERMARK``), which leaves the workers'
replies room.

Pure logic, no I/O: the shells send ``INFO memory`` when ``MemoryWatch.stale`` says so (at most
once per ``MAX_AGE_S``, sooner when the client has sent a quarter of the headroom since the last
reading), hand the text to ``MemoryWatch.seen``, and ask ``MemoryWatch.check`` before a submit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import redis.exceptions as rex

from producer.protocol.errors import RedisFull

__all__ = [
    "DEFAULT_HIGH_WATERMARK",
    "MAX_AGE_S",
    "MemoryReading",
    "MemoryWatch",
    "check_watermark",
    "fuller",
    "info_memory",
    "info_memory_async",
    "parse_info_memory",
]

log = logging.getLogger(__name__)

#: Producers stop at this fraction of ``maxmemory``: the rest is the workers' room to answer.
DEFAULT_HIGH_WATERMARK = 0.8
#: The longest a reading is trusted: producers read ``INFO memory`` about once a second at most.
MAX_AGE_S = 1.0
#: A reading is stale once the client has sent this share of the room left below the watermark.
_SENT_SHARE = 0.25


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """``used_memory`` and ``maxmemory`` in bytes (``maxmemory`` 0: no limit), and the policy."""

    used_bytes: int
    max_bytes: int
    policy: str

    @property
    def limited(self) -> bool:
        """True when Redis has a ``maxmemory`` and refuses writes past it (``noeviction``)."""
        return self.max_bytes > 0 and self.policy == "noeviction"

    @property
    def used_fraction(self) -> float | None:
        """``used_memory / maxmemory``; None without a limit."""
        return self.used_bytes / self.max_bytes if self.max_bytes > 0 else None

    @property
    def headroom_bytes(self) -> int | None:
        """Bytes left before ``maxmemory`` (negative past it); None without a limit."""
        return self.max_bytes - self.used_bytes if self.max_bytes > 0 else None


def fuller(a: MemoryReading | None, b: MemoryReading | None) -> MemoryReading | None:
    """The reading with less headroom (on a cluster each shard's node has its own memory)."""
    if a is None or b is None:
        return a or b
    return b if (b.used_fraction or 0.0) > (a.used_fraction or 0.0) else a


def parse_info_memory(text: bytes | str | dict[str, object]) -> MemoryReading:
    """A reading from ``INFO memory``, as raw text or as redis-py's parsed dict; ValueError
    when it lacks ``used_memory``."""
    if isinstance(text, dict):
        fields = {str(k): str(v) for k, v in text.items()}
    else:
        raw = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        fields = dict(
            line.split(":", 1) for line in raw.splitlines() if ":" in line and line[:1] != "#"
        )
    try:
        used = int(fields["used_memory"])
    except (KeyError, ValueError) as exc:
        raise ValueError("INFO memory did not report used_memory") from exc
    maxmemory = fields.get("maxmemory", "0").strip()
    policy = fields.get("maxmemory_policy", "noeviction").strip()
    return MemoryReading(used, int(maxmemory) if maxmemory.isdigit() else 0, policy)


def info_memory(client: Any) -> Any:
    """``INFO memory`` on a redis-py client; None when this user may not run INFO (an ACL
    without ``+info``): the watermark is then off, with one warning."""
    try:
        return client.info("memory")
    except rex.NoPermissionError as exc:
        _warn_unreadable(exc)
        return None


async def info_memory_async(client: Any) -> Any:
    """``info_memory`` on a ``redis.asyncio`` client."""
    try:
        return await client.info("memory")
    except rex.NoPermissionError as exc:
        _warn_unreadable(exc)
        return None


def _warn_unreadable(exc: Exception) -> None:
    log.warning(
        "Redis refused INFO (%s): the producers' memory high watermark is off, and only "
        "Redis's own OOM refusal (RedisFull) stops submits on a full Redis. Grant the "
        "producer user +info (docs/security.md).",
        exc,
    )


def check_watermark(watermark: float | None) -> float | None:
    """``watermark``, when it is None (off) or a fraction in (0, 1]; else ValueError."""
    if watermark is None:
        return None
    if isinstance(watermark, bool) or not isinstance(watermark, int | float):
        raise ValueError(
            f"memory_high_watermark must be a fraction of maxmemory in (0, 1] or None (off), "
            f"got {watermark!r}."
        )
    if not 0 < watermark <= 1:  # NaN fails this too
        raise ValueError(
            f"memory_high_watermark must be a fraction of maxmemory in (0, 1] or None (off), "
            f"got {watermark!r}."
        )
    return float(watermark)


class MemoryWatch:
    """One client's last reading of Redis memory, and whether a submit may go ahead.

    ``where`` names the Redis in errors. Shared by a client's calls; its state is a few numbers,
    updated whole, so threads and tasks may share it without a lock (a lost update costs one
    extra ``INFO``, never a wrong refusal).
    """

    def __init__(self, where: str, watermark: float | None = DEFAULT_HIGH_WATERMARK) -> None:
        self.where = where
        self.watermark = check_watermark(watermark)
        self.reading: MemoryReading | None = None
        self.unreadable = False  # INFO refused (ACL): only Redis's own OOM refusal is left
        self._read_at = float("-inf")  # monotonic
        self._sent_bytes = 0  # bytes submitted since the reading

    @property
    def active(self) -> bool:
        """False when the watermark is off, or INFO cannot be read."""
        return self.watermark is not None and not self.unreadable

    def stale(self, now: float) -> bool:
        """True when the next submit should read ``INFO memory`` first."""
        if not self.active:
            return False
        if now - self._read_at >= MAX_AGE_S or self.reading is None:
            return True
        room = self._room_bytes(self.reading)
        return room is not None and self._sent_bytes >= max(room, 0) * _SENT_SHARE

    def seen(self, reading: MemoryReading, now: float) -> None:
        """Take a fresh reading made at ``now`` (monotonic)."""
        self.reading, self._read_at, self._sent_bytes = reading, now, 0

    def tightest(self, readings: list[MemoryReading]) -> MemoryReading:
        """Of several shards' readings (on a cluster, each master has its own memory), the one
        with the least room below the watermark: a submit may go to any of them."""

        def room(reading: MemoryReading) -> float:
            left = self._room_bytes(reading)
            return float("inf") if left is None else float(left)

        return min(readings, key=room)

    def cannot_read(self) -> None:
        """INFO is refused to this user: stop asking; an OOM refusal is still ``RedisFull``."""
        self.unreadable = True

    def sent(self, nbytes: int) -> None:
        """Count bytes submitted since the reading."""
        self._sent_bytes += nbytes

    def full(self) -> RedisFull | None:
        """The error to refuse a submit with, or None when there is room (or no limit). A
        refusal makes the reading stale, so that a submit waiting for room reads again."""
        reading = self.reading
        if not self.active or reading is None or not reading.limited:
            return None
        room = self._room_bytes(reading)
        if room is None or room > 0:
            return None
        self._read_at = float("-inf")  # a submit that waits for room reads memory again
        return RedisFull(self.where, reading.used_bytes, reading.max_bytes, self.watermark)

    def refused(self, message: str) -> RedisFull:
        """The error for Redis's own ``OOM`` refusal of a submit; the reading is marked full so
        that a waiting submit reads memory again before its next try."""
        self._read_at = float("-inf")
        reading = self.reading
        used = reading.used_bytes if reading else None
        maxmemory = reading.max_bytes if reading else None
        return RedisFull(self.where, used, maxmemory, self.watermark, refused=message)

    def _room_bytes(self, reading: MemoryReading) -> int | None:
        """Bytes left below the watermark; None without a limit or watermark."""
        if self.watermark is None or not reading.limited:
            return None
        return int(reading.max_bytes * self.watermark) - reading.used_bytes
