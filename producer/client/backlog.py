"""The backlog gate: from ``XLEN`` and Redis memory, a submit goes ahead, fails, or waits."""

from __future__ import annotations

from producer.protocol.errors import BacklogFull, RedisFull

__all__ = ["FIRST_BACKOFF_S", "MAX_BACKOFF_S", "BacklogGate"]

#: Backoff while waiting for the backlog to shrink; Redis has no event for a stream shrinking.
FIRST_BACKOFF_S = 0.005
MAX_BACKOFF_S = 0.2


class BacklogGate:
    """Decides from the stream's length, and from Redis memory, whether a submit goes ahead,
    fails, or waits.

    One gate serves one submit call: its backoff starts at ``FIRST_BACKOFF_S`` and doubles up to
    ``MAX_BACKOFF_S``, because Redis has no event that fires when a stream shrinks or memory
    frees. ``until`` (monotonic) bounds the wait: an ``infer`` waits no longer than its
    ``timeout_s``, and then gets the ``BacklogFull`` or ``RedisFull`` a submit that does not
    wait gets at once (nothing was sent).
    """

    def __init__(self, max_backlog: int | None, wait: bool, until: float | None = None) -> None:
        self.max_backlog = max_backlog
        self.wait = wait
        self.until = until
        self._next_delay_s = FIRST_BACKOFF_S

    @property
    def active(self) -> bool:
        """False when there is no limit, so no XLEN is needed."""
        return self.max_backlog is not None

    def delay_s(self, backlog: int, now: float) -> float | None:
        """None: go ahead. A number: sleep that long, then ask again. Raises BacklogFull when
        not waiting, or once ``now`` (monotonic) reaches ``until``."""
        if self.max_backlog is None or backlog < self.max_backlog:
            return None
        if not self.wait or (self.until is not None and now >= self.until):
            raise BacklogFull(backlog, self.max_backlog, waited=self.wait)
        return self._backoff_s(now)

    def refused(self, full: RedisFull, now: float) -> float:
        """How long to sleep before looking again at a Redis too full to submit to; raises
        ``full`` when not waiting, or once ``now`` reaches ``until``."""
        if not self.wait:
            raise full
        if self.until is not None and now >= self.until:
            raise full.waited_out()
        return self._backoff_s(now)

    def _backoff_s(self, now: float) -> float:
        delay = self._next_delay_s
        self._next_delay_s = min(delay * 2, MAX_BACKOFF_S)
        return delay if self.until is None else min(delay, self.until - now)
