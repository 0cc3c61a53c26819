"""A first contact with Redis: a few seconds of PING, not a whole retry window.

A client rides out an outage for ``retry_s`` (30 s by default) once it has talked to Redis. A
Redis that never answered at all is most often a wrong URL or a server not started, and waiting
30 s to say so helps nobody: the commands (``redbatch status``, ``shards``, ``replay``, ``run``)
PING first for a few seconds and fail with one line naming the URL, without its password, and
what to check.

Only "nothing answers" is decided here. A Redis that answers, even with a refusal (a wrong
password, a missing permission, ``LOADING``), is left to the caller, whose retries and messages
(``producer.redisio.retry``) say what is wrong; a misconfigured connection (TLS to a plain port
or the reverse) is named at once (``producer.redisio.misconfig``), and so is a port where
something other than Redis answers.
"""

from __future__ import annotations

import logging
import time

import redis

from producer.protocol.errors import ConnectionFailed, Misconfigured, RedisUnavailable
from producer.redisio.connection import redact_url
from producer.redisio.misconfig import FirstContact
from producer.redisio.retry import is_transient

__all__ = ["FIRST_CONTACT_S", "contact_window", "first_contact"]

log = logging.getLogger(__name__)

#: How long a command tries to reach a Redis it never reached before giving up.
FIRST_CONTACT_S = 3.0
#: The longest single connect during the first contact (a host that drops packets never refuses).
_CONNECT_S = 1.5
_FIRST_WAIT_S, _MAX_WAIT_S = 0.05, 0.5


def contact_window(retry_s: float, given: bool) -> float:
    """How long the first contact tries: ``retry_s`` when the user chose it (a script waiting
    for a Redis that is starting), else the shorter of it and ``FIRST_CONTACT_S``."""
    return retry_s if given else min(retry_s, FIRST_CONTACT_S)


def first_contact(conn: redis.Redis, url: str, window_s: float) -> None:
    """PING through ``conn``'s settings (a short connect timeout) until something answers, for
    at most ``window_s``; raises ``RedisUnavailable`` naming ``url`` (redacted) when nothing
    does, ``Misconfigured`` when the port speaks the other protocol."""
    where = redact_url(url)
    contact = FirstContact(where)
    fix = contact.preflight()
    if fix is not None:
        raise Misconfigured(fix[:1].upper() + fix[1:])
    pool = conn.connection_pool
    kwargs = {
        **pool.connection_kwargs,
        "socket_connect_timeout": min(_CONNECT_S, window_s or _CONNECT_S),
    }
    probe = redis.Redis(
        connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    )
    started = time.monotonic()
    wait = _FIRST_WAIT_S
    try:
        while True:
            try:
                probe.ping()
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                fix = contact.diagnose(exc)
                if fix is not None:
                    raise Misconfigured(fix[:1].upper() + fix[1:]) from exc
                if not _unreachable(exc):
                    return  # it answered (LOADING, say): the command's own retries take over
                elapsed = time.monotonic() - started
                if wait == _FIRST_WAIT_S and window_s > FIRST_CONTACT_S:
                    log.warning(
                        "Redis at %s does not answer (%s); trying for up to %g s (--retry-s)",
                        where,
                        _cause(exc),
                        window_s,
                    )
                if elapsed + wait > window_s:
                    raise RedisUnavailable(
                        _unreachable_message(where, exc, elapsed, window_s)
                    ) from exc
                time.sleep(wait)
                wait = min(wait * 2, _MAX_WAIT_S)
            except redis.exceptions.InvalidResponse as exc:
                raise ConnectionFailed(
                    f"What answers at {where} is not Redis ({exc}). Check the host and port "
                    "in --redis-url (or $REDIS_URL)."
                ) from exc
            except redis.RedisError:
                return  # an answer (a refusal): the command reports it in its own words
    finally:
        probe.close()
        probe.connection_pool.disconnect()


def _unreachable(exc: BaseException) -> bool:
    """True when nothing answered: refused, timed out, reset; not a Redis that is loading."""
    return is_transient(exc) and not isinstance(exc, redis.exceptions.BusyLoadingError)


def _cause(exc: BaseException) -> str:
    text = str(exc).rstrip(".")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _unreachable_message(where: str, exc: BaseException, elapsed_s: float, window_s: float) -> str:
    cause = _cause(exc)
    check = (
        "Check that Redis is running there and that --redis-url (or $REDIS_URL) names it, with "
        "the right password and TLS setting"
    )
    if window_s <= 0:
        return f"Could not talk to Redis at {where} (retry_s=0, not retried): {cause}. {check}."
    return (
        f"Could not talk to Redis at {where}: nothing answered in {elapsed_s:.1f} s ({cause}). "
        f"{check}; --retry-s S waits up to S seconds for a Redis that is starting."
    )
