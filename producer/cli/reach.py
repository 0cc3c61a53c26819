"""The operator commands' first contact with Redis: a few seconds, not the whole ``--retry-s``.

``redbatch status``, ``shards`` and ``replay`` ride out an outage for ``--retry-s`` (30 s by
default) once they have talked to Redis, as the clients do. A Redis that never answered at all is
most often a wrong URL or a server not started, and waiting 30 s to say so helps nobody. So
before its first command each of them PINGs for ``FIRST_CONTACT_S`` (3 s; ``--retry-s`` when
given on the command line, so a script can still wait for a Redis that is starting) and fails
with one line naming the URL, without its password, and what to check.

``producer.redisio.firstcontact`` does the PINGs; ``redbatch run`` makes the same first
contact (``producer.jobs.preflight``).
"""

from __future__ import annotations

import argparse

import redis

from producer.ops.models import find_live_models
from producer.redisio.firstcontact import FIRST_CONTACT_S, contact_window, first_contact

__all__ = ["first_contact_s", "live_models", "open_redis"]


def first_contact_s(args: argparse.Namespace) -> float:
    """``--retry-s`` when given on the command line, else the shorter of it and 3 s."""
    retry_s = float(getattr(args, "retry_s", FIRST_CONTACT_S))
    return contact_window(retry_s, bool(getattr(args, "retry_s_given", False)))


def open_redis(args: argparse.Namespace, *, socket_timeout: float = 10.0) -> redis.Redis:
    """A client for ``--redis-url``, checked to answer within ``first_contact_s``; raises
    ``RedisUnavailable`` (exit status 2) when nothing answers there."""
    conn = redis.Redis.from_url(
        args.redis_url, socket_connect_timeout=5, socket_timeout=socket_timeout
    )
    try:
        first_contact(conn, args.redis_url, first_contact_s(args))
    except BaseException:
        conn.close()
        raise
    return conn


def live_models(args: argparse.Namespace) -> str:
    """Which models do have live workers, as far as this user may list them."""
    conn = redis.Redis.from_url(args.redis_url, socket_connect_timeout=2, socket_timeout=5)
    try:
        found = find_live_models(conn, args.prefix)
    finally:
        conn.close()
    if found is None:
        return "the models with live workers could not be listed (this user may not SCAN)"
    names = ", ".join(repr(m) for m in sorted(found.workers)) or "none"
    more = "" if found.complete else " (the scan stopped early, so there may be others)"
    return f"models with live workers: {names}{more}"
