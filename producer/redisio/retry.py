"""Riding out Redis outages in the client: capped, jittered retries, one log line per outage.

Every Redis command of ``Client`` and ``AsyncClient`` runs through a ``RetryPolicy``. A command
that fails with a transient error (Redis unreachable, restarting, loading its data, busy with a
script, or a cluster slot moving) is retried at once, then with
exponential backoff from 50 ms up to 2 s plus up to 250 ms of random jitter, for at most
``retry_s`` seconds (default 30; 0 turns retrying off). Then ``RedisUnavailable`` is raised. Any
other Redis error (a wrong password, a missing permission, WRONGTYPE) is not retried and raises
``ConnectionFailed`` at once. A write Redis refuses for memory (``OOM`` under ``maxmemory`` with
``noeviction``) is not retried either: nothing frees memory while producers keep trying, so it
raises ``RedisFull`` at once (the clients wait for room themselves when asked to). A BLPOP that
times out is an empty answer, not an error.

The first retry is immediate because the commonest failure is one stale pooled connection after a
Redis restart, which the reconnect of the next try fixes. When the second try fails as well, one
WARNING says the outage began; when a command next succeeds, one WARNING says Redis is reachable
again and how long it was not. Tries in between log nothing.

Retries resend the same command: a submit's request id and body are fixed before its first try,
so a retried XADD can only add the same request again, never a different one. If Redis executed
an XADD but the connection dropped before the answer arrived, the stream holds that request twice.
That is the contract's at-least-once delivery: a worker may run it twice, but writes a reply only
when none exists, so callers still see one reply. (If the caller consumed the first reply before
the second run, the second reply sits unread until its TTL.) Likewise a reply popped by an LPOP or
BLPOP whose answer was lost in the outage is gone. ``Client.infer``, ``Client.map`` and
``AsyncClient.map`` (and so ``redbatch run``) therefore send the requests they still await
again, same request ids, when a pop of theirs needed a retry (``ReplyWaiter.interrupted``): a
reply lost in flight, or a request a Redis restarted without persistence forgot, is run again
rather than ending in ``WaitTimeout``. A copy of a request whose reply was read in the meantime
is answered too, and that reply expires unread. A plain ``wait`` has no body to send again, so
its wait still ends in ``WaitTimeout`` then.

``RetryPolicy.call`` and ``RetryPolicy.acall`` are the blocking and asyncio shells over the same
policy (``_options``) and the same error translation (``_error``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

import redis.exceptions as rex
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from producer.protocol.errors import ConnectionFailed, RedbatchError, RedisFull, RedisUnavailable

__all__ = [
    "DEFAULT_RETRY_S",
    "FIRST_WAIT_S",
    "JITTER_S",
    "MAX_WAIT_S",
    "REDIS_ERRORS",
    "Outage",
    "RetryPolicy",
    "describe_redis_error",
    "is_oom",
    "is_transient",
]

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

#: How long a command is retried by default: long enough for a Redis restart or failover.
DEFAULT_RETRY_S = 30.0
FIRST_WAIT_S = 0.05
MAX_WAIT_S = 2.0
#: Added after the cap (tenacity's wait_exponential_jitter caps the sum, so every client at the
#: cap would retry in lockstep); spreads many producers reconnecting to one restarted Redis.
JITTER_S = 0.25

#: Every redis-py error a client command can raise (AuthenticationError is a ConnectionError).
REDIS_ERRORS = (rex.ConnectionError, rex.TimeoutError, rex.ResponseError)

# Refusals that mean "not now" and guarantee the command did not run, so a retry is safe.
# READONLY is left out: it means the URL reaches a replica, and retrying on the same pooled
# connection keeps reaching it; following a failover is a Sentinel or Cluster client's job.
# On Redis Cluster, MOVED and ASK say that the slot is served elsewhere (now, or while it
# migrates): nothing ran, and the caller follows them (producer/redisio/topology.py) and retries.
_TRANSIENT_REFUSALS = (
    rex.OutOfMemoryError,
    rex.TryAgainError,
    rex.ClusterDownError,
    rex.AskError,  # MovedError is an AskError
)
# The same refusals as the codes that start an EXECABORT's reason (nothing of it ran).
_TRANSIENT_CODES = frozenset({"OOM", "TRYAGAIN", "CLUSTERDOWN", "BUSY", "LOADING", "MOVED", "ASK"})
# Errors of an unreachable or misconfigured server that no retry fixes.
_NOT_TRANSIENT = (rex.AuthenticationError, rex.AuthorizationError)


def is_transient(exc: BaseException) -> bool:
    """True for errors a later try may not hit: unreachable, loading, OOM, BUSY, TRYAGAIN."""
    if isinstance(exc, _NOT_TRANSIENT):
        return False
    if isinstance(exc, (rex.ConnectionError, rex.TimeoutError, *_TRANSIENT_REFUSALS)):
        return True  # BusyLoadingError (LOADING) is a ConnectionError
    if isinstance(exc, rex.ExecAbortError):  # a transaction discarded whole, for its reason
        reason = str(exc).partition("because of: ")[2]
        return reason.split(" ", 1)[0] in _TRANSIENT_CODES
    return isinstance(exc, rex.ResponseError) and _error_code(exc) == "BUSY"


def is_oom(exc: BaseException) -> bool:
    """True for Redis's refusal of a write for memory (``maxmemory`` with ``noeviction``), also
    as the reason a transaction was discarded."""
    if isinstance(exc, rex.OutOfMemoryError):
        return True
    if isinstance(exc, rex.ExecAbortError):
        return str(exc).partition("because of: ")[2].startswith("OOM")
    return isinstance(exc, rex.ResponseError) and _error_code(exc) == "OOM"


def describe_redis_error(exc: BaseException) -> str:
    """A Redis error as log lines name it: a refusal for memory says that Redis is full, so that
    an operator does not look for a network fault."""
    if is_oom(exc):
        return f"Redis is full (maxmemory): {_describe(exc)}"
    return _describe(exc)


def _error_code(exc: BaseException) -> str:
    """The first word of a Redis error reply, also when a pipeline prefixed it with context."""
    message = str(exc).rpartition("caused error: ")[2]
    return message.split(" ", 1)[0]


class Outage:
    """Whether Redis is known to be down, so an outage is logged once at each end.

    One per client, shared by its threads or tasks; the lock makes "first to notice" exact.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic start of the current outage

    def began(self, exc: BaseException | None, retry_s: float) -> None:
        """Note a failed retry; logs only when it starts an outage."""
        with self._lock:
            if self._since is not None:
                return
            self._since = time.monotonic()
        log.warning(
            "Redis at %s unavailable (%s); retrying for up to %g s",
            self.where,
            _describe(exc),
            retry_s,
            extra={"redis": self.where, "event": "redis_down"},
        )

    @property
    def active(self) -> bool:
        """Whether an outage has begun and no command has succeeded since."""
        return self._since is not None

    def ended(self) -> None:
        """Note a command that succeeded; logs only when it ends an outage."""
        if self._since is None:  # the hot path: no lock while Redis is up
            return
        with self._lock:
            if self._since is None:
                return
            down_s, self._since = time.monotonic() - self._since, None
        log.warning(
            "Redis at %s available again after %.1f s",
            self.where,
            down_s,
            extra={"redis": self.where, "event": "redis_up", "down_s": down_s},
        )


