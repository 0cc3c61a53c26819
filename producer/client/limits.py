"""The largest request body a client may send, with no I/O: ``BodyLimit`` refuses a body over
it with ``TooLarge`` before anything is sent.

Two limits bound a body, and the client learns both itself:

- Redis's ``proto-max-bulk-len`` (``CONFIG GET``, read once per client; Redis's default of
  512 MiB when the user may not run it). Redis answers a longer bulk string by closing the
  connection, so every command sharing it is lost and the client would take it for an outage
  (30 s of retries, then ``RedisUnavailable`` for every call on that connection).
- The smallest ``limits.max_request_bytes`` among the model's live workers' records (read with
  them, again every ``REFRESH_S``), which would answer ``TOO_LARGE`` after a round trip.

The check on the hot path is a ``len()`` against a number kept here. The plans
(``producer.client.sending``) read the limits when ``due`` says so; until a first reading, every
call reads them (so a call made at once cannot slip through), after it one call at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from producer.client.submission import Submission
from producer.protocol.errors import TooLarge
from producer.protocol.units import format_bytes
from producer.redisio.bulklimit import REDIS_DEFAULT_BULK_BYTES

__all__ = ["REFRESH_S", "BodyLimit"]

#: How often the workers' ``max_request_bytes`` is read again (a worker with a smaller limit
#: may join; until then the worker itself answers TOO_LARGE).
REFRESH_S = 30.0


@dataclass(frozen=True, slots=True)
class _Bound:
    """One limit on a body: its bytes, what sets it, what exceeding it would do, the fix."""

    max_bytes: int
    source: str
    effect: str
    fix: str


class BodyLimit:
    """The tightest known bound on a request body, and the refusal of one over it.

    Shared by a client's calls; each update replaces whole values, so threads and tasks may
    share it without a lock (a lost update costs one extra reading, never a wrong refusal).
    """

    def __init__(self, where: str) -> None:
        self._where = where
        self._bulk: _Bound | None = None  # None until read
        self._workers: _Bound | None = None  # None: no live worker told its limit
        self._bound = self._default_bulk(read=False)
        self.max_bytes = self._bound.max_bytes
        self._due_at = float("-inf")  # monotonic

    def due(self, now: float) -> bool:
        """True when a submit should read the limits first (see ``reading``)."""
        return now >= self._due_at

    def reading(self, now: float) -> bool:
        """Note a reading starting at ``now``; True when it must read the bulk limit too. Once
        one is known, the next reading is due ``REFRESH_S`` from now, so that concurrent calls
        do not all read; before that, each call reads until one has succeeded."""
        if self._bulk is not None:
            self._due_at = now + REFRESH_S
        return self._bulk is None

    def bulk_seen(self, max_bytes: int | None) -> None:
        """Take ``proto-max-bulk-len`` as read (None: the user may not read it)."""
        if max_bytes is None:
            self._bulk = self._default_bulk(read=True)
        else:
            self._bulk = _Bound(
                max_bytes,
                f"Redis's proto-max-bulk-len ({format_bytes(max_bytes)}) at {self._where}",
                "Redis would close the connection on it, failing every command sharing it",
                "or raise proto-max-bulk-len in the Redis configuration (docs/security.md)",
            )
        self._update()

    def workers_seen(self, records: Iterable[Mapping[str, Any]], now: float) -> None:
        """Take the smallest ``limits.max_request_bytes`` of the live workers' records, read at
        ``now`` (monotonic)."""
        limits = []
        for record in records:
            section = record.get("limits")
            value = section.get("max_request_bytes") if isinstance(section, dict) else None
            if type(value) is int and value >= 1:
                limits.append(value)
        self._workers = None
        if limits:
            smallest = min(limits)
            self._workers = _Bound(
                smallest,
                f"limits.max_request_bytes={smallest} ({format_bytes(smallest)}) of the "
                f"model's live workers (the smallest of {len(limits)})",
                "a worker would answer it TOO_LARGE",
                "or raise limits.max_request_bytes in the workers' config",
            )
        self._due_at = now + REFRESH_S
        self._update()

    def check(self, subs: Sequence[Submission]) -> None:
        """Raise ``TooLarge`` for the first of ``subs`` whose body is over the limit: then none
        of them is sent."""
        limit = self.max_bytes
        for i, sub in enumerate(subs):
            if len(sub.body) > limit:
                raise self._refusal(subs, i)

    def message(self, size: int) -> str:
        """Why a body of ``size`` bytes is refused, and the fix (for a request not sent)."""
        bound = self._bound
        return (
            f"the request body is {size} bytes ({format_bytes(size)}), over "
            f"{bound.source}: {bound.effect}. Send fewer rows per request (map() splits its "
            f"requests itself), {bound.fix}."
        )

    def _refusal(self, subs: Sequence[Submission], i: int) -> TooLarge:
        sub = subs[i]
        message = f"{self.message(len(sub.body))} Nothing was sent."
        if len(subs) > 1:
            over = sum(1 for each in subs if len(each.body) > self.max_bytes)
            more = f" (and {over - 1} more)" if over > 1 else ""
            message = (
                f"submit_many's request at index {i}{more}: {self.message(len(sub.body))} "
                f"None of the {len(subs)} requests was sent."
            )
        return TooLarge(sub.rid, "TOO_LARGE", message, False)

    def _default_bulk(self, *, read: bool) -> _Bound:
        why = "Redis refused CONFIG GET, so its default is assumed" if read else "not read yet"
        return _Bound(
            REDIS_DEFAULT_BULK_BYTES,
            f"Redis's default proto-max-bulk-len ({format_bytes(REDIS_DEFAULT_BULK_BYTES)}; {why}) "
            f"at {self._where}",
            "Redis would close the connection on it, failing every command sharing it",
            "or raise proto-max-bulk-len in the Redis configuration (docs/security.md)",
        )

    def _update(self) -> None:
        bounds = [b for b in (self._bulk, self._workers) if b is not None] or [self._bound]
        self._bound = min(bounds, key=lambda b: b.max_bytes)
        self.max_bytes = self._bound.max_bytes
