"""Riding out Redis outages in the client: capped, jittered retries, one log line per outage.

Every Redis command of ``Client`` and ``AsyncClient`` runs through a ``RetryPolicy``. A command
that fails with a transient error (Redis unreachable, restarting, loading its data, busy with a
script, or a cluster slot moving, unable to persist (``MISCONF``) or a replica during a failover
(``READONLY``)) is retried at once, then with
exponential backoff from 50 ms up to 2 s plus up to 250 ms of random jitter, for at most
``retry_s`` seconds (default 30; 0 turns retrying off). Then ``RedisUnavailable`` is raised. Any
other Redis error (a missing permission, WRONGTYPE) is not retried and raises
``ConnectionFailed`` at once; a misconfigured connection (a wrong password, TLS to a plain port or
the reverse, a certificate that does not verify: ``producer.redisio.misconfig``) raises
``Misconfigured``, naming the fix, at once. A write Redis refuses for memory (``OOM`` under
``maxmemory`` with ``noeviction``) is not retried either: nothing frees memory while producers
keep trying, so it raises ``RedisFull`` at once (the clients wait for room themselves when asked
to). A BLPOP that times out is an empty answer, not an error.

The first retry is immediate because the commonest failure is one stale pooled connection after a
Redis restart, which the reconnect of the next try fixes. When the second try fails as well, one
WARNING says the outage began; when a command next succeeds, one WARNING says Redis is reachable
again and how long it was not. Tries in between log nothing.

Retries resend the same command: a submit's request id and body are fixed before its first try, so a
retried XADD can only add the same request again, never a different one. If Redis executed an XADD
but the connection dropped before the answer arrived, the stream holds that request twice. That is
the contract's at-least-once delivery: a worker may run it twice, but writes a reply only when none
exists, so callers still see one reply. (If the caller consumed the first reply before the second
run, the second reply sits unread until its TTL.) Likewise a reply popped by an LPOP or BLPOP whose
answer was lost in the outage is gone. ``infer`` and ``map`` of both clients (and so ``redbatch
run``) therefore send the requests they still await again, same request ids, when a pop of theirs
needed a retry (``ReplyWaiter.interrupted``): a reply lost in flight, or a request a Redis restarted
without persistence forgot, is run again rather than ending in ``WaitTimeout``. A copy of a request
whose reply was read in the meantime is answered too, and that reply expires unread. A plain
``wait`` has no body to send again, so its wait still ends in ``WaitTimeout`` then.

One engine serves the client and the worker: ``Retrier`` holds the backoff, the classifier of
transient errors and an ``Outage`` (one line when an outage starts, one when it ends, with its
length), and stops retrying at a deadline (the client's ``retry_s``) or when an event is set (a
worker's shutdown); ``Retrier.call`` and ``Retrier.acall`` are its blocking and asyncio shells.
``RetryPolicy`` is the client's use of it, adding the deadline's bounds and the translation of
redis-py's errors into the client's; ``worker.redisio.retry.OutageRetry`` is the worker's.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, replace
from typing import Any, ParamSpec, TypeVar

import redis.exceptions as rex
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    stop_any,
    stop_never,
    stop_when_event_set,
    wait_exponential,
    wait_random,
)
from tenacity.stop import stop_base

from producer.protocol.errors import (
    ConnectionFailed,
    Misconfigured,
    RedbatchError,
    RedisFull,
    RedisUnavailable,
)
from producer.redisio.misconfig import FirstContact, misconfiguration, never_passes

__all__ = [
    "DEFAULT_RETRY_S",
    "FIRST_WAIT_S",
    "JITTER_S",
    "MAX_WAIT_S",
    "REDIS_ERRORS",
    "Outage",
    "Retrier",
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
# READONLY is a master demoted in a failover (or a URL that reaches a replica, which no retry
# fixes: the outage line says so, and the retries end at the budget); MISCONF is a Redis that
# cannot persist (a full disk), which refuses writes until that clears (FACTS.md).
# On Redis Cluster, MOVED and ASK say that the slot is served elsewhere (now, or while it
# migrates): nothing ran, and the caller follows them (producer/redisio/topology.py) and retries.
_TRANSIENT_REFUSALS = (
    rex.OutOfMemoryError,
    rex.TryAgainError,
    rex.ClusterDownError,
    rex.AskError,  # MovedError is an AskError
    rex.ReadOnlyError,
)
# The same refusals as the codes that start an EXECABORT's reason (nothing of it ran).
_TRANSIENT_CODES = frozenset(
    {"OOM", "TRYAGAIN", "CLUSTERDOWN", "BUSY", "LOADING", "MOVED", "ASK", "MISCONF", "READONLY"}
)
# Plain error replies that will pass (redis-py maps none of them to a class of its own).
_PASSING_CODES = frozenset({"BUSY", "MISCONF", "READONLY"})
# Errors of an unreachable or misconfigured server that no retry fixes.
_NOT_TRANSIENT = (rex.AuthenticationError, rex.AuthorizationError)


def is_transient(exc: BaseException) -> bool:
    """True for errors a later try may not hit: unreachable, loading, OOM, BUSY, TRYAGAIN,
    MISCONF, READONLY; never a misconfiguration."""
    if isinstance(exc, _NOT_TRANSIENT) or never_passes(exc):
        return False
    if isinstance(exc, (rex.ConnectionError, rex.TimeoutError, *_TRANSIENT_REFUSALS)):
        return True  # BusyLoadingError (LOADING) is a ConnectionError
    if isinstance(exc, rex.ExecAbortError):  # a transaction discarded whole, for its reason
        reason = str(exc).partition("because of: ")[2]
        return reason.split(" ", 1)[0] in _TRANSIENT_CODES
    return isinstance(exc, rex.ResponseError) and _error_code(exc) in _PASSING_CODES


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
    """Whether Redis is known to be down, so that each outage is told once at each end.

    ``down(exc)`` is called when a failed retry starts an outage, ``up(down_s)`` when a call that
    succeeds ends one. One per client, shared by its threads or tasks (the lock makes "first to
    notice" exact); one per task in a worker.
    """

    def __init__(
        self,
        down: Callable[[BaseException | None], object],
        up: Callable[[float], object],
    ) -> None:
        self._down = down
        self._up = up
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic start of the current outage

    def began(self, exc: BaseException | None) -> None:
        """Note a failed retry; tells only when it starts an outage."""
        with self._lock:
            if self._since is not None:
                return
            self._since = time.monotonic()
        self._down(exc)

    @property
    def active(self) -> bool:
        """Whether an outage has begun and no command has succeeded since."""
        return self._since is not None

    def ended(self) -> None:
        """Note a command that succeeded; tells only when it ends an outage."""
        if self._since is None:  # the hot path: no lock while Redis is up
            return
        with self._lock:
            if self._since is None:
                return
            down_s, self._since = time.monotonic() - self._since, None
        self._up(down_s)


@dataclass(frozen=True, slots=True)
class Retrier:
    """Runs Redis calls, retrying them through transient errors with capped, jittered backoff.

    The first retry is immediate, then waits grow from ``FIRST_WAIT_S`` to ``max_wait_s``, plus
    up to ``jitter_s`` (no more than ``max_wait_s``). Retrying stops after ``budget_s`` seconds
    (0: never retry), or when ``give_up`` is set, or never when neither is given; the last
    error is then raised as it came. ``retried`` says which errors are retried;
    ``on_retry(exc)`` hears of each one before its retry (a cluster redirect to follow).
    With ``contact``, a misconfigured connection raises ``Misconfigured`` instead of being
    retried (``producer.redisio.misconfig``: its probes run only until a call succeeded).
    """

    outage: Outage
    _: KW_ONLY
    budget_s: float | None = None
    give_up: threading.Event | None = None
    max_wait_s: float = MAX_WAIT_S
    jitter_s: float = JITTER_S
    retried: Callable[[BaseException], bool] = is_transient
    on_retry: Callable[[BaseException], object] | None = None
    contact: FirstContact | None = None

    def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)``, retried through the errors ``retried`` accepts."""
        contact = self.contact
        if contact is not None and not contact.ever_reached:
            return self._first_call(contact, fn, *args, **kwargs)
        try:
            result = fn(*args, **kwargs)  # the hot path skips tenacity's per-call cost
        except Exception as exc:
            if not self._retries(exc):
                raise
            self._tell(exc)
            result = Retrying(**self._options())(fn, *args, **kwargs)
        self.outage.ended()
        return result

    def _first_call(
        self, contact: FirstContact, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """``call`` until one call succeeded: each failure is diagnosed first, so a wrong
        setting raises ``Misconfigured`` at once instead of being waited out as an outage."""
        _raise_misconfigured(contact.preflight(), None)

        def checked() -> T:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                _raise_misconfigured(contact.diagnose(exc), exc)
                raise

        result = replace(self, contact=None).call(checked)
        contact.reached()
        return result

    async def acall(self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """The asyncio twin of ``call``: awaits ``fn(*args, **kwargs)``."""

        contact = self.contact

        async def attempt() -> T:
            # Tenacity awaits only ``async def`` functions; redis-py's commands are plain
            # methods that return a coroutine, which it would hand back unawaited.
            if contact is None or contact.ever_reached:
                return await fn(*args, **kwargs)
            try:
                result = await fn(*args, **kwargs)
            except Exception as exc:  # the probes block: off the event loop
                _raise_misconfigured(await asyncio.to_thread(contact.diagnose, exc), exc)
                raise
            contact.reached()
            return result

        if contact is not None and not contact.ever_reached:
            _raise_misconfigured(await asyncio.to_thread(contact.preflight), None)
        try:
            result = await attempt()
        except Exception as exc:
            if not self._retries(exc):
                raise
            self._tell(exc)
            result = await AsyncRetrying(**self._options())(attempt)
        self.outage.ended()
        return result

    def _retries(self, exc: BaseException) -> bool:
        return self.budget_s != 0 and self.retried(exc)

    def _options(self) -> dict[str, Any]:
        """Tenacity's settings, shared by the blocking and asyncio shells."""
        jitter_s = min(self.jitter_s, self.max_wait_s)
        backoff = wait_exponential(multiplier=FIRST_WAIT_S, max=self.max_wait_s) + wait_random(
            0, jitter_s
        )
        wait: Callable[[RetryCallState], float] = backoff
        stops: list[stop_base] = []
        if self.budget_s is not None:
            wait = _within(backoff, self.budget_s)
            stops.append(stop_after_delay(self.budget_s))
        if self.give_up is not None:
            stops.append(stop_when_event_set(self.give_up))
        return {
            "retry": retry_if_exception(self.retried),
            "wait": wait,
            "stop": stop_any(*stops) if stops else stop_never,
            "before_sleep": self._before_sleep,
            "reraise": True,
        }

    def _before_sleep(self, state: RetryCallState) -> None:
        # Tenacity's first try is the command's second (call() made the first), so a lone stale
        # connection, fixed by the immediate retry, starts no outage.
        exc = state.outcome.exception() if state.outcome is not None else None
        if exc is not None:
            self._tell(exc)
        self.outage.began(exc)

    def _tell(self, exc: BaseException) -> None:
        if self.on_retry is None:
            return
        try:
            self.on_retry(exc)
        except Exception as failed:  # following a redirect is best effort: retries go on
            log.debug("following %s failed: %s", type(exc).__name__, failed)


def _raise_misconfigured(fix: str | None, exc: BaseException | None) -> None:
    """Raise ``Misconfigured`` with ``fix`` (from ``exc``), if there is one."""
    if fix is not None:
        raise Misconfigured(fix[:1].upper() + fix[1:]) from exc


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
        self.outage = Outage(
            functools.partial(_log_down, where, self.retry_s), functools.partial(_log_up, where)
        )
        self._limit = f"the client's retry_s={self.retry_s:g}"  # what bounds the retries
        self._contact = FirstContact(where)  # shared by the bounded copies
        self._retry = Retrier(
            self.outage, budget_s=self.retry_s, retried=_retried, contact=self._contact
        )

    def once(self) -> RetryPolicy:
        """The same client's policy without retries, for best-effort clean-up after a failure."""
        return self._bounded(0.0, "the client's retry_s=0")

    def within(self, seconds: float, limit: str) -> RetryPolicy:
        """The same policy, retrying for at most ``seconds`` more: a wait's time left, so that
        an outage never holds a call past its timeout. ``limit`` names that bound in the
        error."""
        if seconds >= self.retry_s or not self.retry_s:  # retry_s = 0: never any retry
            return self
        # Never none at all: the immediate retry after a restart (a stale pooled connection)
        # costs nothing, and is the commonest fix.
        return self._bounded(max(seconds, _LEAST_RETRY_S), limit)

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
            return self._retry.call(fn, *args, **kwargs)
        except REDIS_ERRORS as exc:
            raise self._failed(exc, started) from exc

    async def acall(self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """The asyncio twin of ``call``: awaits ``fn(*args, **kwargs)``."""
        started = time.monotonic()
        try:
            return await self._retry.acall(fn, *args, **kwargs)
        except REDIS_ERRORS as exc:
            raise self._failed(exc, started) from exc

    def _bounded(self, retry_s: float, limit: str) -> RetryPolicy:
        """This client's policy (its outage too) with its own budget, named ``limit``."""
        bounded = copy.copy(self)
        bounded.retry_s = retry_s
        bounded._limit = limit
        bounded._retry = Retrier(
            self.outage, budget_s=retry_s, retried=_retried, contact=self._contact
        )
        return bounded

    def _failed(self, exc: BaseException, started: float) -> RedbatchError:
        """The client's error for a redis-py error that ended a command started at ``started``."""
        if not _retried(exc) and isinstance(exc, rex.ResponseError):
            self.outage.ended()  # Redis answered, so whatever outage there was is over
        if is_oom(exc):
            return RedisFull(self.where, None, None, None, refused=str(exc))
        fix = misconfiguration(exc, self.where)
        if fix is not None:
            return Misconfigured(fix[:1].upper() + fix[1:])
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


def _log_down(where: str, retry_s: float, exc: BaseException | None) -> None:
    log.warning(
        "Redis at %s unavailable (%s); retrying for up to %g s",
        where,
        _describe(exc),
        retry_s,
        extra={"redis": where, "event": "redis_down"},
    )


def _log_up(where: str, down_s: float) -> None:
    log.warning(
        "Redis at %s available again after %.1f s",
        where,
        down_s,
        extra={"redis": where, "event": "redis_up", "down_s": down_s},
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
