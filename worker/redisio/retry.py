"""The worker's use of ``producer.redisio.retry.Retrier``: one per task, retrying until shutdown.

A worker task (reading requests, writing replies, starting up) retries every Redis call while
Redis is unreachable, loading, out of memory (noeviction), busy with a script, answering
TRYAGAIN, unable to persist (``MISCONF``) or read-only during a failover, until its ``give_up``
event is set. A missing permission is not retried: no retry can fix it, so the worker stops with
the error instead of waiting forever. Given ``where`` (start-up's, the worker's first contact),
a misconfigured connection (a wrong password, TLS to a plain port or the reverse, a certificate
that does not verify) raises ``Misconfigured`` naming the fix (``producer.redisio.misconfig``).
Each outage is one WARNING when it starts (and one ``events.redis_down``), one when it ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from producer.redisio.misconfig import FirstContact
from producer.redisio.retry import MAX_WAIT_S, Outage, Retrier, is_oom, is_transient
from worker.events import NO_EVENTS, Events

__all__ = ["OutageRetry", "is_transient"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The worker's jitter is small: a shutdown waits out at most one backoff, and workers retrying
#: one Redis are few, where producers may be many.
WORKER_JITTER_S = 0.1


class OutageRetry:
    """Runs one task's Redis calls through outages, with one log line at each end of each.

    ``give_up`` is checked between tries: when it is set (a shutdown), the last error is raised.
    ``what`` names the task in the log lines and in ``events.redis_down``. ``interrupted`` is
    set when a call failed transiently (its answer may be lost); the caller resets it.
    """

    def __init__(
        self,
        what: str,
        give_up: threading.Event | None = None,
        max_wait_s: float = MAX_WAIT_S,
        events: Events = NO_EVENTS,
        on_retry: Callable[[BaseException], object] | None = None,
        where: str | None = None,
    ):
        self.what = what
        self.on_retry = on_retry  # told of each transient failure (a cluster redirect to follow)
        self.events = events
        self.give_up = give_up
        self.max_wait_s = max_wait_s
        self.interrupted = False
        self._retry = Retrier(
            Outage(self._down, self._up),
            give_up=give_up,
            max_wait_s=max_wait_s,
            jitter_s=WORKER_JITTER_S,
            retried=is_transient,
            on_retry=self._retrying,
            contact=None if where is None else FirstContact(where),
        )

    def call(self, fn: Callable[[], T]) -> T:
        return self._retry.call(fn)

    def _retrying(self, exc: BaseException) -> None:
        self.interrupted = True
        if self.on_retry is not None:
            self.on_retry(exc)

    def _down(self, exc: BaseException | None) -> None:
        self.events.redis_down(self.what)
        if exc is not None and is_oom(exc):
            log.warning(
                "Redis is full (maxmemory) during %s (%s); retrying with backoff", self.what, exc
            )
        else:
            log.warning(
                "Redis %s during %s (%s); retrying with backoff", _state(exc), self.what, exc
            )

    def _up(self, down_s: float) -> None:
        log.warning("Redis reachable again; %s resumed after %.1f s", self.what, down_s)


def _state(exc: BaseException | None) -> str:
    """What an error that will pass says of Redis, for the outage's log line."""
    text = str(exc)
    if text.startswith("MISCONF"):
        return "cannot persist (MISCONF: check its disk and its log) and refuses writes"
    if "read only replica" in text or text.startswith("READONLY"):
        return "is a replica (READONLY: a failover in progress, or the URL names a replica)"
    return "unreachable"
