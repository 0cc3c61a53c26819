"""Redis memory as the answering path sees it: when error replies go compact, and when they wait.

The finish script may write past ``maxmemory`` (``allow-oom``: a full Redis must still drain), and
a reply key costs several times the tiny stream entry it replaces, so a flood of malformed
requests answered with error replies once took Redis to 4.9x ``maxmemory`` (``FACTS.md``).
Two bounds keep error replies within a stated margin (contract section 4, v3):

- from ``COMPACT_FROM`` x ``maxmemory`` on, error replies are compact (no ``meta`` echo, the
  message cut to ``COMPACT_MESSAGE_CHARS``) and expire after ``COMPACT_TTL_S``, so that what a
  flood leaves is soon gone, and producers (refused from 0.8x) are admitted again;
- from ``CEILING`` x ``maxmemory`` on, a batch holding only error replies waits (the writer,
  ``worker.answer.writer``) until memory falls below it, at most ``HOLD_MAX_S``, so a Redis held
  full by something else never stops the queue. A batch with any ok reply is never held.

Readings are taken here, on whichever thread asks, at most every ``_AGE_S`` per shard; a Redis
without ``maxmemory`` (or with an evicting policy) is asked again only every ``_UNLIMITED_AGE_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import redis

from producer.protocol.units import format_bytes
from producer.redisio.memory import MemoryReading, parse_info_memory
from worker.errors import Rejected

__all__ = [
    "CEILING",
    "COMPACT_FROM",
    "COMPACT_MESSAGE_CHARS",
    "COMPACT_TTL_S",
    "HOLD_MAX_S",
    "MemoryPressure",
    "compact_error",
    "compact_ttl",
]

log = logging.getLogger(__name__)

#: Error replies are compact and short-lived from this fraction of ``maxmemory`` on: below the
#: producers' high watermark (0.8), so that what they hold never keeps producers out for long.
COMPACT_FROM = 0.5
COMPACT_TTL_S = 15
COMPACT_MESSAGE_CHARS = 160
#: Error-only batches wait while ``used_memory`` is at or above this fraction of ``maxmemory``.
CEILING = 1.25
#: The longest one batch waits: by then every compact reply written before it has expired, so a
#: Redis still past the ceiling is held full by something else, and the batch is written.
HOLD_MAX_S = float(COMPACT_TTL_S)
_AGE_S = 0.1  # a reading is used this long, per shard
_UNLIMITED_AGE_S = 10.0  # ... and this long when Redis has no maxmemory with noeviction
_RETRY_S = 1.0  # after a failed reading, the last one is used this long


class MemoryPressure:
    """Per shard, the last ``INFO memory`` reading of its Redis. ``client_of(tag)`` is the
    shard's client; None (no Redis to ask, as in unit tests) means no pressure."""

    def __init__(self, client_of: Callable[[str], redis.Redis | None]) -> None:
        self.client_of = client_of
        self._readings: dict[str, tuple[float, MemoryReading | None]] = {}
        self._refused = False  # INFO refused (an ACL without +info): no readings, no pressure
        self._holding = False  # the last hold found memory above the ceiling (logged once)

    def reading(self, tag: str) -> MemoryReading | None:
        """Shard ``tag``'s Redis memory, fresh enough; None when unknown."""
        now = time.monotonic()
        taken, last = self._readings.get(tag, (float("-inf"), None))
        age = _AGE_S if last is None or last.limited else _UNLIMITED_AGE_S
        if now - taken < age or self._refused:
            return last
        client = self.client_of(tag)
        try:
            reading = None if client is None else self._read(client)
        except (redis.RedisError, ValueError):  # an outage: the writes wait it out anyway
            self._readings[tag] = (now + _RETRY_S, last)  # ask again in a while, not per reply
            return last
        self._readings[tag] = (now, reading)
        return reading

    def compact(self, tag: str) -> bool:
        """Whether error replies to shard ``tag`` are written compact and short-lived now."""
        return self._fraction(tag) >= COMPACT_FROM

    def over_ceiling(self, tags: Iterable[str]) -> MemoryReading | None:
        """The reading of a shard among ``tags`` at or above the ceiling, or None."""
        for tag in set(tags):
            if self._fraction(tag) >= CEILING:
                return self.reading(tag)
        return None

    def hold(
        self,
        tags: Iterable[str],
        *stops: threading.Event,
        release: Callable[[], bool] | None = None,
    ) -> float:
        """Wait while a shard in ``tags`` is at or above the ceiling, at most ``HOLD_MAX_S``,
        until one of ``stops`` is set or ``release()`` is true; returns the seconds waited."""
        tags = list(tags)
        reading = self.over_ceiling(tags)
        if reading is None:
            self._holding = False
            return 0.0
        if not self._holding:  # once per spell above the ceiling, not per batch
            self._holding = True
            log.warning(
                "Redis memory is at %s, past %.2fx its maxmemory of %s: batches of only error "
                "replies wait (at most %.0f s each) until it falls (docs/operations.md, 'A "
                "full Redis')",
                format_bytes(reading.used_bytes),
                CEILING,
                format_bytes(reading.max_bytes),
                HOLD_MAX_S,
            )
        started = time.monotonic()
        pause_s = 0.02
        while reading is not None and time.monotonic() - started < HOLD_MAX_S:
            if _wait_any(stops, pause_s) or (release is not None and release()):
                break
            pause_s = min(pause_s * 2, 0.5)
            reading = self.over_ceiling(tags)
        return time.monotonic() - started

    def _fraction(self, tag: str) -> float:
        reading = self.reading(tag)
        if reading is None or not reading.limited:
            return 0.0
        return reading.used_bytes / reading.max_bytes

    def _read(self, client: redis.Redis) -> MemoryReading | None:
        try:
            return parse_info_memory(client.info("memory"))
        except redis.exceptions.NoPermissionError as exc:
            self._refused = True
            log.warning(
                "Redis refused INFO memory (%s): error replies cannot be kept within a margin "
                "over maxmemory. Grant the worker's user +info (docs/security.md)",
                exc,
            )
        return None


def _wait_any(stops: tuple[threading.Event, ...], seconds: float) -> bool:
    """Wait ``seconds`` on the first of ``stops``; whether any of them is set."""
    if stops:
        stops[0].wait(seconds)
    else:
        time.sleep(seconds)
    return any(stop.is_set() for stop in stops)


def compact_error(error: Rejected) -> Rejected:
    """``error`` with its message cut short, for a compact reply."""
    if len(error.message) <= COMPACT_MESSAGE_CHARS:
        return error
    message = error.message[: COMPACT_MESSAGE_CHARS - 3] + "..."
    return Rejected(error.code, message, retryable=error.retryable)


def compact_ttl(requested_s: int | None) -> int:
    """A compact reply's TTL: the request's own when shorter still."""
    return min(requested_s, COMPACT_TTL_S) if requested_s else COMPACT_TTL_S