_LEAST_RETRY_S = 0.001  # a bounded wait still gets its immediate retry


class RetryPolicy:
    """How one client retries its Redis commands: which errors, how long, and what it logs."""

    def __init__(self, where: str, retry_s: float = DEFAULT_RETRY_S) -> None:
        if isinstance(retry_s, bool) or not isinstance(retry_s, int | float) or not retry_s >= 0:
            raise ValueError(
                f"retry_s must be a number of seconds >= 0 (0 turns retrying off), got {retry_s!r}."
            )
        self.where = where
        self.retry_s = float(retry_s)
        self.outage = Outage(where)
        self._limit = f"the client's retry_s={self.retry_s:g}"  # what bounds the retries
        self._client_retry_s = self.retry_s  # the client's own budget, for the outage's log line

    def once(self) -> RetryPolicy:
        """The same client's policy without retries, for best-effort clean-up after a failure."""
        single = RetryPolicy(self.where, 0)
        single.outage = self.outage
        return single

    def within(self, seconds: float, limit: str) -> RetryPolicy:
        """The same policy, retrying for at most ``seconds`` more: a wait's time left, so that
        an outage never holds a call past its timeout. ``limit`` names that bound in the
        error."""
        if seconds >= self.retry_s or not self.retry_s:  # retry_s = 0: never any retry
            return self
        # Never none at all: the immediate retry after a restart (a stale pooled connection)
        # costs nothing, and is the commonest fix.
        bounded = RetryPolicy(self.where, max(seconds, _LEAST_RETRY_S))
        bounded.outage = self.outage
        bounded._limit = limit
        bounded._client_retry_s = self._client_retry_s
        return bounded

    def until(self, deadline: float | None, limit: str) -> RetryPolicy:
        """``within`` the time left before the monotonic ``deadline``; None: this policy. For
        calls that carry a deadline through several commands (``infer``'s submit)."""
        if deadline is None:
            return self
        return self.within(deadline - time.monotonic(), limit)

    def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)``, retried through transient errors; raises ConnectionFailed,
        or RedisFull for a write refused for memory."""
        started = time.monotonic()
        try:
            try:
                result = fn(*args, **kwargs)  # the hot path skips tenacity's per-call cost
            except REDIS_ERRORS as exc:
                if not self._retries(exc):
                    raise
                result = Retrying(**self._options())(fn, *args, **kwargs)
        except REDIS_ERRORS as exc:
            raise self._failed(exc, started) from exc
        self.outage.ended()
        return result

    async def acall(self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """The asyncio twin of ``call``: awaits ``fn(*args, **kwargs)``."""

        async def attempt() -> T:
            # Tenacity awaits only ``async def`` functions; redis-py's commands are plain
            # methods that return a coroutine, which it would hand back unawaited.
            return await fn(*args, **kwargs)

        started = time.monotonic()
        try:
            try:
                result = await attempt()
            except REDIS_ERRORS as exc:
                if not self._retries(exc):
                    raise
                result = await AsyncRetrying(**self._options())(attempt)
        except REDIS_ERRORS as exc:
            raise self._failed(exc, started) from exc
        self.outage.ended()
        return result

    def _retries(self, exc: BaseException) -> bool:
        return self.retry_s > 0 and _retried(exc)

    def _options(self) -> dict[str, Any]:
        """Tenacity's settings, shared by the blocking and asyncio shells."""
        backoff = wait_exponential(multiplier=FIRST_WAIT_S, max=MAX_WAIT_S) + wait_random(
            0, JITTER_S
        )
        return {
            "retry": retry_if_exception(_retried),
            "wait": _within(backoff, self.retry_s),
            "stop": stop_after_delay(self.retry_s),
            "before_sleep": self._before_sleep,
            "reraise": True,
        }

    def _before_sleep(self, state: RetryCallState) -> None:
        # Tenacity's first try is the command's second (call() made the first), so a lone stale
        # connection, fixed by the immediate retry, never gets here.
        exc = state.outcome.exception() if state.outcome is not None else None
        self.outage.began(exc, self._client_retry_s)

    def _failed(self, exc: BaseException, started: float) -> RedbatchError:
        """The client's error for a redis-py error that ended a command started at ``started``."""
        if not _retried(exc) and isinstance(exc, rex.ResponseError):
            self.outage.ended()  # Redis answered, so whatever outage there was is over
        if is_oom(exc):
            return RedisFull(self.where, None, None, None, refused=str(exc))
        elapsed_s = time.monotonic() - started
        check = (
            "Check that Redis is running there and that the URL, password and TLS settings "
            "are right."
        )
        if is_transient(exc) and self.retry_s > 0:
            return RedisUnavailable(
                f"Redis at {self.where} stayed unavailable for {elapsed_s:.1f} s, past "
                f"{self._limit}: {_describe(exc)}. {check}"
            )
        if is_transient(exc):
            return RedisUnavailable(
                f"Could not talk to Redis at {self.where} (retry_s=0, not retried): "
                f"{_describe(exc)}. {check}"
            )
        if isinstance(exc, rex.ResponseError):
            return ConnectionFailed(f"Redis at {self.where} rejected a command: {exc}")
        return ConnectionFailed(
            f"Could not talk to Redis at {self.where}: {_describe(exc)}. {check}"
        )


def _retried(exc: BaseException) -> bool:
    """What a client retries: transient errors, but not a refusal for memory (``RedisFull``)."""
    return is_transient(exc) and not is_oom(exc)


def _within(
    backoff: Callable[[RetryCallState], float], budget_s: float
) -> Callable[[RetryCallState], float]:
    """``backoff``, cut so the last sleep ends at the budget and one more try fits in it."""

    def wait(state: RetryCallState) -> float:
        return max(0.0, min(backoff(state), budget_s - (state.seconds_since_start or 0.0)))

    return wait


def _describe(exc: BaseException | None) -> str:
    """The error as one clause, without the final full stop redis-py's messages end in (the
    caller's sentence puts its own)."""
    if exc is None:
        return "no error recorded"
    text = str(exc).rstrip(".")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
