"""Retrying Redis calls through outages, with one log line per outage rather than per retry."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential_jitter

# Unreachable, loading, out of memory (noeviction), busy with a script, TRYAGAIN: worth a retry.
# A wrong password or a missing permission is not: no retry can fix it, so the worker stops
# with the error instead of waiting forever. One definition for the client and the worker.
from producer.redisio.retry import is_oom, is_transient
from worker.events import NO_EVENTS, Events

__all__ = ["OutageRetry", "is_transient"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class OutageRetry:
    """Runs calls that retry with capped, jittered backoff while Redis is unreachable.

    ``give_up`` is checked between tries: when it is set (a shutdown), the last error is raised.
    ``what`` names the task in the log line and in ``events.redis_down``, once per outage.
    """

    def __init__(
        self,
        what: str,
        give_up: threading.Event | None = None,
        max_wait_s: float = 2.0,
        events: Events = NO_EVENTS,
        on_retry: Callable[[BaseException], object] | None = None,
    ):
        self.what = what
        self.on_retry = on_retry  # told of each transient failure (a cluster redirect to follow)
        self.events = events
        self.give_up = give_up
        self.max_wait_s = max_wait_s
        self._down = False
        self.interrupted = False  # set when a call failed transiently; the caller resets it

    def call(self, fn: Callable[[], T]) -> T:
        if not self._down:
            try:
                return fn()  # the hot path skips building a tenacity loop per call
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self.interrupted = True
                self._told(exc)
        retrying = Retrying(
            retry=retry_if_exception(is_transient),
            wait=wait_exponential_jitter(multiplier=0.05, max=self.max_wait_s, jitter=0.1),
            stop=self._should_stop,
            before_sleep=self._note_down,
            reraise=True,
        )
        result = retrying(fn)
        if self._down:
            self._down = False
            log.warning("Redis reachable again; %s resumed", self.what)
        return result

    def _should_stop(self, state: RetryCallState) -> bool:
        return self.give_up is not None and self.give_up.is_set()

    def _told(self, exc: BaseException) -> None:
        if self.on_retry is not None:
            try:
                self.on_retry(exc)
            except Exception as failed:  # following a redirect is best effort: retries go on
                log.debug("following %s failed: %s", type(exc).__name__, failed)

    def _note_down(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if exc is not None:
            self._told(exc)
        if not self._down:
            self._down = True
            self.events.redis_down(self.what)
            exc = state.outcome.exception() if state.outcome else None
            if exc is not None and is_oom(exc):
                log.warning(
                    "Redis is full (maxmemory) during %s (%s); retrying with backoff",
                    self.what,
                    exc,
                )
            else:
                log.warning(
                    "Redis unreachable during %s (%s); retrying with backoff", self.what, exc
                )
